// Verify kernels (SPEC §6). kvc_verify reads a materialised VerifyPlan; kvc_fused_verify derives
// every entry from the engine's req_to_token and the per-request entry offsets of kvc_prepare, so
// the per-entry plan never touches memory. Both are graph-safe: every per-step value is read from
// device memory. Grid-stride over entries, KVC_VERIFY_ILP entries per thread per round with all
// their loads issued before the first check; any grid size is correct.
#include "common.cuh"

#define KVC_VERIFY_ILP 4

extern "C" __global__ void __launch_bounds__(256) kvc_verify(const __grid_constant__ KvcVerifyParams p) {
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (tid == 0) atomicAdd(p.kernel_run_counter, 1ULL);
  if (*p.plan_enable == 0) return;
  const long long active = kvc_clamp(*p.plan_num_valid, 0, p.plan_capacity);
  if (tid == 0) atomicAdd(p.slot_run_counter, (unsigned long long)active);
  const bool check = p.check_expected_token != 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long e0 = tid; e0 < active; e0 += stride * KVC_VERIFY_ILP) {
    long long slot[KVC_VERIFY_ILP], tok[KVC_VERIFY_ILP], pos[KVC_VERIFY_ILP], prev[KVC_VERIFY_ILP];
    KvcSlotLoad loaded[KVC_VERIFY_ILP];
#pragma unroll
    for (int u = 0; u < KVC_VERIFY_ILP; ++u) {
      const long long e = e0 + u * stride;
      const bool in = e < active;
      slot[u] = in ? p.plan_slot[e] : KVC_PADDING_SLOT;
      tok[u] = in ? p.plan_expected_token[e] : KVC_NO_EXPECTED_TOKEN;
      pos[u] = in ? p.plan_expected_position[e] : 0;
      prev[u] = in ? p.plan_prev_slot[e] : KVC_PADDING_SLOT;
    }
#pragma unroll
    for (int u = 0; u < KVC_VERIFY_ILP; ++u) loaded[u] = kvc_verify_load(p, slot[u], prev[u]);
#pragma unroll
    for (int u = 0; u < KVC_VERIFY_ILP; ++u) kvc_verify_check(p, slot[u], tok[u], pos[u], prev[u], check, loaded[u]);
  }
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
  for (long long e0 = tid; e0 < active; e0 += stride * KVC_VERIFY_ILP) {
    long long slot[KVC_VERIFY_ILP], tok[KVC_VERIFY_ILP], pos[KVC_VERIFY_ILP], prev[KVC_VERIFY_ILP];
    KvcSlotLoad loaded[KVC_VERIFY_ILP];
#pragma unroll
    for (int u = 0; u < KVC_VERIFY_ILP; ++u) {
      const long long e = e0 + u * stride;
      slot[u] = prev[u] = KVC_PADDING_SLOT;
      tok[u] = KVC_NO_EXPECTED_TOKEN;
      pos[u] = 0;
      if (e < active) {
        const long long r = kvc_owner(p, e);
        const KvcRequest q = kvc_request(p, r);
        pos[u] = q.lo + (e - p.entry_offsets[r]);
        kvc_entry(p, r, q, pos[u], &slot[u], &prev[u], &tok[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < KVC_VERIFY_ILP; ++u) loaded[u] = kvc_verify_load(p, slot[u], prev[u]);
#pragma unroll
    for (int u = 0; u < KVC_VERIFY_ILP; ++u) kvc_verify_check(p, slot[u], tok[u], pos[u], prev[u], check, loaded[u]);
  }
}
