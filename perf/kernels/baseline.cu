// The "plan + verify + one-thread-write" design of issue 6, for comparison only (perf/, never
// shipped): the shape SGLang's KV canary uses, with kvcanary's own semantics. Both kernels take
// kvcanary's params structs unchanged (packed by kvcanary.ops.prepare_verify / prepare_write) and
// reuse kernels_src's device functions, so they differ from kvcanary's kernels in launch shape
// and work split only:
//  - kvcb_verify_persistent: the materialised plan, grid-stride over a 64 x 512 persistent grid;
//  - kvcb_write_one_thread: one thread per request, fingerprint and chain serially per entry
//    (no expected-input or position asserts: the benchmark workloads use neither);
//  - kvcb_verify_simple (issue 13's baseline): the fused verify written from the spec alone, one
//    entry per thread, grid-stride, a binary search over the entry offsets per entry, every load
//    (record, predecessor record, strips) its own.
#include "common.cuh"

// docs/format.md §6 step 3 for one entry, every record loaded directly.
template <class P>
__device__ __forceinline__ void kvcb_check(const P& p, const KvcEntry& x, bool check) {
  if (x.slot == KVC_PADDING_SLOT) {
    kvc_record(p, KVC_NO_REQUEST, x.slot, x.position, 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_PADDING_SLOT_READ);
    return;
  }
  if (x.slot < 0 || x.slot >= p.num_slots) {
    kvc_record(p, KVC_NO_REQUEST, x.slot, x.position, 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_SLOT_OUT_OF_RANGE);
    return;
  }
  const long long* f = kvc_slot(p, x.slot);
  const long long token = f[KVC_FIELD_TOKEN], position = f[KVC_FIELD_POSITION];
  const uint64_t prev_hash = (uint64_t)f[KVC_FIELD_PREV_HASH];
  long long bits = 0;
  uint64_t expected = prev_hash;
  if (x.prev == KVC_CHAIN_HEAD) expected = kvc_sm(KVC_ANCHOR);
  else if (x.prev == KVC_PREV_ON_PADDING) bits |= KVC_PADDING_SLOT_READ;
  else if (x.prev < 0 || x.prev >= p.num_slots) { expected = 0; bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH | KVC_SLOT_OUT_OF_RANGE; }
  else if (x.prev != KVC_PADDING_SLOT) expected = kvc_slot_hash(p, x.prev);
  if (prev_hash != expected) bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH;
  if (position != x.position) bits |= KVC_VERIFY_POSITION_MISMATCH;
  if ((uint64_t)f[KVC_FIELD_REAL_KV_HASH] != kvc_fingerprint(p, x.slot)) bits |= KVC_VERIFY_REAL_KV_HASH_MISMATCH;
  if (check && x.expected_token != KVC_NO_EXPECTED_TOKEN && token != x.expected_token) bits |= KVC_VERIFY_TOKEN_MISMATCH;
  if (bits)
    kvc_record(p, KVC_NO_REQUEST, x.slot, position, token, check ? x.expected_token : KVC_NO_EXPECTED_TOKEN, prev_hash, expected, bits);
}

extern "C" __global__ void __launch_bounds__(256)
kvcb_verify_simple(const __grid_constant__ KvcFusedVerifyParams p) {
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (tid == 0) atomicAdd(p.kernel_run_counter, 1ULL);
  if (*p.verify_enable == 0 || p.batch_size <= 0) return;
  const long long active = kvc_clamp(*p.verify_num_valid, 0, p.verify_capacity);
  if (tid == 0) atomicAdd(p.slot_run_counter, (unsigned long long)active);
  for (long long e = tid; e < active; e += (long long)gridDim.x * blockDim.x) {
    const KvcEntry x = kvc_fused_entry(p, e, kvc_owner(p, e));
    if (x.live) kvcb_check(p, x, p.check_expected_token != 0);
  }
}

extern "C" __global__ void __launch_bounds__(512)
kvcb_verify_persistent(const __grid_constant__ KvcVerifyParams p) {
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (tid == 0) atomicAdd(p.kernel_run_counter, 1ULL);
  if (*p.plan_enable == 0) return;
  const long long active = kvc_clamp(*p.plan_num_valid, 0, p.plan_capacity);
  if (tid == 0) atomicAdd(p.slot_run_counter, (unsigned long long)active);
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long e = tid; e < active; e += stride)
    kvcb_check(p, KvcEntry{p.plan_slot[e], p.plan_prev_slot[e], p.plan_expected_token[e], p.plan_expected_position[e], true},
               p.check_expected_token != 0);
}

extern "C" __global__ void __launch_bounds__(256)
kvcb_write_one_thread(const __grid_constant__ KvcWriteParams p) {
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r == 0) atomicAdd(p.kernel_run_counter, 1ULL);
  if (r >= kvc_clamp(*p.num_valid_reqs, 0, p.req_capacity)) return;
  const long long start = kvc_clamp(p.offsets[r], 0, p.num_tokens);
  const long long end = kvc_clamp(p.offsets[r + 1], start, p.num_tokens);
  const long long seed = p.seed[r];
  uint64_t running = (seed >= 0 && seed < p.num_slots) ? kvc_slot_hash(p, seed) : kvc_sm(KVC_ANCHOR);
  unsigned long long stamped = 0;
  for (long long i = start; i < end; ++i) {
    const long long slot = p.out_cache_loc[i];
    if (slot < 0 || slot >= p.num_slots) continue;
    const long long token = p.input_ids[i], position = p.positions[i];
    long long* f = p.canary + slot * p.slot_stride_words;
    f[KVC_FIELD_TOKEN] = token;
    f[KVC_FIELD_POSITION] = position;
    f[KVC_FIELD_PREV_HASH] = (long long)running;
    f[KVC_FIELD_REAL_KV_HASH] = (long long)kvc_fingerprint(p, slot);
    running = kvc_mix3(running, (uint64_t)token, (uint64_t)position);
    ++stamped;
  }
  if (stamped) atomicAdd(p.slot_run_counter, stamped);
}
