// Verify kernels (docs/format.md §6). kvc_verify reads a materialised VerifyPlan; kvc_fused_verify
// derives every entry from the engine's req_to_token and the entry offsets of kvc_prepare, so the
// per-entry plan never touches memory. Both are graph-safe (every per-step value is read from
// device memory) and any grid size is correct (grid-stride over warp tiles).
//
// Work is cut into warp tiles of consecutive entries: lane l holds entries v * 32 + l, v < VT, so
// every load of a tile is issued before the first result is needed, and entry e's predecessor
// entry e - 1 sits in the neighbouring lane. In a request's run of entries that predecessor entry
// is e's predecessor slot, so its chain value is shuffled across instead of loaded again: a tile
// reads each record once. The *_wide variants (strips of KVC_WIDE_HASH_BYTES or more) fetch the
// real-KV strips of a warp cooperatively, coalesced and staged through shared memory, and fold
// each strip in its own lane. One kernel for every slot layout: nothing is chosen by batch size.
//
// Safety: the plan, the offsets and the batch are device data an engine bug can fill with
// anything. Slots are checked against the canary buffer before any load; a fused entry is read
// only when it is an entry of its request in the batch this launch was given (which may differ
// from the batch the plan was built from: such entries are skipped and counted, and block 0
// reports each request whose entry count disagrees).
//
// The step's last launch (eager TAIL's last verify) also takes the pump's snapshot: every kernel
// ends in kvc_step_end, whose last block to finish copies the status block (common.cuh).
#include "fingerprint.cuh"

// The narrow kernels' tile depth follows what a lane loads (perf/test_tuning.py, decode bs 256 on
// the H200): without fingerprints, two entries per lane keep more record loads in flight; with
// them, a lane's strips already do, and one entry per lane runs about 10 % faster. The choice is
// the launch's (num_sources), the same in every thread.
#ifdef KVC_TUNE_VT  // the tuning benchmark compiles variants of the tile depth and occupancy
#define KVC_VT KVC_TUNE_VT
#define KVC_HASHED_VT KVC_TUNE_VT
#define KVC_VERIFY_BLOCKS_PER_SM KVC_TUNE_BLOCKS_PER_SM
#else
#define KVC_VT KVC_VERIFY_LANE_ENTRIES
#define KVC_HASHED_VT KVC_HASHED_LANE_ENTRIES
#define KVC_VERIFY_BLOCKS_PER_SM KVC_VERIFY_MIN_BLOCKS
#endif
// The fused *_many kernels keep the ABI's tile depth (their shared stage is sized by it; the
// tuning benchmark sweeps the narrow kernels).
#define KVC_MANY_VT KVC_VERIFY_LANE_ENTRIES

struct KvcRecord {
  long long token, position;
  uint64_t prev_hash, real_kv_hash;
};

template <class P>
__device__ __forceinline__ KvcRecord kvc_load_record(const P& p, long long slot, bool vec) {
  const long long* f = kvc_slot(p, slot);
  long long w[KVC_FIELDS_PER_SLOT];
  if (vec) {  // the record's words two at a time, in 16-byte loads
#pragma unroll
    for (int k = 0; k < KVC_FIELDS_PER_SLOT / 2; ++k) {
      const longlong2 a = __ldg(reinterpret_cast<const longlong2*>(f) + k);
      w[2 * k] = a.x;
      w[2 * k + 1] = a.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < KVC_FIELDS_PER_SLOT; ++k) w[k] = __ldg(f + k);
  }
  return {w[KVC_FIELD_TOKEN], w[KVC_FIELD_POSITION], (uint64_t)w[KVC_FIELD_PREV_HASH], (uint64_t)w[KVC_FIELD_REAL_KV_HASH]};
}

