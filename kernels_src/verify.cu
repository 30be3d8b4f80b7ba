// Verify kernels (docs/format.md §6). kvc_verify reads a materialised VerifyPlan; kvc_fused_verify
// derives every entry from the engine's req_to_token and the entry offsets of kvc_prepare, so the
// per-entry plan never touches memory. Both are graph-safe (every per-step value is read from
// device memory) and any grid size is correct (grid-stride over block tiles).
//
// A block tile is VT x BLOCK consecutive entries, thread t holding entries tile + v * BLOCK + t:
// index loads are coalesced whatever the slot layout, and all of a thread's loads are issued
// before the first result is needed. Entry e's predecessor is usually entry e - 1 (the same
// request's previous position), whose chain value the tile shares through shared memory instead
// of loading that record again; where it is not (a tile's first entry, a request's first entry,
// a plan whose entries are not in order), the predecessor's record is loaded directly. The *_wide
// variants (strips of KVC_WIDE_HASH_BYTES or more) fetch a warp's strips cooperatively.
//
// Safety: the plan, the offsets and the batch are device data that an engine bug can fill with
// anything. Slots are checked against the canary buffer before any load; a fused entry is read
// only when it is an entry of its request in the batch this launch was given (which may differ
// from the batch the plan was built from: those entries are skipped and counted, and block 0
// reports each request whose entry count disagrees).
#include "fingerprint.cuh"

#ifdef KVC_TUNE_VT  // the tuning benchmark compiles variants of the tile depth and occupancy
#define KVC_VT KVC_TUNE_VT
#define KVC_VERIFY_BLOCKS_PER_SM KVC_TUNE_BLOCKS_PER_SM
#else
#define KVC_VT KVC_VERIFY_LANE_ENTRIES
#define KVC_VERIFY_BLOCKS_PER_SM KVC_VERIFY_MIN_BLOCKS
#endif

struct KvcRecord {
  long long token, position;
  uint64_t prev_hash, real_kv_hash;
};

template <class P>
__device__ __forceinline__ KvcRecord kvc_load_record(const P& p, long long slot) {
  const long long* f = kvc_slot(p, slot);
  long long w[4];
  if ((p.slot_stride_words & 1) == 0 && ((unsigned long long)p.canary & 15) == 0) {
    const longlong2 a = __ldg(reinterpret_cast<const longlong2*>(f)), b = __ldg(reinterpret_cast<const longlong2*>(f) + 1);
    w[0] = a.x; w[1] = a.y; w[2] = b.x; w[3] = b.y;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = __ldg(f + k);
  }
  return {w[KVC_FIELD_TOKEN], w[KVC_FIELD_POSITION], (uint64_t)w[KVC_FIELD_PREV_HASH], (uint64_t)w[KVC_FIELD_REAL_KV_HASH]};
}

// Launch prologue (§6 step 1): count the launch; the number of active entries, or -1 when the
// plan is disabled.
template <class P>
__device__ __forceinline__ long long kvc_verify_begin(const P& p, const int* enable, const int* num_valid,
                                                      long long capacity) {
  const bool first = blockIdx.x == 0 && threadIdx.x == 0;
  if (first) atomicAdd(p.kernel_run_counter, 1ULL);
  if (*enable == 0) return -1;
  const long long active = kvc_clamp(*num_valid, 0, capacity);
  if (first) atomicAdd(p.slot_run_counter, (unsigned long long)active);
  return active;
}

