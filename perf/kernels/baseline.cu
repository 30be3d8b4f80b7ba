// The "plan + verify + one-thread-write" design of issue 6, for comparison only (perf/, never
// shipped): the shape SGLang's KV canary uses, with kvcanary's own semantics. The kernels take
// kvcanary's params structs unchanged (packed by kvcanary.ops.prepare_verify / prepare_write /
// prepare_fused_verify) and reuse kernels_src's device functions, so they differ from kvcanary's
// kernels in launch shape and work split only:
//  - kvcb_verify_persistent: the materialised plan, grid-stride over a 64 x 512 persistent grid;
//  - kvcb_write_one_thread: one thread per request, fingerprint and chain serially per entry
//    (no expected-input or position asserts: the benchmark workloads use neither);
//  - kvcb_verify_simple (issues 13 and 29): the fused verify as a competent engineer writes it
//    first, the bar kvcanary's warp-tiled fused verify must beat on every slot layout. One entry
//    per lane, grid-stride in warp-sized steps, so consecutive lanes take consecutive entries and a
//    warp's req_to_token reads coalesce; a warp's step searches the entry offsets for its first
//    and last entries only (owners.cuh); the slot's record as two 16-byte loads (one 32-byte sector);
//    the predecessor's slot and chain value shuffled from lane - 1 when that lane holds the
//    request's previous position, else loaded beside the entry's own; rows out of line; a
//    register budget without spills that keeps 6 blocks of 256 per SM resident (sm_90), launched
//    as one resident wave. No shared memory, no second entry per lane: the plain kernel, done well.
#include "common.cuh"
#include "owners.cuh"

// docs/format.md §6 step 3 for one plan entry, every record loaded directly.
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

// ---- kvcb_verify_simple --------------------------------------------------------------------------
struct KvcbRecord {
  long long token, position;
  uint64_t prev_hash, real_kv_hash;
};

// The record of `slot` (0 < slot < num_slots): one 32-byte sector, as two 16-byte loads when the
// slot stride keeps records 16-byte aligned (`vec`), else a word at a time.
__device__ __forceinline__ KvcbRecord kvcb_load(const KvcFusedVerifyParams& p, long long slot, bool vec) {
  static_assert(KVC_FIELDS_PER_SLOT == 4, "a record is two 16-byte words");
  const long long* f = kvc_slot(p, slot);
  long long w[4];
  if (vec) {
    const longlong2* v = reinterpret_cast<const longlong2*>(f);
    const longlong2 a = __ldg(v), b = __ldg(v + 1);
    w[0] = a.x;
    w[1] = a.y;
    w[2] = b.x;
    w[3] = b.y;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = __ldg(f + k);
  }
  return {w[KVC_FIELD_TOKEN], w[KVC_FIELD_POSITION], (uint64_t)w[KVC_FIELD_PREV_HASH],
          (uint64_t)w[KVC_FIELD_REAL_KV_HASH]};
}

// slot_hash of §3 from a record.
__device__ __forceinline__ uint64_t kvcb_chain(const KvcbRecord& r) {
  return kvc_mix3(r.prev_hash, (uint64_t)r.token, (uint64_t)r.position);
}

// The row of a live entry that failed a check, as kvcb_check gives it: an entry without a record its
// expected position and zeros. Out of line, and the record read again: the loop keeps no field of it
// for a row (rows are rare).
__device__ __noinline__ void kvcb_report(const KvcFusedVerifyParams& p, long long slot, long long pos, long long etok,
                                         uint64_t expected, long long bits, bool own, bool vec) {
  const KvcbRecord r = own ? kvcb_load(p, slot, vec) : KvcbRecord{0, 0, 0, 0};
  kvc_record(p, KVC_NO_REQUEST, slot, own ? r.position : pos, r.token, etok, r.prev_hash, expected, bits);
}