// The self-test of run `run` (§11): the canary-only record holds position SELF_TEST_POSITION + 1
// where SELF_TEST_POSITION is expected, so a working check reports it: a SELF_TEST row (slot
// num_slots: past the pool's slots; aux: the run) with the mismatch bits the comparison found.
template <class P>
__device__ __noinline__ void kvc_self_test(const P& p, unsigned long long run) {
  const long long* f = p.self_test;
  const long long token = f[KVC_FIELD_TOKEN], position = f[KVC_FIELD_POSITION];
  long long bits = KVC_SELF_TEST;
  if (position != KVC_SELF_TEST_POSITION) bits |= KVC_VERIFY_POSITION_MISMATCH;
  if (token != KVC_SELF_TEST_TOKEN) bits |= KVC_VERIFY_TOKEN_MISMATCH;
  kvc_record(p, KVC_NO_REQUEST, p.num_slots, KVC_SELF_TEST_POSITION, token, KVC_SELF_TEST_TOKEN, (uint64_t)f[KVC_FIELD_PREV_HASH],
             (uint64_t)run, bits);
}

// Launch prologue (§6 step 1): count the launch (and run the self-test when this run is due);
// the number of active entries, or KVC_PLAN_DISABLED (negative) when the plan is disabled.
template <class P>
__device__ __forceinline__ long long kvc_verify_begin(const P& p, const int* enable, const int* num_valid,
                                                      long long capacity) {
  const bool first = blockIdx.x == 0 && threadIdx.x == 0;
  if (first) {
    const unsigned long long run = atomicAdd(p.kernel_run_counter, 1ULL) + 1ULL;
    if (p.self_test != 0 && p.self_test_every > 0 && run % (unsigned long long)p.self_test_every == 0ULL)
      kvc_self_test(p, run);
  }
  if (*enable == 0) return KVC_PLAN_DISABLED;
  const long long active = kvc_clamp(*num_valid, 0, capacity);
  if (first) atomicAdd(p.slot_run_counter, (unsigned long long)active);
  return active;
}

// `x[v]` of the lane holding the entry before this lane's entry v: lane - 1, or lane 31 of v - 1
// for lane 0 (lane 0 of v = 0 gets its own value: nothing precedes it in the tile).
template <int VT, class T>
__device__ __forceinline__ T kvc_from_prev_entry(const T* x, int v) {
  T up = __shfl_up_sync(KVC_FULL_MASK, x[v], 1);
  if (v > 0) {
    const T wrap = __shfl_sync(KVC_FULL_MASK, x[v > 0 ? v - 1 : 0], 31);
    if ((threadIdx.x & 31) == 0) up = wrap;
  }
  return up;
}

// One warp tile, §6 steps 2-3 for every live entry: lane l holds tile entry i = v * 32 + l
// (v < VT), the entry held before entry i is i - 1, in the neighbouring lane (i = 0 holds the
// entry before the tile's first, for its chain value only). `held` entries are loaded, `live`
// ones verified; `nb_prev[v]`: the entry held before v is its predecessor slot, so that entry's
// chain value is used instead of loading the record again. Predecessors follow the plan's
// values (§8): -1 a chain head, 0 not checked, KVC_PREV_ON_PADDING not checked and reported.
// `fp[v]`: entry v's real KV is fingerprinted and compared (the fingerprint budget, §6.1).
// `first`: the tile's first verified entry (lane l's entry v is first - 1 + v * 32 + l), whose
// owner a row is attributed to (§5.7). Every lane of the warp must call it (shuffles).
// How a verify kernel fingerprints: one source's strips per lane (narrow), many sources batched per
// lane (many), a warp's strips fetched together (wide), or not at all: the caller's fingerprints
// (given; the block-spread *_many fold).
enum KvcFold { KVC_FOLD_NARROW, KVC_FOLD_MANY, KVC_FOLD_WIDE, KVC_FOLD_GIVEN };

// A held entry whose record the tile loads: its slot is one of the canary buffer's (not padding).
template <class P>
__device__ __forceinline__ bool kvc_tile_owns(const P& p, bool held, long long slot) {
  return held && slot > 0 && slot < p.num_slots;
}

// The request a row of verify entry e is attributed to (§5.7): the last r with offsets[r] <= e among
// the batch's requests, from the plan builder's entry offsets (for non-decreasing offsets, the
// request that owns e). Looked up only for an entry that gives a row, so the clean path holds no
// request per entry. KVC_NO_REQUEST without offsets (a sweep's plan).
__device__ __forceinline__ long long kvc_owner_of(const long long* offsets, long long n, long long e) {
  return (offsets == 0 || n <= 0) ? KVC_NO_REQUEST : kvc_owner_in(offsets, e, 0, n);
}

