#!/usr/bin/env bash
# Nsight Compute over chosen benchmarks (each measurement runs once: --benchmark-disable):
#   bash perf/ncu.sh OUT KERNEL_REGEX PYTEST_K [SECTIONS|metrics:LIST]
# e.g. bash perf/ncu.sh $OUT/verify.txt 'kvc_fused_verify|kvcb_verify_simple' 'verify_throughput and identity'
# SECTIONS defaults to speed of light, memory, warp states, occupancy and launch statistics;
# "metrics:gpu__time_duration.sum" gives one CSV row per launch instead.
set -uo pipefail
out=$1 regex=$2 k=$3 what=${4:-SpeedOfLight MemoryWorkloadAnalysis WarpStateStats Occupancy LaunchStats}
args=()
if [[ $what == metrics:* ]]; then args=(--metrics "${what#metrics:}" --csv); else for s in $what; do args+=(--section "$s"); done; fi
ncu --target-processes all -k "regex:$regex" --launch-count "${NCU_LAUNCHES:-40}" "${args[@]}" \
  python3 -m pytest perf -q -p no:cacheprovider --benchmark-disable -k "$k" > "$out" 2>&1
echo "ncu $k: exit $? ($out: $(wc -l <"$out") lines)"
