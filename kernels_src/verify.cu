// Verify kernels (SPEC §6). kvc_verify reads a materialised VerifyPlan; kvc_fused_verify derives
// every entry from the engine's req_to_token and the per-request entry offsets of kvc_prepare, so
// the per-entry plan never touches memory. Both are graph-safe: every per-step value is read from
// device memory. Grid-stride over entries; any grid size is correct.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) kvc_verify(const __grid_constant__ KvcVerifyParams p) {
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (tid == 0) atomicAdd(p.kernel_run_counter, 1ULL);
  if (*p.plan_enable == 0) return;
  const long long active = kvc_clamp(*p.plan_num_valid, 0, p.plan_capacity);
  if (tid == 0) atomicAdd(p.slot_run_counter, (unsigned long long)active);
  const bool check = p.check_expected_token != 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long e = tid; e < active; e += stride)
    kvc_verify_entry(p, p.plan_slot[e], p.plan_expected_token[e], p.plan_expected_position[e],
                     p.plan_prev_slot[e], check);
}

extern "C" __global__ void __launch_bounds__(256)
kvc_fused_verify(const __grid_constant__ KvcFusedVerifyParams p) {
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (tid == 0) atomicAdd(p.kernel_run_counter, 1ULL);
  if (*p.verify_enable == 0) return;
  const long long active = kvc_clamp(*p.verify_num_valid, 0, p.verify_capacity);
  if (tid == 0) atomicAdd(p.slot_run_counter, (unsigned long long)active);
  const bool check = p.check_expected_token != 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long e = tid; e < active; e += stride) {
    const long long r = kvc_owner(p, e);
    const KvcRequest q = kvc_request(p, r);
    long long slot, prev, tok;
    const long long pos = q.lo + (e - p.entry_offsets[r]);
    kvc_entry(p, r, q, pos, &slot, &prev, &tok);
    kvc_verify_entry(p, slot, tok, pos, prev, check);
  }
}