// The checks of §6 step 3 for one live entry whose record `r` was loaded when its slot is in
// range; `pred` is the chain value its predecessor gives (used when prev is a slot in range).
template <class P>
__device__ __forceinline__ void kvc_check(const P& p, const KvcEntry& x, const KvcRecord& r, uint64_t rkv,
                                          uint64_t pred, bool check) {
  if (x.slot == KVC_PADDING_SLOT) {  // a real request never reads the padding slot
    kvc_record(p, x.slot, x.position, 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_PADDING_SLOT_READ);
    return;
  }
  if (x.slot < 0 || x.slot >= p.num_slots) {
    kvc_record(p, x.slot, x.position, 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_SLOT_OUT_OF_RANGE);
    return;
  }
  long long bits = 0;
  uint64_t expected_chain = r.prev_hash;  // not checked (predecessor on the padding slot)
  if (x.prev == KVC_CHAIN_HEAD) {
    expected_chain = kvc_sm(KVC_ANCHOR);
  } else if (x.prev == KVC_PREV_ON_PADDING) {
    bits |= KVC_PADDING_SLOT_READ;
  } else if (x.prev < 0 || x.prev >= p.num_slots) {
    expected_chain = 0;
    bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH | KVC_SLOT_OUT_OF_RANGE;
  } else if (x.prev != KVC_PADDING_SLOT) {
    expected_chain = pred;
  }
  if (r.prev_hash != expected_chain) bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH;
  if (r.position != x.position) bits |= KVC_VERIFY_POSITION_MISMATCH;
  if (r.real_kv_hash != rkv) bits |= KVC_VERIFY_REAL_KV_HASH_MISMATCH;
  if (check && x.expected_token != KVC_NO_EXPECTED_TOKEN && r.token != x.expected_token)
    bits |= KVC_VERIFY_TOKEN_MISMATCH;
  if (bits)
    kvc_record(p, x.slot, r.position, r.token, check ? x.expected_token : KVC_NO_EXPECTED_TOKEN, r.prev_hash,
               expected_chain, bits);
}

// Block 0 of a fused verify: one BATCH row per request whose entry count in the plan differs
// from what this launch's batch gives (e.g. the batch changed between HEAD and TAIL).
template <class B>
__device__ __forceinline__ void kvc_check_entry_counts(const B& p) {
  for (long long r = threadIdx.x; r < p.batch_size; r += blockDim.x) {
    const KvcRequest q = kvc_request(p, r);
    const long long planned = p.entry_offsets[r + 1] - p.entry_offsets[r];
    if (planned != q.n) kvc_record_batch(p, -1, r, KVC_BATCH_ENTRY_COUNT, planned, q.n);
  }
}