__device__ __forceinline__ long long kvc_row_request(const KvcFusedVerifyParams& p, long long e) {
  return kvc_owner_of(p.entry_offsets, p.batch_size, e);
}

__device__ __forceinline__ long long kvc_row_request(const KvcVerifyParams& p, long long e) {
  return kvc_owner_of(p.plan_entry_offsets, p.plan_requests, e);
}

// The row of verify entry e, attributed to its request (out of line: the clean path keeps only e).
template <class P>
__device__ __noinline__ void kvc_record_entry(const P& p, long long e, long long slot, long long position,
                                              long long stored_token, long long expected_token,
                                              uint64_t stored_chain, uint64_t expected_aux, long long bits) {
  kvc_record(p, kvc_row_request(p, e), slot, position, stored_token, expected_token, stored_chain, expected_aux,
             bits);
}

template <int VT, int FOLD, class P>
__device__ __forceinline__ void kvc_verify_tile(const P& p, const long long* slot, const long long* prev,
                                                const long long* etok, const long long* epos, long long first,
                                                const bool* held, const bool* live, const bool* nb_prev,
                                                const bool* fp, bool check, KvcWideStage* stage,
                                                const uint64_t* given = nullptr) {
  const bool vec = (p.slot_stride_words & 1) == 0 && (unsigned long long)p.canary % sizeof(longlong2) == 0;
  bool own[VT], direct[VT];  // loads this entry's record; loads the predecessor's record itself
#pragma unroll
  for (int v = 0; v < VT; ++v) {
    own[v] = kvc_tile_owns(p, held[v], slot[v]);
    direct[v] = live[v] && own[v] && prev[v] > 0 && prev[v] < p.num_slots && !nb_prev[v];
  }
  KvcRecord rec[VT];
#pragma unroll
  for (int v = 0; v < VT; ++v) rec[v] = own[v] ? kvc_load_record(p, slot[v], vec) : KvcRecord{0, 0, 0, 0};
  uint64_t prev_hash[VT];  // chain value expected from a predecessor loaded directly (rare)
#pragma unroll
  for (int v = 0; v < VT; ++v) {
    prev_hash[v] = 0;
    if (direct[v]) {
      const KvcRecord r = kvc_load_record(p, prev[v], vec);
      prev_hash[v] = kvc_mix3(r.prev_hash, (uint64_t)r.token, (uint64_t)r.position);
    }
  }
  uint64_t rkv[VT];
#pragma unroll
  for (int v = 0; v < VT; ++v) {
    const bool hashed = own[v] && live[v] && fp[v];
    if (FOLD == KVC_FOLD_GIVEN) rkv[v] = given[v];
    else if (FOLD == KVC_FOLD_WIDE) rkv[v] = kvc_fingerprint_warp(p, slot[v], hashed, stage[threadIdx.x >> 5]);
    else if (FOLD == KVC_FOLD_MANY) rkv[v] = hashed ? kvc_fingerprint_many(p, slot[v]) : 0;
    else rkv[v] = hashed ? kvc_fingerprint_narrow(p, slot[v]) : 0;
  }
  uint64_t succ[VT];  // the chain value a successor of this lane's slot expects
#pragma unroll
  for (int v = 0; v < VT; ++v) succ[v] = kvc_mix3(rec[v].prev_hash, (uint64_t)rec[v].token, (uint64_t)rec[v].position);
#pragma unroll
  for (int v = 0; v < VT; ++v) {
    const uint64_t nb_hash = kvc_from_prev_entry<VT>(succ, v);  // every lane shuffles
    if (!live[v]) continue;
    const KvcRecord& r = rec[v];
    long long bits = 0;
    uint64_t expected_chain = r.prev_hash;  // not checked (a predecessor on the padding slot)
    if (slot[v] == KVC_PADDING_SLOT || !own[v]) {  // a real request never reads the padding slot
      bits = slot[v] == KVC_PADDING_SLOT ? KVC_PADDING_SLOT_READ : KVC_SLOT_OUT_OF_RANGE;
    } else {
      if (prev[v] == KVC_CHAIN_HEAD) {
        expected_chain = kvc_sm(KVC_ANCHOR);
      } else if (prev[v] == KVC_PREV_ON_PADDING) {
        bits |= KVC_PADDING_SLOT_READ;
      } else if (prev[v] < 0 || prev[v] >= p.num_slots) {
        expected_chain = 0;
        bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH | KVC_SLOT_OUT_OF_RANGE;
      } else if (prev[v] != KVC_PADDING_SLOT) {
        expected_chain = direct[v] ? prev_hash[v] : nb_hash;
      }
      if (r.prev_hash != expected_chain) bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH;
      if (r.position != epos[v]) bits |= KVC_VERIFY_POSITION_MISMATCH;
      if (fp[v] && r.real_kv_hash != rkv[v]) bits |= KVC_VERIFY_REAL_KV_HASH_MISMATCH;
      if (check && etok[v] != KVC_NO_EXPECTED_TOKEN && r.token != etok[v]) bits |= KVC_VERIFY_TOKEN_MISMATCH;
    }
    if (bits) {  // one call site: the row of an entry outside the buffer holds only its slot and position
      const bool loaded = own[v] && slot[v] != KVC_PADDING_SLOT;
      kvc_record_entry(p, first - 1 + v * 32 + (threadIdx.x & 31), slot[v], loaded ? r.position : epos[v],
                       loaded ? r.token : 0, loaded && check ? etok[v] : KVC_NO_EXPECTED_TOKEN,
                       loaded ? r.prev_hash : 0, loaded ? expected_chain : 0, bits);
    }
  }
}

