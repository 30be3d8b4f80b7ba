// Plan builder (docs/format.md §8) in two launches (device code shared with the fold of HEAD's first
// launch in plan.cuh). kvc_prepare (one block) scans the batch:
// per-request verify-entry offsets, the WritePlan (offsets, seeds, num_valid_reqs) and the
// overflow rule, and reports every batch value it rejects (abi.BatchField) through its sink. A
// step's first kvc_prepare also resets the step's request verdicts (§5.7).
// kvc_expand materialises the per-entry VerifyPlan from those offsets; the fused verify skips it.
#include "plan.cuh"

extern "C" __global__ void __launch_bounds__(KVC_PREPARE_THREADS) kvc_prepare(const __grid_constant__ KvcPrepareParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  __shared__ long long warp_totals[32];
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
  kvc_prepare_finish(p, entries_before, tokens_before);
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
