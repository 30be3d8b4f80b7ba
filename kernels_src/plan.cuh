// The plan builder's device code (docs/format.md §8) shared by kvc_prepare (plan.cu) and the fold of
// HEAD's first launch (kvc_prepare_write_pair, write.cu).
#pragma once
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
// KVC_CHAIN_HEAD. Reads only: kvc_prepare_request also reports.
template <class B>
__device__ __forceinline__ long long kvc_request_seed(const B& p, const KvcRequest& q) {
  if (q.field != 0) return KVC_SEED_INVALID + q.field;
  if (!q.ok || q.prefix == 0 || q.tokens == 0) return KVC_CHAIN_HEAD;
  const long long seed = kvc_map_slot(p, kvc_rtt(p, q.row, q.prefix - 1));
  // a map value that collides with the rejection markers is out of range, as the write reports
  return (seed > KVC_SEED_INVALID && seed <= KVC_SEED_INVALID + KVC_BATCH_FIELD_MAX) ? KVC_SWA_UNMAPPED : seed;
}

// The rows of request r the plan builder reports: a rejected value, padding before a real row.
__device__ __forceinline__ void kvc_report_request(const KvcPrepareParams& p, long long r, const KvcRequest& q) {
  if (q.field != 0) {
    kvc_record_batch(p, KVC_NO_SLOT, r, q.field, q.value, q.bound);
  } else if (q.row == 0 && r + 1 < p.batch_size) {
    const long long next = p.req_pool_indices[r + 1];
    if (next != 0) kvc_record_batch(p, KVC_NO_SLOT, r, KVC_BATCH_PADDING_ORDER, 0, next);
  }
}

// Request r's seed (kvc_request_seed), its rows reported (kvc_report_request).
__device__ __forceinline__ long long kvc_prepare_request(const KvcPrepareParams& p, long long r, const KvcRequest& q) {
  kvc_report_request(p, r, q);
  return kvc_request_seed(p, q);
}

// kvc_prepare's whole-batch part once the batch's entry and token totals are known (every thread of
// one block): the offsets past the batch, the new tokens against the write ranges, the plan's flags.
__device__ __forceinline__ void kvc_prepare_finish(const KvcPrepareParams& p, long long entries_before,
                                                   long long tokens_before) {
  __shared__ unsigned long long first_unowned;
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