// Warp tiles over the entries: a tile verifies 32 * VT - 1 consecutive entries and also holds the
// one before them, so every verified entry's predecessor entry is in the tile.
template <int VT>
struct KvcTiles {
  static constexpr int kVerified = 32 * VT - 1;
  long long first, step;
  __device__ __forceinline__ KvcTiles() {
    first = (((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * kVerified;
    step = ((long long)gridDim.x * blockDim.x >> 5) * kVerified;
  }
};

// Owners of entries e0 <= e1, searched by the whole warp: each round every lane tests one of 32
// evenly spaced request offsets, so a batch of up to 1024 requests takes two rounds. All lanes
// get the answers, in [0, batch_size) whatever the offsets hold.
template <class B>
__device__ __forceinline__ void kvc_owner2_warp(const B& b, long long e0, long long e1, int* r0, int* r1) {
  const int lane = threadIdx.x & 31;
  int lo0 = 0, hi0 = (int)b.batch_size, lo1 = 0, hi1 = (int)b.batch_size;  // answers in [lo, hi)
  while (hi0 - lo0 > 1 || hi1 - lo1 > 1) {
    const int w0 = (hi0 - lo0 + 31) >> 5, w1 = (hi1 - lo1 + 31) >> 5;
    const int i0 = lo0 + (lane + 1) * w0, i1 = lo1 + (lane + 1) * w1;
    const bool ok0 = i0 < hi0 && b.entry_offsets[i0] <= e0, ok1 = i1 < hi1 && b.entry_offsets[i1] <= e1;
    lo0 += __popc(__ballot_sync(KVC_FULL_MASK, ok0)) * w0;
    hi0 = min(hi0, lo0 + w0);
    lo1 += __popc(__ballot_sync(KVC_FULL_MASK, ok1)) * w1;
    hi1 = min(hi1, lo1 + w1);
  }
  *r0 = lo0;
  *r1 = lo1;
}

// What the fused verify needs of request r in this launch's batch: its req_to_token row, first
// verified position, verified count (0 for padding and rejected requests) and first entry.
struct KvcFusedReq {
  const int* rtt_row;
  long long row, lo, n, off;
};

template <class B>
__device__ __forceinline__ KvcFusedReq kvc_fused_req(const B& b, int r) {
  const KvcRequest q = kvc_request(b, r);
  return {q.ok ? b.req_to_token + q.row * b.rtt_row_stride : b.req_to_token, q.row, q.lo, q.n, b.entry_offsets[r]};
}

template <int VT, int FOLD>
__device__ __forceinline__ void kvc_verify_plan(const KvcVerifyParams& p, KvcWideStage* stage) {
  const long long active = kvc_verify_begin(p, p.plan_enable, p.plan_num_valid, p.plan_capacity);
  const bool check = p.check_expected_token != 0;
  const int lane = threadIdx.x & 31;
  const KvcTiles<VT> t;
  for (long long first = t.first; first < active; first += t.step) {
    long long slot[VT], prev[VT], etok[VT], epos[VT];
    bool held[VT], live[VT], nb_prev[VT], fp[VT];
#pragma unroll
    for (int v = 0; v < VT; ++v) {
      const int i = v * 32 + lane;
      const long long e = first - 1 + i;
      fp[v] = true;  // a materialised plan has no budget (ops.verify refuses one)
      held[v] = e >= 0 && e < active;
      live[v] = held[v] && i > 0;
      const long long at = held[v] ? e : first;
      slot[v] = p.plan_slot[at];
      prev[v] = p.plan_prev_slot[at];
      etok[v] = p.plan_expected_token[at];
      epos[v] = p.plan_expected_position[at];
    }
#pragma unroll
    for (int v = 0; v < VT; ++v) {
      const long long nb = kvc_from_prev_entry<VT>(slot, v);
      nb_prev[v] = live[v] && first - 2 + v * 32 + lane >= 0 && nb == prev[v];
    }
    kvc_verify_tile<VT, FOLD>(p, slot, prev, etok, epos, first, held, live, nb_prev, fp, check, stage);
  }
}

// Block 0 of a fused verify: one BATCH row per request whose entry count in the plan differs
// from what this launch's batch gives (e.g. the batch changed between HEAD and TAIL).
template <class B>
__device__ __forceinline__ void kvc_check_entry_counts(const B& p) {
  if (blockIdx.x != 0) return;
  for (long long r = threadIdx.x; r < p.batch_size; r += blockDim.x) {
    const KvcRequest q = kvc_request(p, r);
    const long long planned = p.entry_offsets[r + 1] - p.entry_offsets[r];
    if (planned != q.n) kvc_record_batch(p, KVC_NO_SLOT, r, KVC_BATCH_ENTRY_COUNT, planned, q.n);
  }
}

// The fingerprint budget (§6.1): with every = N > 1, an entry's real KV is checked when its
// position is the phase mod N (phase: the counter's value mod N, the same in every thread: the
// counter is advanced by an earlier launch) or one of its request's last N verified positions.
struct KvcBudget {
  unsigned every, phase;
};

// The entries of the warp tile starting at entry `first` (lane l holds first - 1 + v * 32 + l),
// derived from the batch (§8) as kvc_verify_tile takes them; entries that are not their request's
// in this batch are counted in `skipped`. Every lane of the warp must call it (shuffles, votes).
template <int VT>
__device__ __forceinline__ void kvc_fused_tile(const KvcFusedVerifyParams& p, long long first, long long active,
                                               KvcBudget budget, long long* slot, long long* prev, long long* etok,
                                               long long* epos, bool* held, bool* live, bool* inner, bool* fp,
                                               unsigned* skipped) {
  constexpr int kVerified = KvcTiles<VT>::kVerified;
  const int lane = threadIdx.x & 31;
  const long long last = (active - first > kVerified ? first + kVerified : active) - 1;
  int r_first, r_last;  // owners of the tile's first and last held entries
  kvc_owner2_warp(p, first > 0 ? first - 1 : 0, last, &r_first, &r_last);
  if (r_last < r_first) r_last = r_first;  // offsets that decrease (device garbage): search them all
  const KvcFusedReq q_first = kvc_fused_req(p, r_first);
#pragma unroll
  for (int v = 0; v < VT; ++v) {  // every index load of the tile first
    const int i = v * 32 + lane;
    const long long e = first - 1 + i;
    const long long at = e >= 0 && e < active ? e : last;
    int r = r_first;
    KvcFusedReq q = q_first;
    if (r_first != r_last) {
      r = (int)kvc_owner_in(p.entry_offsets, at, r_first, r_last + 1);
      if (r != r_first) q = kvc_fused_req(p, r);
    }
    const long long k = at - q.off;
    const bool ok = k >= 0 && k < q.n;  // an entry of request r in this batch: its row and position are valid
    held[v] = e >= 0 && e < active && ok;
    live[v] = held[v] && i > 0;
    *skipped += e >= 0 && e < active && i > 0 && !ok;
    const long long pos = q.lo + (ok ? k : 0);
    inner[v] = live[v] && k > 0;  // the entry held before is this request's pos - 1 (a required predecessor)
    const long long raw = ok ? (long long)q.rtt_row[pos] : 0;
    slot[v] = ok ? kvc_map_slot(p, raw) : 0;
    prev[v] = KVC_CHAIN_HEAD;
    if (live[v] && !inner[v] && pos > 0) prev[v] = kvc_map_slot(p, (long long)q.rtt_row[pos - 1]);
    etok[v] = live[v] ? kvc_expected_token(p, r, q.row, pos) : KVC_NO_EXPECTED_TOKEN;
    epos[v] = pos;
    // pos < rtt_max_len (an int) for a live entry: the 32-bit remainder is exact
    fp[v] = budget.every == 1 || (unsigned)pos % budget.every == budget.phase ||
            pos + (long long)budget.every >= q.lo + q.n;
  }
#pragma unroll
  for (int v = 0; v < VT; ++v) {
    const long long nb = kvc_from_prev_entry<VT>(slot, v);
    if (inner[v]) prev[v] = nb;
    if (prev[v] == KVC_PREV_ON_PADDING) prev[v] = KVC_SWA_UNMAPPED;  // a map value colliding with the marker
    if (inner[v] && prev[v] == KVC_PADDING_SLOT) prev[v] = KVC_PREV_ON_PADDING;
  }
}

// What a block of a *_many fused verify shares when it spreads a tile over several warps: the
// entry count (one value for the whole block, whatever device memory holds), the slots each
// tile fingerprints (KVC_NO_SLOT: none) and one fold per (tile, source) strip, h[tile * sources + s][entry].
template <int VT>
struct KvcManyStage {
  long long active;
  long long slot[KVC_MANY_SPREAD_TILES][32 * VT];
  uint64_t h[KVC_MANY_SPREAD_STRIPS][32 * VT];
};

// Warp tiles each on its own warp (§6 steps 2-3; FOLD: how each lane fingerprints its entries).
template <int VT, int FOLD>
__device__ __forceinline__ void kvc_fused_warp_tiles(const KvcFusedVerifyParams& p, long long active,
                                                     KvcBudget budget, bool check, KvcWideStage* stage) {
  const KvcTiles<VT> t;
  unsigned skipped = 0;
  for (long long first = t.first; first < active; first += t.step) {
    long long slot[VT], prev[VT], etok[VT], epos[VT];
    bool held[VT], live[VT], inner[VT], fp[VT];
    kvc_fused_tile<VT>(p, first, active, budget, slot, prev, etok, epos, held, live, inner, fp, &skipped);
    kvc_verify_tile<VT, FOLD>(p, slot, prev, etok, epos, first, held, live, inner, fp, check, stage);
  }
  kvc_warp_count(p.skip_counter, skipped);
}

// Warp tiles of many sources spread over the block, for a step with few tiles per block (small
// batches): `tiles` tiles at once, each on warps/tiles warps. The tile's first warp derives its
// entries; every warp of the tile folds the strips of its share of the sources (source s on warp
// s mod warps-per-tile), one fold per lane and entry in shared memory; the first warp folds the
// per-source values in source order (§3) and verifies. Every thread of the block must call it,
// with the same `active` and `tiles` (it synchronises the block).
template <int VT>
__device__ __forceinline__ void kvc_fused_spread_tiles(const KvcFusedVerifyParams& p, long long active, int tiles,
                                                       KvcBudget budget, bool check, KvcManyStage<VT>& st) {
  constexpr int kVerified = KvcTiles<VT>::kVerified;
  const int lane = threadIdx.x & 31, per_tile = (int)(blockDim.x >> 5) / tiles;
  const int tile = (int)(threadIdx.x >> 5) / per_tile, rank = (int)(threadIdx.x >> 5) % per_tile;
  const int sources = p.num_sources;
  unsigned skipped = 0;
  for (long long base = (long long)blockIdx.x * tiles; base * kVerified < active; base += (long long)gridDim.x * tiles) {
    const long long first = (base + tile) * kVerified;
    const bool mine = first < active, lead = mine && rank == 0;
    long long slot[VT], prev[VT], etok[VT], epos[VT];
    bool held[VT], live[VT], inner[VT], fp[VT];
    if (lead) {
      kvc_fused_tile<VT>(p, first, active, budget, slot, prev, etok, epos, held, live, inner, fp, &skipped);
#pragma unroll
      for (int v = 0; v < VT; ++v)
        st.slot[tile][v * 32 + lane] = kvc_tile_owns(p, held[v], slot[v]) && live[v] && fp[v] ? slot[v] : KVC_NO_SLOT;
    }
    __syncthreads();  // the tile's slots are published
    if (mine) {
      for (int s = rank; s < sources; s += per_tile) {
#pragma unroll
        for (int v = 0; v < VT; ++v) {
          const long long at = st.slot[tile][v * 32 + lane];
          st.h[tile * sources + s][v * 32 + lane] = at >= 0 ? kvc_fold_strip(p.sources[s], at) : 0;
        }
      }
    }
    __syncthreads();  // every strip of the tile is folded (and the slots are read before the next round)
    if (lead) {
      uint64_t rkv[VT];
#pragma unroll
      for (int v = 0; v < VT; ++v) {
        uint64_t total = 0;
        for (int s = 0; s < sources; ++s) total = kvc_sm(total ^ st.h[tile * sources + s][v * 32 + lane]);
        rkv[v] = total;
      }
      kvc_verify_tile<VT, KVC_FOLD_GIVEN>(p, slot, prev, etok, epos, first, held, live, inner, fp, check,
                                            nullptr, rkv);
    }
  }
  kvc_warp_count(p.skip_counter, skipped);
}

// Tiles a *_many block spreads its warps over: the fewest (a power of two) that cover every tile
// of the step in one round of the grid, with their strip folds fitting the stage; 0 when none
// does (each warp verifies its own tiles). The same in every thread of the block.
__device__ __forceinline__ int kvc_spread_tiles(long long active, long long verified_per_tile, int sources) {
  const long long tiles = (active + verified_per_tile - 1) / verified_per_tile;
  for (int t = 1; t <= KVC_MANY_SPREAD_TILES; t *= 2)
    if ((long long)t * sources <= KVC_MANY_SPREAD_STRIPS && tiles <= (long long)t * gridDim.x) return t;
  return 0;
}

template <int VT, int FOLD>
__device__ __forceinline__ void kvc_verify_fused(const KvcFusedVerifyParams& p, KvcWideStage* stage,
                                                 KvcManyStage<VT>* many = nullptr) {
  long long active = kvc_verify_begin(p, p.verify_enable, p.verify_num_valid, p.verify_capacity);
  if (FOLD == KVC_FOLD_MANY) {  // one entry count for the whole block: its barriers depend on it
    if (threadIdx.x == 0) many->active = active;
    __syncthreads();
    active = many->active;
  }
  if (active < 0) return;  // disabled: the same in every thread
  if (p.batch_size <= 0) {  // no request owns any entry: all skipped
    if (blockIdx.x == 0 && threadIdx.x == 0 && active > 0 && p.skip_counter != 0)
      atomicAdd(p.skip_counter, (unsigned long long)active);
    return;
  }
  kvc_check_entry_counts(p);
  const bool check = p.check_expected_token != 0;
  const unsigned every = p.fingerprint_every > 1 ? (unsigned)p.fingerprint_every : 1u;
  const KvcBudget budget{every, every > 1 && p.fingerprint_phase != 0 ? (unsigned)(*p.fingerprint_phase % every) : 0u};
  if (FOLD == KVC_FOLD_MANY) {
    const int tiles = kvc_spread_tiles(active, KvcTiles<VT>::kVerified, p.num_sources);
    if (tiles > 0) {
      kvc_fused_spread_tiles<VT>(p, active, tiles, budget, check, *many);
      return;
    }
  }
  kvc_fused_warp_tiles<VT, FOLD>(p, active, budget, check, stage);
}

// The narrow fused verify at the tile depth of what its lanes load (the launch's choice, above).
__device__ __forceinline__ void kvc_verify_fused_narrow(const KvcFusedVerifyParams& p) {
  if (p.num_sources > 0) kvc_verify_fused<KVC_HASHED_VT, KVC_FOLD_NARROW>(p, nullptr);
  else kvc_verify_fused<KVC_VT, KVC_FOLD_NARROW>(p, nullptr);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS, KVC_VERIFY_BLOCKS_PER_SM)
kvc_verify(const __grid_constant__ KvcVerifyParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  if (p.num_sources > 0) kvc_verify_plan<KVC_HASHED_VT, KVC_FOLD_NARROW>(p, nullptr);
  else kvc_verify_plan<KVC_VT, KVC_FOLD_NARROW>(p, nullptr);
  kvc_step_end(p.snap[0]);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS, KVC_MANY_VERIFY_MIN_BLOCKS)
kvc_verify_many(const __grid_constant__ KvcVerifyParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  kvc_verify_plan<KVC_VT, KVC_FOLD_MANY>(p, nullptr);
  kvc_step_end(p.snap[0]);
}

extern "C" __global__ void __launch_bounds__(KVC_WIDE_VERIFY_THREADS)
kvc_verify_wide(const __grid_constant__ KvcVerifyParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  __shared__ KvcWideStage stage[KVC_WIDE_VERIFY_THREADS / 32];
  kvc_verify_plan<1, KVC_FOLD_WIDE>(p, stage);
  kvc_step_end(p.snap[0]);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS, KVC_VERIFY_BLOCKS_PER_SM)
kvc_fused_verify(const __grid_constant__ KvcFusedVerifyParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  kvc_verify_fused_narrow(p);
  kvc_step_end(p.snap[0]);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS, KVC_MANY_VERIFY_MIN_BLOCKS)
kvc_fused_verify_many(const __grid_constant__ KvcFusedVerifyParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  __shared__ KvcManyStage<KVC_MANY_VT> many;
  kvc_verify_fused<KVC_MANY_VT, KVC_FOLD_MANY>(p, nullptr, &many);
  kvc_step_end(p.snap[0]);
}

extern "C" __global__ void __launch_bounds__(KVC_WIDE_VERIFY_THREADS)
kvc_fused_verify_wide(const __grid_constant__ KvcFusedVerifyParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  __shared__ KvcWideStage stage[KVC_WIDE_VERIFY_THREADS / 32];
  kvc_verify_fused<1, KVC_FOLD_WIDE>(p, stage);
  kvc_step_end(p.snap[0]);
}

// The K and V halves of a group in one launch: blockIdx.y is the half, each verified as its own
// launch would verify it. The step's snapshot, when this launch takes it, is half 0's.
extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS, KVC_VERIFY_BLOCKS_PER_SM)
kvc_fused_verify_pair(const __grid_constant__ KvcFusedVerifyPair p) {
  KVC_AFTER_PREVIOUS_GRID();
  if (blockIdx.y < KVC_HALVES) kvc_verify_fused_narrow(p.half[blockIdx.y]);
  kvc_step_end(p.half[0].snap[0]);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS, KVC_MANY_VERIFY_MIN_BLOCKS)
kvc_fused_verify_many_pair(const __grid_constant__ KvcFusedVerifyPair p) {
  KVC_AFTER_PREVIOUS_GRID();
  __shared__ KvcManyStage<KVC_MANY_VT> many;
  if (blockIdx.y < KVC_HALVES) kvc_verify_fused<KVC_MANY_VT, KVC_FOLD_MANY>(p.half[blockIdx.y], nullptr, &many);
  kvc_step_end(p.half[0].snap[0]);
}

extern "C" __global__ void __launch_bounds__(KVC_WIDE_VERIFY_THREADS)
kvc_fused_verify_wide_pair(const __grid_constant__ KvcFusedVerifyPair p) {
  KVC_AFTER_PREVIOUS_GRID();
  __shared__ KvcWideStage stage[KVC_WIDE_VERIFY_THREADS / 32];
  if (blockIdx.y < KVC_HALVES) kvc_verify_fused<1, KVC_FOLD_WIDE>(p.half[blockIdx.y], stage);
  kvc_step_end(p.half[0].snap[0]);
}
