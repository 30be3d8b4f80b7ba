"""Issues 3 and 6: verify and write throughput on the GPU, next to the bounds of this run.

Verify: decode bs 256 x context 4096 = 1M entries, identity-only, PARTIAL (1 source) and ALL
(1 source, 1 KiB per token), through the materialised plan (``kvcanary.verify``) and the fused
path (``kvcanary.fused_verify``); each against (a) the bytes it must touch / copy bandwidth and
(b) its "same loads, no compute" probe. Slots are laid out as a decoding engine's allocator
leaves them (perf/workloads.py); the fused path also runs on contiguous and random layouts, to
show how much of the gap to the bytes bound is the access pattern's, and where ops launches the
request-major kernel, the entry-major one runs the same launch for comparison. Write: 256 requests x 1 token (decode) and 1 x 32768
(prefill), identity-only and ALL; a prefill against the serial-chain probe. Each benchmark's
stats are its launch's GPU time (CUDA events, L2 flushed before each round); the probe, the
entry-major comparison and the bounds are measured beside it with the same timer. Every timed
launch must leave the ring empty.
"""

from __future__ import annotations

import pytest

import kvcanary as kc

from .clocks import gpu_timed
from .workloads import DECODE_256, MODES, write

VERIFY_TARGETS = {("fused", "identity"): ("<=", 1.5), ("fused", "partial"): ("<=", 2.0)}
ALL_BANDWIDTH_TARGET = (">=", 0.7)
PREFILL_TARGETS = {"identity": ("<=", 1.3), "all": ("<=", 1.5)}


def entry_major(ctx, w, plan):
    """fn(stream) running a fused verify that ops sends to the request-major kernel on the
    entry-major one instead (same packed params), or None when ops picks entry-major anyway."""
    from kvcanary import ops
    launch = ops.prepare_fused_verify(ctx, w.batch, plan)
    if launch.name != "kvc_fused_verify_rm":
        return None
    # the entry-major tiles' launch shape, as ops gives it to every non-request-major narrow verify
    _, grid, block = ops._verify_kernel("kvc_verify", launch.rt, launch.params, plan.verify_capacity, ctx.hash_bytes)
    return lambda s: launch.rt.launch("kvc_fused_verify", grid, block, launch.address, s)


@gpu_timed
@pytest.mark.parametrize("design,layout", [("fused", "decode"), ("plan", "decode"),
                                           ("fused", "contiguous"), ("fused", "random")])
@pytest.mark.parametrize("mode", list(MODES))
def test_verify_throughput(report, workloads, timer, bounds, mode, design, layout):
    w = workloads.get(*DECODE_256, layout=layout)
    ctx = w.context(mode)
    planned = design == "plan"
    plan = w.plan(materialize=planned)
    kc.build_plan(w.batch, plan, stream=timer.handle)
    if planned:
        run = lambda s: kc.verify(ctx, plan, stream=s)  # noqa: E731
    else:
        run = lambda s: kc.fused_verify(ctx, w.batch, plan, stream=s)  # noqa: E731

    em = None if planned else entry_major(ctx, w, plan)

    t = report.gpu(run)
    assert w.violations() == 0, "the benchmark workload must verify clean"
    probe, probes = bounds.verify_probe(w, mode, plan if planned else None)
    t_em = em and timer.gpu_time(em)
    copy = bounds.copy_bandwidth
    must, touched = w.verify_bytes(mode), w.verify_touched(mode, planned)
    name = f"verify {design} {mode}, {w.label}"
    common = dict(series=f"verify {design} {mode} ({layout})", size=w.entries, **{"entries/s": w.entries / t},
                  **{"GB/s": touched / t / 1e9}, probe_s=probes, bytes_touched=touched, bytes_must=must)
    target = VERIFY_TARGETS.get((design, mode)) if layout == "decode" else None
    report.row(name, t, "s", bound=must / copy, bound_name="bytes it must touch / copy bw",
               target=target, **common)
    report.row(f"{name}: vs same-loads probe", t, "s", bound=probe, bound_name="same-loads probe")
    if t_em is not None:
        report.row(f"{name}: entry-major tiles / request-major", t_em, "s", bound=t,
                   bound_name="kvc_fused_verify_rm", ratio=t_em / t, entry_major_probe_s=probes.get("per_lane"))
    if mode == "all":
        report.row(f"{name}: bytes read / copy bandwidth", touched / t, "B/s", bound=copy,
                   bound_name="copy bw", target=ALL_BANDWIDTH_TARGET if (design, layout) == ("fused", "decode") else None)


@gpu_timed
@pytest.mark.parametrize("mode", ["identity", "all"])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_write_throughput(report, workloads, timer, bounds, shape, mode):
    w = workloads.get(*(DECODE_256 if shape == "decode" else (1, 0, 32768)))
    ctx = w.context(mode)
    plan = w.plan()
    kc.build_plan(w.batch, plan, stream=timer.handle)
    t = report.gpu(lambda s: write(ctx, plan, w.batch, s))
    assert w.violations() == 0, "the benchmark workload must write clean"
    nbytes = w.write_bytes(mode)
    extra = dict(series=f"write {mode}", size=w.new_tokens, **{"entries/s": w.new_tokens / t},
                 **{"GB/s": nbytes / t / 1e9}, bytes_must=nbytes)
    name = f"write {mode}, {'decode' if w.extend == 1 else 'prefill'} {w.bs}x{w.extend} new tokens"
    if shape == "prefill":
        chain = bounds.chain(w.new_tokens)
        report.row(name, t, "s", bound=chain, bound_name=f"serial mix3 chain x{w.new_tokens}",
                   target=PREFILL_TARGETS[mode], **extra)
    else:
        report.row(name, t, "s", bound=nbytes / bounds.copy_bandwidth,
                   bound_name="bytes it must touch / copy bw", gpu_launch_floor_s=bounds.gpu_launch_floor,
                   **extra)
