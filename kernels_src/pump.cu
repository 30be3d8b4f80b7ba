// The pump's status snapshot (docs/format.md §10) as a launch of its own: once per step on the
// step's stream, after the step's canary launches, when the step's last launch did not take it
// (kvc_step_end in common.cuh: a replayed graph, a poll, a flush). One block (the status block is a
// few hundred words at most); never raises, never waits on the host.
#include "common.cuh"

extern "C" __global__ void kvc_snapshot(const __grid_constant__ KvcSnapshotParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  if (blockIdx.x != 0) return;
  kvc_snapshot_copy(p);
}
