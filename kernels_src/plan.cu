// Plan builder (docs/format.md §8) in two launches. kvc_prepare (one block) scans the batch:
// per-request verify-entry offsets, the WritePlan (offsets, seeds, num_valid_reqs) and the
// overflow rule, and reports every batch value it rejects (abi.BatchField) through its sink. A
// step's first kvc_prepare also resets the step's request verdicts (§5.7).
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

// Request r's WritePlan seed (§8): its predecessor slot when it has a cached prefix and new tokens,
// KVC_SEED_INVALID + field for a request the builder rejected (the write skips its tokens), else
// KVC_CHAIN_HEAD. Reports what it rejects.
__device__ __forceinline__ long long kvc_prepare_request(const KvcPrepareParams& p, long long r, const KvcRequest& q) {
  if (q.field != 0) {
    kvc_record_batch(p, KVC_NO_SLOT, r, q.field, q.value, q.bound);
    return KVC_SEED_INVALID + q.field;
  }
  if (q.row == 0 && r + 1 < p.batch_size) {
    const long long next = p.req_pool_indices[r + 1];
    if (next != 0) kvc_record_batch(p, KVC_NO_SLOT, r, KVC_BATCH_PADDING_ORDER, 0, next);
  }
  if (!q.ok || q.prefix == 0 || q.tokens == 0) return KVC_CHAIN_HEAD;
  const long long seed = kvc_map_slot(p, kvc_rtt(p, q.row, q.prefix - 1));
  // a map value that collides with the rejection markers is out of range, as the write reports
  return (seed > KVC_SEED_INVALID && seed <= KVC_SEED_INVALID + KVC_BATCH_FIELD_MAX) ? KVC_SWA_UNMAPPED : seed;
}

extern "C" __global__ void __launch_bounds__(KVC_PREPARE_THREADS) kvc_prepare(const __grid_constant__ KvcPrepareParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  __shared__ long long warp_totals[32];
  __shared__ unsigned long long first_unowned;
  if (p.verdict_reset != 0 && p.verdicts != 0) {  // a step's first build: its verdicts start clean (§5.7)
    for (long long r = threadIdx.x; r < p.verdict_len; r += blockDim.x) p.verdicts[r] = 0ULL;
    if (threadIdx.x == 0 && p.failed_requests != 0) *p.failed_requests = 0ULL;
    __syncthreads();  // before any row of this launch is attributed
  }
  long long entries_before = 0, tokens_before = 0;  // carried across chunks, uniform in the block
  for (long long base = 0; base < p.batch_size; base += blockDim.x) {
    const long long r = base + threadIdx.x;
    long long entries = 0, tokens = 0, seed = KVC_CHAIN_HEAD;
    if (r < p.batch_size) {
      const KvcRequest q = kvc_request(p, r);
      entries = q.n;
      tokens = q.tokens;
      seed = kvc_prepare_request(p, r, q);
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
  // The new tokens against the write ranges: every range inside [0, T), and no token with a
  // real slot past them (padding tokens carry -1, skipped, or the padding slot 0).
  // Entry offsets past the batch repeat the total, so a later launch given a larger batch (an
  // engine bug between HEAD and TAIL) finds non-decreasing offsets and empty plans there.
  for (long long r = p.batch_size + 1 + threadIdx.x; r <= p.write_req_capacity; r += blockDim.x)
    p.entry_offsets[r] = entries_before;
  if (threadIdx.x == 0) first_unowned = ~0ULL;
  __syncthreads();
  if (p.out_cache_loc != 0)
    for (long long i = tokens_before + threadIdx.x; i < p.num_tokens; i += blockDim.x)
      if (p.out_cache_loc[i] > 0) atomicMin(&first_unowned, (unsigned long long)i);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (p.out_cache_loc != 0 && tokens_before > p.num_tokens)
      kvc_record_batch(p, KVC_NO_SLOT, KVC_NO_REQUEST, KVC_BATCH_TOKENS_SHORT, tokens_before, p.num_tokens);
    if (first_unowned != ~0ULL) {
      const long long i = (long long)first_unowned;
      kvc_record_batch(p, p.out_cache_loc[i], KVC_NO_REQUEST, KVC_BATCH_TOKENS_UNOWNED, i, tokens_before);
    }
    p.entry_offsets[0] = 0;
    p.write_offsets[0] = 0;
    *p.write_num_valid_reqs = (int)p.batch_size;
    const bool overflow = entries_before > p.verify_capacity;
    *p.verify_num_valid = (int)(overflow ? p.verify_capacity : entries_before);
    *p.verify_enable = overflow ? 0 : 1;
  }
}

// Materialise VerifyPlan entries [0, num_valid) when enabled, exactly as the fused verify derives
// them (kvc_fused_entry); an entry the batch does not give (it changed since kvc_prepare) is stored
// on KVC_SWA_UNMAPPED, which the verify reports as out of range.
extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS) kvc_expand(const __grid_constant__ KvcExpandParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  if (*p.verify_enable == 0 || p.batch_size <= 0) return;
  const long long active = kvc_clamp(*p.verify_num_valid, 0, p.verify_capacity);
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < active; e += stride) {
    const KvcEntry x = kvc_fused_entry(p, e, kvc_owner(p, e));
    p.plan_slot[e] = x.slot;
    p.plan_prev_slot[e] = x.prev;
    p.plan_expected_token[e] = x.expected_token;
    p.plan_expected_position[e] = x.position;
  }
}
