// Plan builder (SPEC §8) in two launches. kvc_prepare (one block) scans the batch: per-request
// verify-entry offsets, the WritePlan (offsets, seeds, num_valid_reqs) and the overflow rule.
// kvc_expand materialises the per-entry VerifyPlan from those offsets; the fused verify skips it.
#include "common.cuh"

// Inclusive block scan of one value per thread (blockDim.x a multiple of 32, at most 1024);
// *total receives the block's sum. Every thread of the block must call it.
__device__ __forceinline__ long long kvc_block_scan(long long v, long long* warp_totals, long long* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const long long up = __shfl_up_sync(KVC_FULL_MASK, v, d);
    if (lane >= d) v += up;
  }
  if (lane == 31) warp_totals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    long long t = lane < nwarps ? warp_totals[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const long long up = __shfl_up_sync(KVC_FULL_MASK, t, d);
      if (lane >= d) t += up;
    }
    warp_totals[lane] = t;
  }
  __syncthreads();
  const long long before = warp == 0 ? 0 : warp_totals[warp - 1];
  *total = warp_totals[nwarps - 1];
  __syncthreads();
  return v + before;
}

extern "C" __global__ void __launch_bounds__(KVC_PREPARE_THREADS) kvc_prepare(const __grid_constant__ KvcPrepareParams p) {
  __shared__ long long warp_totals[32];
  long long entries_before = 0, tokens_before = 0;  // carried across chunks, uniform in the block
  for (long long base = 0; base < p.batch_size; base += blockDim.x) {
    const long long r = base + threadIdx.x;
    long long entries = 0, tokens = 0, seed = KVC_CHAIN_HEAD;
    if (r < p.batch_size) {
      const KvcRequest q = kvc_request(p, r);
      entries = q.prefix - q.lo;
      tokens = q.extend;
      if (!q.padding && q.prefix > 0 && q.extend > 0) seed = kvc_map_slot(p, kvc_rtt(p, q.row, q.prefix - 1));
    }
    long long entries_total, tokens_total;
    const long long entries_incl = kvc_block_scan(entries, warp_totals, &entries_total);
    const long long tokens_incl = kvc_block_scan(tokens, warp_totals, &tokens_total);
    if (r < p.batch_size) {
      p.entry_offsets[r + 1] = entries_before + entries_incl;
      p.write_offsets[r + 1] = tokens_before + tokens_incl;
      p.write_seed[r] = seed;
    }
    entries_before += entries_total;
    tokens_before += tokens_total;
  }
  if (threadIdx.x == 0) {
    p.entry_offsets[0] = 0;
    p.write_offsets[0] = 0;
    *p.write_num_valid_reqs = (int)p.batch_size;
    const bool overflow = entries_before > p.verify_capacity;
    *p.verify_num_valid = (int)(overflow ? p.verify_capacity : entries_before);
    *p.verify_enable = overflow ? 0 : 1;
  }
}

// Materialise VerifyPlan entries [0, num_valid) when enabled; entries past num_valid are never read.
extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS) kvc_expand(const __grid_constant__ KvcExpandParams p) {
  if (*p.verify_enable == 0) return;
  const long long active = kvc_clamp(*p.verify_num_valid, 0, p.verify_capacity);
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < active; e += stride) {
    const long long r = kvc_owner(p, e);
    const KvcRequest q = kvc_request(p, r);
    const long long pos = q.lo + (e - p.entry_offsets[r]);
    long long slot, prev, tok;
    kvc_entry(p, r, q, pos, &slot, &prev, &tok);
    p.plan_slot[e] = slot;
    p.plan_prev_slot[e] = prev;
    p.plan_expected_token[e] = tok;
    p.plan_expected_position[e] = pos;
  }
}