// The fused verify (§6 step 3 for the entries §8 derives) with the semantics of kvcb_check on
// kvc_fused_entry's entries, the rows included (no self-test, entry counts, skip counter or
// fingerprint budget: the benchmark uses none). Lane l holds entry e = base + l of request r. Lane
// l - 1 holds e - 1, which is the predecessor slot exactly when it belongs to r too and e is not
// r's first entry (`inner`): then the predecessor's slot and chain value come by shuffle. Otherwise
// (lane 0, or a request's first entry past a window) its req_to_token cell and record are loaded
// beside the entry's own, so no lane waits for a second round trip. Every lane runs every step of
// the loop (the shuffles and the owner search need the whole warp). Registers: 40 keep 6 blocks of
// 256 per SM resident without spills up to sm_90 (the benchmark launches one resident wave of
// blocks); sm_100+ code needs 48 (5 blocks).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define KVCB_SIMPLE_BLOCKS_PER_SM 5
#else
#define KVCB_SIMPLE_BLOCKS_PER_SM 6
#endif
extern "C" __global__ void __launch_bounds__(256, KVCB_SIMPLE_BLOCKS_PER_SM)
kvcb_verify_simple(const __grid_constant__ KvcFusedVerifyParams p) {
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (tid == 0) atomicAdd(p.kernel_run_counter, 1ULL);
  if (*p.verify_enable == 0 || p.batch_size <= 0) return;
  const long long active = kvc_clamp(*p.verify_num_valid, 0, p.verify_capacity);
  if (tid == 0) atomicAdd(p.slot_run_counter, (unsigned long long)active);
  const int lane = threadIdx.x & 31, requests = (int)p.batch_size;  // at most max_batch (host-checked)
  const bool check = p.check_expected_token != 0;
  const bool vec = (p.slot_stride_words & 1) == 0 && (unsigned long long)p.canary % sizeof(longlong2) == 0;
  for (long long base = tid - lane; base < active; base += (long long)gridDim.x * blockDim.x) {
    const long long e = base + lane, last = min(base + 31, active - 1);
    const int r = kvcb_owner(p.entry_offsets, requests, base, last, e < active ? e : last);
    const KvcRequest q = kvc_request(p, r);
    const long long k = e - p.entry_offsets[r];
    const bool live = e < active && q.ok && k >= 0 && k < q.n;
    const long long pos = q.lo + (live ? k : 0);
    const bool inner = __shfl_up_sync(KVC_FULL_MASK, r, 1) == r && lane > 0 && live && k > 0;
    const long long slot = live ? kvc_map_slot(p, kvc_rtt(p, q.row, pos)) : KVC_SWA_UNMAPPED;
    const long long before = live && !inner && pos > 0 ? kvc_map_slot(p, kvc_rtt(p, q.row, pos - 1)) : 0;
    const long long nb_slot = __shfl_up_sync(KVC_FULL_MASK, slot, 1);
    long long prev = KVC_CHAIN_HEAD;  // kvc_fused_entry's predecessor
    if (live && pos > 0) {
      prev = inner ? nb_slot : before;
      if (prev == KVC_PREV_ON_PADDING) prev = KVC_SWA_UNMAPPED;
      if (k > 0 && prev == KVC_PADDING_SLOT) prev = KVC_PREV_ON_PADDING;
    }
    const bool own = live && slot > 0 && slot < p.num_slots;  // a record to load
    const bool direct = own && !inner && prev > 0 && prev < p.num_slots;  // and the predecessor's
    const KvcbRecord rec = own ? kvcb_load(p, slot, vec) : KvcbRecord{0, 0, 0, 0};
    const KvcbRecord pre = direct ? kvcb_load(p, prev, vec) : KvcbRecord{0, 0, 0, 0};
    const uint64_t nb_chain = __shfl_up_sync(KVC_FULL_MASK, kvcb_chain(rec), 1);
    if (!live) continue;
    long long bits = 0, etok = KVC_NO_EXPECTED_TOKEN;
    uint64_t expected = rec.prev_hash;  // the chain is not checked
    if (!own) {
      bits = slot == KVC_PADDING_SLOT ? KVC_PADDING_SLOT_READ : KVC_SLOT_OUT_OF_RANGE;
    } else {
      if (prev == KVC_CHAIN_HEAD) {
        expected = kvc_sm(KVC_ANCHOR);
      } else if (prev == KVC_PREV_ON_PADDING) {
        bits |= KVC_PADDING_SLOT_READ;
      } else if (prev < 0 || prev >= p.num_slots) {
        expected = 0;
        bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH | KVC_SLOT_OUT_OF_RANGE;
      } else if (prev != KVC_PADDING_SLOT) {  // inner: lane - 1 loaded this very slot's record
        expected = inner ? nb_chain : kvcb_chain(pre);
      }
      if (rec.prev_hash != expected) bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH;
      if (rec.position != pos) bits |= KVC_VERIFY_POSITION_MISMATCH;
      if (check) etok = kvc_expected_token(p, r, q.row, pos);
      if (etok != KVC_NO_EXPECTED_TOKEN && rec.token != etok) bits |= KVC_VERIFY_TOKEN_MISMATCH;
      if (rec.real_kv_hash != kvc_fingerprint(p, slot)) bits |= KVC_VERIFY_REAL_KV_HASH_MISMATCH;
    }
    if (bits) kvcb_report(p, slot, pos, etok, expected, bits, own, vec);
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
