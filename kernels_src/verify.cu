// Verify kernels (SPEC §6). kvc_verify reads a materialised VerifyPlan; kvc_fused_verify derives
// every entry from the engine's req_to_token and the per-request entry offsets of kvc_prepare, so
// the per-entry plan never touches memory. Both are graph-safe: every per-step value is read from
// device memory. Any grid size is correct (grid-stride over warp tiles).
//
// Work is cut into warp tiles of consecutive entries: lane l holds entries v * 32 + l, v < VT, so
// every load of a tile is issued before the first result is needed, and entry e's predecessor
// entry e - 1 sits in the neighbouring lane. In a request's run of entries that predecessor entry
// is e's predecessor slot, so its chain value is shuffled across instead of loaded again: a tile
// reads each record once. The *_wide variants (fingerprints of 64 bytes or more per source) fetch
// the real-KV strips of a warp cooperatively, coalesced and staged through shared memory, and fold
// each strip in its own lane.
#include "fingerprint.cuh"

#ifndef KVC_VERIFY_MIN_BLOCKS
#define KVC_VERIFY_MIN_BLOCKS 4  // per SM: caps the narrow kernels at 64 registers (measured best on H200)
#endif

struct KvcRecord {
  long long token, position;
  uint64_t prev_hash, real_kv_hash;
};

template <class P>
__device__ __forceinline__ KvcRecord kvc_load_record(const P& p, long long slot, bool vec) {
  const long long* f = kvc_slot(p, slot);
  long long w[4];
  if (vec) {
    const longlong2 a = __ldg(reinterpret_cast<const longlong2*>(f)), b = __ldg(reinterpret_cast<const longlong2*>(f) + 1);
    w[0] = a.x; w[1] = a.y; w[2] = b.x; w[3] = b.y;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = __ldg(f + k);
  }
  return {w[KVC_FIELD_TOKEN], w[KVC_FIELD_POSITION], (uint64_t)w[KVC_FIELD_PREV_HASH], (uint64_t)w[KVC_FIELD_REAL_KV_HASH]};
}

// Launch prologue (SPEC §6 step 1): count the launch; the number of active entries, or -1 when
// the plan is disabled.
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