template <int VT, int BLOCK, bool WIDE, bool FUSED, class P>
__device__ __forceinline__ void kvc_verify_tiles(const P& p, const int* enable, const int* num_valid, long long capacity,
                                                 KvcWideStage* stage) {
  constexpr int kTile = VT * BLOCK;
  __shared__ uint64_t succ_sh[kTile];  // the chain value a successor of each tile entry expects
  __shared__ long long slot_sh[kTile];  // each tile entry's slot (0 when its record was not loaded)
  __shared__ long long owners[2];
  const long long active = kvc_verify_begin(p, enable, num_valid, capacity);
  if (active < 0) return;  // disabled: the same in every thread
  if constexpr (FUSED) {
    if (blockIdx.x == 0) kvc_check_entry_counts(p);
  }
  const bool check = p.check_expected_token != 0;
  const int tid = threadIdx.x;
  unsigned skipped = 0;
  for (long long tile = (long long)blockIdx.x * kTile; tile < active; tile += (long long)gridDim.x * kTile) {
    long long r_lo = 0, r_hi = 1;
    if constexpr (FUSED) {  // the owners of the tile's first and last entries bound every entry's owner
      if (tid < 2) owners[tid] = kvc_owner(p, tid == 0 ? tile : min(tile + kTile, active) - 1);
      __syncthreads();
      r_lo = owners[0];
      r_hi = max(owners[0], owners[1]) + 1;
    }
    KvcEntry x[VT];
#pragma unroll
    for (int v = 0; v < VT; ++v) {
      const long long e = tile + v * BLOCK + tid;
      if constexpr (FUSED) {
        const bool in = e < active && p.batch_size > 0;  // an empty batch has no request to own e
        x[v] = in ? kvc_fused_entry(p, e, kvc_owner_in(p, e, r_lo, r_hi))
                  : KvcEntry{0, KVC_CHAIN_HEAD, KVC_NO_EXPECTED_TOKEN, 0, false};
        skipped += e < active && !x[v].live;
      } else {
        const bool in = e < active;
        const long long at = in ? e : 0;
        x[v] = {p.plan_slot[at], p.plan_prev_slot[at], p.plan_expected_token[at], p.plan_expected_position[at], in};
      }
    }
    bool own[VT];  // the entry's record is loaded (a live entry on a slot in range)
    KvcRecord rec[VT];
    uint64_t rkv[VT];
#pragma unroll
    for (int v = 0; v < VT; ++v) {
      own[v] = x[v].live && x[v].slot > 0 && x[v].slot < p.num_slots;
      rec[v] = own[v] ? kvc_load_record(p, x[v].slot) : KvcRecord{0, 0, 0, 0};
    }
#pragma unroll
    for (int v = 0; v < VT; ++v) {
      if (WIDE) rkv[v] = kvc_fingerprint_warp(p, x[v].slot, own[v], stage[tid >> 5]);
      else rkv[v] = own[v] ? kvc_fingerprint_narrow(p, x[v].slot) : 0;
      const int i = v * BLOCK + tid;
      succ_sh[i] = kvc_mix3(rec[v].prev_hash, (uint64_t)rec[v].token, (uint64_t)rec[v].position);
      slot_sh[i] = own[v] ? x[v].slot : 0;
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < VT; ++v) {
      if (!x[v].live) continue;
      const int i = v * BLOCK + tid;
      const long long prev = x[v].prev;
      uint64_t pred = 0;
      if (own[v] && prev > 0 && prev < p.num_slots)
        pred = (i > 0 && slot_sh[i - 1] == prev) ? succ_sh[i - 1] : kvc_slot_hash(p, prev);
      kvc_check(p, x[v], rec[v], rkv[v], pred, check);
    }
    __syncthreads();  // the tile's shared values are read before the next tile's are written
  }
  kvc_warp_count(p.skip_counter, skipped);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS, KVC_VERIFY_BLOCKS_PER_SM)
kvc_verify(const __grid_constant__ KvcVerifyParams p) {
  kvc_verify_tiles<KVC_VT, KVC_BLOCK_THREADS, false, false>(p, p.plan_enable, p.plan_num_valid, p.plan_capacity, nullptr);
}

extern "C" __global__ void __launch_bounds__(KVC_WIDE_VERIFY_THREADS)
kvc_verify_wide(const __grid_constant__ KvcVerifyParams p) {
  __shared__ KvcWideStage stage[KVC_WIDE_VERIFY_THREADS / 32];
  kvc_verify_tiles<1, KVC_WIDE_VERIFY_THREADS, true, false>(p, p.plan_enable, p.plan_num_valid, p.plan_capacity, stage);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS, KVC_VERIFY_BLOCKS_PER_SM)
kvc_fused_verify(const __grid_constant__ KvcFusedVerifyParams p) {
  kvc_verify_tiles<KVC_VT, KVC_BLOCK_THREADS, false, true>(p, p.verify_enable, p.verify_num_valid, p.verify_capacity,
                                                           nullptr);
}

extern "C" __global__ void __launch_bounds__(KVC_WIDE_VERIFY_THREADS)
kvc_fused_verify_wide(const __grid_constant__ KvcFusedVerifyParams p) {
  __shared__ KvcWideStage stage[KVC_WIDE_VERIFY_THREADS / 32];
  kvc_verify_tiles<1, KVC_WIDE_VERIFY_THREADS, true, true>(p, p.verify_enable, p.verify_num_valid, p.verify_capacity,
                                                           stage);
}