// One warp tile, SPEC §6 steps 2-3 for every live entry. LANES: lane l holds tile entry
// i = v * 32 + l (v < VT), and the entry held before entry i is i - 1, in the neighbouring lane
// (i = 0 holds the entry before the tile's first, for its chain value only). Otherwise
// (request-major tiles) a lane's entries v are consecutive positions of one request, the entry
// held before v is v - 1 in the same lane, and before v = 0 the one whose chain value is `carry`.
// `held` entries are loaded, `live` ones verified; `nb_prev[v]`: the entry held before v is its
// predecessor slot, so that entry's chain value is used instead of loading the record again.
// Returns the chain value a successor of entry VT - 1 expects (the next request-major carry).
// Every lane of the warp must call it (shuffles).
template <int VT, bool WIDE, bool LANES, class P>
__device__ __forceinline__ uint64_t kvc_verify_tile(const P& p, const long long* slot, const long long* prev,
                                                    const long long* etok, const long long* epos, const bool* held,
                                                    const bool* live, const bool* nb_prev, bool check,
                                                    KvcWideStage* stage, uint64_t carry = 0) {
  const bool vec = (p.slot_stride_words & 1) == 0 && ((unsigned long long)p.canary & 15) == 0;
  bool own[VT], direct[VT];  // loads this entry's record; loads the predecessor's record itself
#pragma unroll
  for (int v = 0; v < VT; ++v) {
    own[v] = held[v] && slot[v] > 0 && slot[v] < p.num_slots;
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
    if (WIDE) rkv[v] = kvc_fingerprint_warp(p, slot[v], own[v] && live[v], stage[threadIdx.x >> 5]);
    else rkv[v] = own[v] && live[v] ? kvc_fingerprint_narrow(p, slot[v]) : 0;
  }
  uint64_t succ[VT], nb_hash[VT];  // the chain value a successor of this lane's slot expects
#pragma unroll
  for (int v = 0; v < VT; ++v) succ[v] = kvc_mix3(rec[v].prev_hash, (uint64_t)rec[v].token, (uint64_t)rec[v].position);
#pragma unroll
  for (int v = 0; v < VT; ++v) nb_hash[v] = LANES ? kvc_from_prev_entry<VT>(succ, v) : (v > 0 ? succ[v > 0 ? v - 1 : 0] : carry);
#pragma unroll
  for (int v = 0; v < VT; ++v) {
    if (!live[v] || slot[v] == KVC_PADDING_SLOT) continue;
    if (!own[v]) {
      kvc_record(p, slot[v], epos[v], 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_SLOT_OUT_OF_RANGE);
      continue;
    }
    const KvcRecord& r = rec[v];
    long long bits = 0;
    uint64_t expected_chain = r.prev_hash;
    if (prev[v] < 0) {
      expected_chain = kvc_sm(KVC_ANCHOR);
    } else if (prev[v] >= p.num_slots) {
      expected_chain = 0;
      bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH | KVC_SLOT_OUT_OF_RANGE;
    } else if (prev[v] != KVC_PADDING_SLOT) {
      expected_chain = direct[v] ? prev_hash[v] : nb_hash[v];
    }
    if (r.prev_hash != expected_chain) bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH;
    if (r.position != epos[v]) bits |= KVC_VERIFY_POSITION_MISMATCH;
    if (r.real_kv_hash != rkv[v]) bits |= KVC_VERIFY_REAL_KV_HASH_MISMATCH;
    if (check && etok[v] != KVC_NO_EXPECTED_TOKEN && r.token != etok[v]) bits |= KVC_VERIFY_TOKEN_MISMATCH;
    if (bits)
      kvc_record(p, slot[v], r.position, r.token, check ? etok[v] : KVC_NO_EXPECTED_TOKEN, r.prev_hash,
                 expected_chain, bits);
  }
  return succ[VT - 1];
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
// get the answers. Entry indices fit in 32 bits (plan capacities are at most INT32_MAX).
template <class B>
__device__ __forceinline__ void kvc_owner2_warp(const B& b, int e0, int e1, int* r0, int* r1) {
  const int lane = threadIdx.x & 31;
  int lo0 = 0, hi0 = (int)b.batch_size, lo1 = 0, hi1 = (int)b.batch_size;  // answers in [lo, hi)
  while (hi0 - lo0 > 1 || hi1 - lo1 > 1) {
    const int w0 = (hi0 - lo0 + 31) >> 5, w1 = (hi1 - lo1 + 31) >> 5;
    const int i0 = lo0 + (lane + 1) * w0, i1 = lo1 + (lane + 1) * w1;
    const bool ok0 = i0 < hi0 && (int)b.entry_offsets[i0] <= e0, ok1 = i1 < hi1 && (int)b.entry_offsets[i1] <= e1;
    lo0 += __popc(__ballot_sync(KVC_FULL_MASK, ok0)) * w0;
    hi0 = min(hi0, lo0 + w0);
    lo1 += __popc(__ballot_sync(KVC_FULL_MASK, ok1)) * w1;
    hi1 = min(hi1, lo1 + w1);
  }
  *r0 = lo0;
  *r1 = lo1;
}

// What the fused verify needs of request r: its req_to_token row, first verified position and
// first entry.
struct KvcFusedReq {
  const int* rtt_row;
  int lo, off;
};

template <class B>
__device__ __forceinline__ KvcFusedReq kvc_fused_req(const B& b, int r) {
  const KvcRequest q = kvc_request(b, r);
  return {b.req_to_token + q.row * b.rtt_row_stride, (int)q.lo, (int)b.entry_offsets[r]};
}

template <int VT, bool WIDE>
__device__ __forceinline__ void kvc_verify_plan(const KvcVerifyParams& p, KvcWideStage* stage) {
  const long long active = kvc_verify_begin(p, p.plan_enable, p.plan_num_valid, p.plan_capacity);
  const bool check = p.check_expected_token != 0;
  const int lane = threadIdx.x & 31;
  const KvcTiles<VT> t;
  for (long long first = t.first; first < active; first += t.step) {
    long long slot[VT], prev[VT], etok[VT], epos[VT];
    bool held[VT], live[VT], nb_prev[VT];
#pragma unroll
    for (int v = 0; v < VT; ++v) {
      const int i = v * 32 + lane;
      const long long e = first - 1 + i;
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
    kvc_verify_tile<VT, WIDE, true>(p, slot, prev, etok, epos, held, live, nb_prev, check, stage);
  }
}

template <int VT, bool WIDE>
__device__ __forceinline__ void kvc_verify_fused(const KvcFusedVerifyParams& p, KvcWideStage* stage) {
  const int active = (int)kvc_verify_begin(p, p.verify_enable, p.verify_num_valid, p.verify_capacity);
  const bool check = p.check_expected_token != 0;
  const int lane = threadIdx.x & 31;
  constexpr int kVerified = KvcTiles<VT>::kVerified;
  const KvcTiles<VT> t;
  for (long long first64 = t.first; first64 < active; first64 += t.step) {
    const int first = (int)first64;
    const int last = (active - first > kVerified ? first + kVerified : active) - 1;
    int r_first, r_last;  // owners of the tile's first and last held entries
    kvc_owner2_warp(p, first > 0 ? first - 1 : 0, last, &r_first, &r_last);
    const KvcFusedReq q_first = kvc_fused_req(p, r_first);
    long long slot[VT], prev[VT], etok[VT], epos[VT];
    int raw[VT], raw_prev[VT];
    bool held[VT], live[VT], inner[VT];
#pragma unroll
    for (int v = 0; v < VT; ++v) {  // every index load of the tile first
      const int i = v * 32 + lane, e = first - 1 + i;
      held[v] = e >= 0 && e < active;
      live[v] = held[v] && i > 0;
      const int at = held[v] ? e : last;
      int r = r_first;
      KvcFusedReq q = q_first;
      if (r_first != r_last) {
        r = (int)kvc_owner_in(p, at, r_first, r_last + 1);
        if (r != r_first) q = kvc_fused_req(p, r);
      }
      const int pos = q.lo + (at - q.off);
      inner[v] = live[v] && pos > q.lo;  // the entry held before this one is this request's pos - 1
      raw[v] = q.rtt_row[pos];
      raw_prev[v] = (live[v] && !inner[v] && pos > 0) ? q.rtt_row[pos - 1] : 0;
      etok[v] = KVC_NO_EXPECTED_TOKEN;
      if (p.expected_pool != 0 && live[v]) etok[v] = kvc_expected_token(p, r, kvc_request(p, r), pos);
      epos[v] = pos;
    }
#pragma unroll
    for (int v = 0; v < VT; ++v) {
      slot[v] = kvc_map_slot(p, raw[v]);
      const long long nb = kvc_from_prev_entry<VT>(slot, v);
      prev[v] = inner[v] ? nb : (epos[v] > 0 ? kvc_map_slot(p, raw_prev[v]) : KVC_CHAIN_HEAD);
    }
    kvc_verify_tile<VT, WIDE, true>(p, slot, prev, etok, epos, held, live, inner, check, stage);
  }
}

// Request-major fused verify (narrow fingerprints, batches of at most KVC_RM_MAX_BATCH requests):
// a warp task is 32 consecutive requests x KVC_RM_CHUNKS * VT consecutive verified positions of
// each, lane l holding request 32 g + l. Where requests took their slots step by step side by
// side (decode), one position's slots across the requests are adjacent, so a task's record
// loads are coalesced; a lane's chain values pass from chunk to chunk in registers, and only the
// task's first entry loads its predecessor's record. The task's req_to_token entries come in one
// load round, then the later chunks' records are prefetched to L2, so their loads (which wait for
// the previous chunk's checks) hit L2. (Prefetching the strips too would spill at 80 registers.)
// The requests' fields and each group's task count are staged in shared memory once per block.
struct KvcRmReq {
  int row, lo, off, n;  // request-pool row, first verified position, first entry, verified entries
};

template <int VT>
__device__ __forceinline__ void kvc_verify_fused_rm(const KvcFusedVerifyParams& p) {
  constexpr int kSpan = KVC_RM_CHUNKS * VT;  // positions of a request per task
  __shared__ KvcRmReq req[KVC_RM_MAX_BATCH];
  __shared__ int first_task[KVC_RM_MAX_BATCH / 32 + 1];  // of each 32-request group, then the total
  const int active = (int)kvc_verify_begin(p, p.verify_enable, p.verify_num_valid, p.verify_capacity);
  if (active <= 0) return;  // the same in every thread
  const bool check = p.check_expected_token != 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int bs = (int)min(p.batch_size, (long long)KVC_RM_MAX_BATCH), groups = (bs + 31) >> 5;
  for (int r = threadIdx.x; r < bs; r += blockDim.x) {
    const KvcRequest q = kvc_request(p, r);
    const long long o0 = p.entry_offsets[r], o1 = min(p.entry_offsets[r + 1], (long long)active);
    req[r] = {(int)q.row, (int)q.lo, (int)o0, (int)kvc_clamp(o1 - o0, 0, active)};
  }
  __syncthreads();
  for (int g = warp; g < groups; g += nwarps) {
    const int r = g * 32 + lane;
    const unsigned longest = __reduce_max_sync(KVC_FULL_MASK, r < bs ? (unsigned)req[r].n : 0u);
    if (lane == 0) first_task[g + 1] = (int)((longest + kSpan - 1) / kSpan);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    first_task[0] = 0;
    for (int g = 0; g < groups; ++g) first_task[g + 1] += first_task[g];
  }
  __syncthreads();
  const int tasks = first_task[groups];
  for (int t = (int)(((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5); t < tasks;
       t += (int)(((long long)gridDim.x * blockDim.x) >> 5)) {
    const int g = __popc(__ballot_sync(KVC_FULL_MASK, lane < groups && first_task[lane + 1] <= t));
    const int r = g * 32 + lane, q0 = (t - first_task[g]) * kSpan;
    const KvcRmReq rq = r < bs ? req[r] : KvcRmReq{0, 0, 0, 0};
    const int* rtt_row = p.req_to_token + (long long)rq.row * p.rtt_row_stride;
    KvcRequest kq;  // what kvc_expected_token reads of the request
    kq.row = rq.row;
    long long carry_slot = KVC_CHAIN_HEAD;  // the predecessor slot of the task's first entry
    if (q0 < rq.n && rq.lo + q0 > 0) carry_slot = kvc_map_slot(p, rtt_row[rq.lo + q0 - 1]);
    int raw[kSpan];  // the task's req_to_token entries: one load round for all its chunks
#pragma unroll
    for (int i = 0; i < kSpan; ++i) raw[i] = q0 + i < rq.n ? rtt_row[rq.lo + q0 + i] : 0;
#pragma unroll
    for (int i = VT; i < kSpan; ++i)  // the later chunks' records on their way to L2 now
      if (q0 + i < rq.n) kvc_prefetch_l2(kvc_slot(p, kvc_clamp(kvc_map_slot(p, raw[i]), 0, p.num_slots - 1)));
    uint64_t carry = 0;
#pragma unroll
    for (int c = 0; c < KVC_RM_CHUNKS; ++c) {
      long long slot[VT], prev[VT], etok[VT], epos[VT];
      bool live[VT], inner[VT];
#pragma unroll
      for (int v = 0; v < VT; ++v) {
        const int q = q0 + c * VT + v, pos = rq.lo + q;
        live[v] = q < rq.n;
        inner[v] = live[v] && (c > 0 || v > 0);  // the entry held before is this request's pos - 1
        slot[v] = kvc_map_slot(p, raw[c * VT + v]);
        prev[v] = v > 0 ? slot[v > 0 ? v - 1 : 0] : carry_slot;
        epos[v] = pos;
        etok[v] = KVC_NO_EXPECTED_TOKEN;
        if (p.expected_pool != 0 && live[v]) etok[v] = kvc_expected_token(p, r, kq, pos);
      }
      carry = kvc_verify_tile<VT, false, false>(p, slot, prev, etok, epos, live, live, inner, check, nullptr, carry);
      carry_slot = slot[VT - 1];
    }
  }
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS, KVC_VERIFY_MIN_BLOCKS) kvc_verify(const __grid_constant__ KvcVerifyParams p) {
  kvc_verify_plan<KVC_VERIFY_LANE_ENTRIES, false>(p, nullptr);
}

extern "C" __global__ void __launch_bounds__(KVC_WIDE_VERIFY_THREADS) kvc_verify_wide(const __grid_constant__ KvcVerifyParams p) {
  __shared__ KvcWideStage stage[KVC_WIDE_VERIFY_THREADS / 32];
  kvc_verify_plan<1, true>(p, stage);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS, KVC_VERIFY_MIN_BLOCKS)
kvc_fused_verify(const __grid_constant__ KvcFusedVerifyParams p) {
  kvc_verify_fused<KVC_VERIFY_LANE_ENTRIES, false>(p, nullptr);
}

extern "C" __global__ void __launch_bounds__(KVC_WIDE_VERIFY_THREADS)
kvc_fused_verify_wide(const __grid_constant__ KvcFusedVerifyParams p) {
  __shared__ KvcWideStage stage[KVC_WIDE_VERIFY_THREADS / 32];
  kvc_verify_fused<1, true>(p, stage);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS, KVC_RM_MIN_BLOCKS)
kvc_fused_verify_rm(const __grid_constant__ KvcFusedVerifyParams p) {
  kvc_verify_fused_rm<KVC_VERIFY_LANE_ENTRIES>(p);
}
