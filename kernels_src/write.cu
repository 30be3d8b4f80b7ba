// Write kernel (docs/format.md §7). One block per request (grid-stride over requests), entries in chunks of
// 192, three chunks in flight: while thread 0 advances the serial chain over chunk k (reading
// tokens and positions from shared memory), six worker warps check and store chunk k - 1 with the
// chain values thread 0 produced for it, then load chunk k + 1 and fingerprint its slots' real KV.
// One barrier per chunk; the chain thread never waits for memory, so a long prefill is bound by
// the chain's arithmetic, not by memory latency, the real-KV folds or the stores. Warp 4 stays
// idle: an SM spreads a block's warps over its four schedulers by warp index mod 4, so warp 4
// would compete with the chain for warp 0's issue slots. Graph-safe: per-step values live on the
// device. A request the plan builder rejected (seed KVC_SEED_INVALID + field, reported there)
// stamps nothing; every slot read from device memory is checked against the buffer.
//
// The chain once per step: a launch given a chain source (another buffer of the group that this
// step already stamped with the same tokens, e.g. HEAD K for HEAD V, TAIL K and TAIL V) first
// checks every link of a request in parallel (kvc_chain_links) and, when all hold, takes each
// entry's PREV_HASH from the source instead of running the serial chain. The stores are the ones
// the serial chain would make, byte for byte; any request whose links do not all hold (a record
// changed, a slot skipped) runs the serial chain.
#include "fingerprint.cuh"
#include "plan.cuh"

static_assert(KVC_BLOCK_THREADS == 256, "the write kernel's warp roles assume 8 warps");
#define KVC_WRITE_WORKERS 192                // warps 1-3 and 5-7: loads, folds and stores
#define KVC_WRITE_CHUNK KVC_WRITE_WORKERS    // one entry per worker thread per chunk

// Worker index of thread `tid` (0..191), or -1: warp 0 runs the chain, warp 4 idles (see above).
__device__ __forceinline__ int kvc_write_worker(int tid) {
  const int warp = tid >> 5;
  return (warp == 0 || warp == 4) ? -1 : tid - (warp < 4 ? 32 : 64);
}

struct KvcWriteStage {
  long long slot[KVC_WRITE_CHUNK];
  long long token[KVC_WRITE_CHUNK];
  long long position[KVC_WRITE_CHUNK];
  uint64_t rkv[KVC_WRITE_CHUNK];
};

// What the chain thread leaves for the stores of a chunk.
struct KvcWriteChain {
  uint64_t prev_hash[KVC_WRITE_CHUNK];  // PREV_HASH stored by each entry
  long long position[KVC_WRITE_CHUNK];  // the position asserted against (+1) per entry
};

// Entries [base, min(base + CHUNK, end)) into `st`; KVC_SKIP_SLOT pads the tail of the chunk. Every
// worker loads one entry (CHUNK == WORKERS), so whole warps fingerprint together.
__device__ __forceinline__ void kvc_write_load(const KvcWriteParams& p, KvcWriteStage& st, long long base,
                                               long long end, int t) {
  for (int j = t; j < KVC_WRITE_CHUNK; j += KVC_WRITE_WORKERS) {
    const long long i = base + j;
    long long slot = KVC_SKIP_SLOT, token = 0, position = 0;
    if (i < end) {
      slot = p.out_cache_loc[i];
      token = p.input_ids[i];
      position = p.positions[i];
    }
    st.slot[j] = slot;
    st.token[j] = token;
    st.position[j] = position;
    st.rkv[j] = kvc_fingerprint_lanes(p, slot, slot >= 0 && slot < p.num_slots);
  }
}

// One chain step: record the values entry j stores, then advance on its actual token and position.
__device__ __forceinline__ void kvc_chain_step(const KvcWriteParams& p, KvcWriteChain& out, int j, long long slot,
                                               long long token, long long position, uint64_t& running,
                                               long long& running_pos) {
  out.prev_hash[j] = running;
  out.position[j] = running_pos;
  const bool stamp = slot >= 0 && slot < p.num_slots;
  const uint64_t next = kvc_mix3(running, (uint64_t)token, (uint64_t)position);
  running = stamp ? next : running;
  running_pos = stamp ? position : running_pos;
}

// The chain over the n entries of a staged chunk (thread 0). Entry by entry: each step's shared
// loads do not depend on the chain, so the compiler issues them a step ahead; skipped entries
// select instead of branching, so only the mix3 arithmetic is serial. (Register groups of 8
// read ahead cost more in moves than they hid: 197 vs 172 scheduled cycles per step on sm_90.)
__device__ __forceinline__ void kvc_write_chain(const KvcWriteParams& p, const KvcWriteStage& st, int n,
                                                KvcWriteChain& out, uint64_t& running, long long& running_pos) {
#pragma unroll 4
  for (int j = 0; j < n; ++j) kvc_chain_step(p, out, j, st.slot[j], st.token[j], st.position[j], running, running_pos);
}

// Check and store entry i of request r (slot, token, position) with the chain value it stores and the
// position it asserts against (+1); `store` false for an earlier occurrence of a slot repeated in its
// chunk. Returns whether the entry was stamped.
__device__ __forceinline__ bool kvc_write_entry(const KvcWriteParams& p, long long r, long long i, long long slot,
                                                long long token, long long position, uint64_t chain,
                                                long long prev_position, uint64_t rkv, bool has_expected,
                                                bool pos_assert, bool store) {
  if (slot >= p.num_slots) {
    kvc_record(p, r, slot, position, token, KVC_NO_EXPECTED_TOKEN, chain, 0, KVC_SLOT_OUT_OF_RANGE);
    return false;
  }
  if (slot < 0) return false;
  if (has_expected) {
    const long long et = p.expected_input_ids[i], ep = p.expected_positions[i];
    const long long bits = (token != et ? KVC_WRITE_TOKEN_MISMATCH : 0) |
                           (position != ep ? KVC_WRITE_POSITION_MISMATCH : 0);
    if (bits) kvc_record(p, r, slot, position, token, et, chain, (uint64_t)ep, bits);
  }
  if (pos_assert && position != prev_position + 1)
    kvc_record(p, r, slot, position, token, token, chain, (uint64_t)(prev_position + 1),  // SGLang's column 4
               KVC_WRITE_POSITION_MISMATCH);
  if (store) {
    long long* f = p.canary + slot * p.slot_stride_words;
    f[KVC_FIELD_TOKEN] = token;
    f[KVC_FIELD_POSITION] = position;
    f[KVC_FIELD_PREV_HASH] = (long long)chain;
    f[KVC_FIELD_REAL_KV_HASH] = (long long)rkv;
  }
  return true;
}

// The lost-write check (docs/format.md §7.1): in a write that fingerprints, an entry on a real slot
// is compared with the record the slot holds just before the entry is stamped. Unchanged bytes
// (the record's REAL_KV_HASH is the entry's fingerprint) under another token mean that the store
// of this token's KV never reached the slot. Only the thread that stores a slot reads its record
// (before its store), so within a request nothing reads a record another thread writes. A negative
// token is one the engine did not know (the vLLM connector's async decode token, -1): it matches any.
struct KvcPrevRecord {
  long long token, position;
  uint64_t rkv;
};

__device__ __forceinline__ bool kvc_checks_lost_write(const KvcWriteParams& p, long long slot) {
  return p.num_sources > 0 && slot > KVC_PADDING_SLOT && slot < p.num_slots;
}

__device__ __forceinline__ KvcPrevRecord kvc_prev_record(const KvcWriteParams& p, long long slot) {
  const long long* f = kvc_slot(p, slot);
  return KvcPrevRecord{f[KVC_FIELD_TOKEN], f[KVC_FIELD_POSITION], (uint64_t)f[KVC_FIELD_REAL_KV_HASH]};
}

// Entry (slot, token, position, chain, rkv) of request r against `prev`; returns the entry's own
// record, the previous one of the slot's next stamp.
__device__ __forceinline__ KvcPrevRecord kvc_lost_write(const KvcWriteParams& p, long long r, long long slot,
                                                        const KvcPrevRecord& prev, long long token,
                                                        long long position, uint64_t chain, uint64_t rkv) {
  if (prev.rkv == rkv && prev.token != token && prev.token >= 0 && token >= 0)  // negative: token unknown
    kvc_record(p, r, slot, position, token, prev.token, chain, (uint64_t)prev.position, KVC_LOST_WRITE);
  return KvcPrevRecord{token, position, rkv};
}

// Check and store the n entries of a chunk whose chain values are in `ch` (worker threads).
// Returns the entries this thread stamped.
__device__ __forceinline__ unsigned kvc_write_store(const KvcWriteParams& p, long long r, const KvcWriteStage& st,
                                                    const KvcWriteChain& ch, long long base, int n, int t,
                                                    bool has_expected, bool pos_assert) {
  unsigned stamped = 0;
  for (int j = t; j < n; j += KVC_WRITE_WORKERS) {
    const long long slot = st.slot[j];
    bool repeated = false;  // a slot repeated in one chunk: only its last occurrence stores
#pragma unroll 8
    for (int k = j + 1; k < n; ++k) repeated |= st.slot[k] == slot;
    if (!repeated && kvc_checks_lost_write(p, slot)) {
      // The stores of earlier chunks have landed (a barrier per chunk); this chunk's earlier
      // occurrences of the slot store nothing, so they are checked here, in order.
      KvcPrevRecord prev = kvc_prev_record(p, slot);
      for (int k = 0; k < j; ++k)
        if (st.slot[k] == slot)
          prev = kvc_lost_write(p, r, slot, prev, st.token[k], st.position[k], ch.prev_hash[k], st.rkv[k]);
      kvc_lost_write(p, r, slot, prev, st.token[j], st.position[j], ch.prev_hash[j], st.rkv[j]);
    }
    stamped += kvc_write_entry(p, r, base + j, slot, st.token[j], st.position[j], ch.prev_hash[j], ch.position[j],
                               st.rkv[j], has_expected, pos_assert, !repeated);
  }
  return stamped;
}

// PREV_HASH of `slot` in the chain source (0 <= slot < num_slots; the source has as many slots).
__device__ __forceinline__ uint64_t kvc_source_chain(const KvcWriteParams& p, long long slot) {
  return (uint64_t)p.chain_source[slot * p.slot_stride_words + KVC_FIELD_PREV_HASH];
}

// Whether the chain source holds request [start, end)'s chain (every thread of the block calls it):
// each entry's slot is in the buffer and its source record holds the entry's token and position and,
// as PREV_HASH, the seed's hash (first entry) or mix3 of the previous entry's source PREV_HASH, token
// and position. By induction over the entries those PREV_HASH values are the serial chain's.
__device__ __forceinline__ bool kvc_chain_links(const KvcWriteParams& p, long long start, long long end,
                                                uint64_t seed_hash) {
  bool ok = true;
  for (long long i = start + threadIdx.x; ok && i < end; i += blockDim.x) {
    const long long slot = p.out_cache_loc[i], prev = i > start ? p.out_cache_loc[i - 1] : 0;
    if (slot < 0 || slot >= p.num_slots || prev < 0 || prev >= p.num_slots) {
      ok = false;
      break;
    }
    const long long* h = p.chain_source + slot * p.slot_stride_words;
    const uint64_t want = i > start ? kvc_mix3(kvc_source_chain(p, prev), (uint64_t)p.input_ids[i - 1],
                                               (uint64_t)p.positions[i - 1])
                                    : seed_hash;
    // Positions strictly increase: entries then hold distinct positions, so distinct slots (a
    // slot's source record holds one position), and each slot is stamped by one thread.
    ok = h[KVC_FIELD_TOKEN] == p.input_ids[i] && h[KVC_FIELD_POSITION] == p.positions[i] &&
         (uint64_t)h[KVC_FIELD_PREV_HASH] == want && (i == start || p.positions[i - 1] < p.positions[i]);
  }
  return __syncthreads_and(ok) != 0;
}

// Request [start, end) stamped with the chain source's values (kvc_chain_links held), an entry per
// thread. Repeated slots need no last-occurrence rule here: the links proved that every occurrence
// of a slot stores the same token, position and chain, and the slot's bytes give the same fingerprint.
// Slots are read again and checked again: the arrays are device memory.
__device__ __forceinline__ unsigned kvc_write_linked(const KvcWriteParams& p, long long r, long long start, long long end,
                                                     long long seed_position, bool has_expected, bool pos_assert) {
  unsigned stamped = 0;
  for (long long base = start; base < end; base += blockDim.x) {  // the same rounds in every thread
    const long long i = base + threadIdx.x;
    const long long slot = i < end ? p.out_cache_loc[i] : KVC_SKIP_SLOT;
    const bool in = slot >= 0 && slot < p.num_slots;
    // the record this thread replaces, loaded before the fingerprint (a call) so the two overlap
    const bool lost_check = i < end && kvc_checks_lost_write(p, slot);
    const KvcPrevRecord prev = lost_check ? kvc_prev_record(p, slot) : KvcPrevRecord{0, 0, 0};
    const uint64_t rkv = kvc_fingerprint_lanes(p, slot, in);  // every lane of the warp
    if (i >= end) continue;
    const uint64_t chain = in ? kvc_source_chain(p, slot) : 0;
    const long long prev_position = i > start ? p.positions[i - 1] : seed_position;
    if (lost_check) kvc_lost_write(p, r, slot, prev, p.input_ids[i], p.positions[i], chain, rkv);
    stamped += kvc_write_entry(p, r, i, slot, p.input_ids[i], p.positions[i], chain, prev_position, rkv,
                               has_expected, pos_assert, true);
  }
  return stamped;
}

// A write block's shared memory.
struct KvcWriteShared {
  KvcWriteStage stage[3];  // chunk k % 3: chained, stored (k - 1) and loaded (k + 1) at once
  KvcWriteChain chain[2];  // chain values of chunk k % 2
};

// Request r's tokens [start, end) stamped, its chain run from `seed` (its WritePlan seed), by every
// thread of the block (the same r, range and seed in each). Returns the entries this thread stamped.
__device__ __forceinline__ unsigned kvc_write_request(const KvcWriteParams& p, KvcWriteShared& sh, long long r,
                                                      long long start, long long end, long long seed,
                                                      bool has_expected, bool assert_flag) {
  const int tid = threadIdx.x, worker = kvc_write_worker(tid);
  const int chunks = (int)((end - start + KVC_WRITE_CHUNK - 1) / KVC_WRITE_CHUNK);
  uint64_t running = kvc_sm(KVC_ANCHOR);  // the chain's value before the first entry
  long long running_pos = 0;
  bool pos_assert = false;
  if (seed > KVC_SEED_INVALID && seed <= KVC_SEED_INVALID + KVC_BATCH_FIELD_MAX) return 0;  // rejected
  __syncthreads();  // the previous request's chunks are consumed
  if (seed >= p.num_slots || seed < KVC_CHAIN_HEAD) {  // a seed slot outside the buffer: chain head
    if (tid == 0) kvc_record(p, r, seed, KVC_NO_POSITION, 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_SLOT_OUT_OF_RANGE);
  } else if (seed >= 0) {
    pos_assert = assert_flag;
    running = kvc_slot_hash(p, seed);
    running_pos = kvc_slot(p, seed)[KVC_FIELD_POSITION];
  }
  if (p.chain_source != 0 && chunks > 0 && kvc_chain_links(p, start, end, running))
    return kvc_write_linked(p, r, start, end, running_pos, has_expected, pos_assert);
  unsigned stamped = 0;
  if (worker >= 0 && chunks > 0) kvc_write_load(p, sh.stage[0], start, end, worker);
  __syncthreads();
  for (int k = 0; k <= chunks; ++k) {
    const long long base = start + (long long)k * KVC_WRITE_CHUNK;
    if (tid == 0) {
      if (k < chunks) {
        const int n = (int)(end - base < KVC_WRITE_CHUNK ? end - base : KVC_WRITE_CHUNK);
        kvc_write_chain(p, sh.stage[k % 3], n, sh.chain[k & 1], running, running_pos);
      }
    } else if (worker >= 0) {
      if (k > 0) {
        const long long prev_base = base - KVC_WRITE_CHUNK;
        const int n = (int)(end - prev_base < KVC_WRITE_CHUNK ? end - prev_base : KVC_WRITE_CHUNK);
        stamped += kvc_write_store(p, r, sh.stage[(k - 1) % 3], sh.chain[(k - 1) & 1], prev_base, n, worker,
                                   has_expected, pos_assert);
      }
      if (k + 1 < chunks) kvc_write_load(p, sh.stage[(k + 1) % 3], base + KVC_WRITE_CHUNK, end, worker);
    }
    __syncthreads();
  }
  return stamped;
}

// What a write launch counts: the launch (block 0) and, per warp, the entries its threads stamped.
__device__ __forceinline__ void kvc_write_count(const KvcWriteParams& p, unsigned stamped) {
  const unsigned warp_stamped = __reduce_add_sync(KVC_FULL_MASK, stamped);
  if ((threadIdx.x & 31) == 0 && warp_stamped) atomicAdd(p.slot_run_counter, (unsigned long long)warp_stamped);
}

__device__ __forceinline__ bool kvc_write_has_expected(const KvcWriteParams& p) {
  return p.expected_input_ids != 0 && p.expected_positions != 0;
}

__device__ __forceinline__ bool kvc_write_asserts(const KvcWriteParams& p) {
  return p.chain_position_assert != 0 && *p.chain_position_assert != 0;
}

// The write of one params struct (a launch, or one half of a paired launch): its requests from the
// WritePlan the plan builder stored.
__device__ __forceinline__ void kvc_write_run(const KvcWriteParams& p) {
  __shared__ KvcWriteShared sh;
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(p.kernel_run_counter, 1ULL);
  const long long num_reqs = kvc_clamp(*p.num_valid_reqs, 0, p.req_capacity);
  const long long T = p.num_tokens;
  const bool has_expected = kvc_write_has_expected(p), assert_flag = kvc_write_asserts(p);
  unsigned stamped = 0;
  for (long long r = blockIdx.x; r < num_reqs; r += gridDim.x) {
    const long long start = kvc_clamp(p.offsets[r], 0, T);
    const long long end = kvc_clamp(p.offsets[r + 1], start, T);
    stamped += kvc_write_request(p, sh, r, start, end, p.seed[r], has_expected, assert_flag);
  }
  kvc_write_count(p, stamped);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS) kvc_write(const __grid_constant__ KvcWriteParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  kvc_write_run(p);
}

// The K and V halves of a group in one launch: blockIdx.y is the half (a half never takes its
// chain from the other: a chain source is stamped by an earlier launch).
extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS) kvc_write_pair(const __grid_constant__ KvcWritePair p) {
  KVC_AFTER_PREVIOUS_GRID();
  if (blockIdx.y < KVC_HALVES) kvc_write_run(p.half[blockIdx.y]);
}

// The sum of one value per thread over the block, in every thread (every thread must call it).
__device__ __forceinline__ long long kvc_block_sum(long long v, long long* warp_totals) {
  long long total;
  kvc_block_scan(v, warp_totals, &total);
  return total;
}

// One warp's share of request r's tokens [start, end), at most a warp's (the fold's halves, a warp
// each, side by side), in two phases so the fold can clear the request's verdict between them:
// kvc_warp_load reads and chains (lane l holds entry start + l; every lane runs the chain over the
// request's entries, their values shuffled across, keeping the value its own entry stores; an
// earlier occurrence of a slot repeated in the request stores nothing: kvc_write_store's rule),
// kvc_warp_commit checks, reports and stores what kvc_write_request would, byte for byte. Every
// lane of the warp calls both.
struct KvcWarpEntry {
  long long slot, token, position, prev_position;
  uint64_t rkv, chain;
  bool repeated, pos_assert;
};

__device__ __forceinline__ KvcWarpEntry kvc_warp_load(const KvcWriteParams& p, long long start, long long end,
                                                      long long seed, bool assert_flag) {
  const int lane = threadIdx.x & 31, n = (int)(end - start);
  KvcWarpEntry e;
  uint64_t running = kvc_sm(KVC_ANCHOR);
  long long running_pos = 0;
  e.pos_assert = false;
  if (seed >= 0 && seed < p.num_slots) {
    e.pos_assert = assert_flag;
    running = kvc_slot_hash(p, seed);
    running_pos = kvc_slot(p, seed)[KVC_FIELD_POSITION];
  }
  const bool in = lane < n;
  const long long i = start + lane;
  e.slot = in ? p.out_cache_loc[i] : KVC_SKIP_SLOT;
  e.token = in ? p.input_ids[i] : 0;
  e.position = in ? p.positions[i] : 0;
  e.rkv = kvc_fingerprint_lanes(p, e.slot, e.slot >= 0 && e.slot < p.num_slots);  // every lane
  e.chain = 0;
  e.prev_position = 0;
  e.repeated = false;
  for (int j = 0; j < n; ++j) {  // the same steps in every lane
    const long long sj = __shfl_sync(KVC_FULL_MASK, e.slot, j);
    const long long tj = __shfl_sync(KVC_FULL_MASK, e.token, j), pj = __shfl_sync(KVC_FULL_MASK, e.position, j);
    if (lane == j) {
      e.chain = running;
      e.prev_position = running_pos;
    }
    e.repeated |= j > lane && sj == e.slot;
    const bool stamp = sj >= 0 && sj < p.num_slots;
    const uint64_t next = kvc_mix3(running, (uint64_t)tj, (uint64_t)pj);
    running = stamp ? next : running;
    running_pos = stamp ? pj : running_pos;
  }
  return e;
}

__device__ __forceinline__ unsigned kvc_warp_commit(const KvcWriteParams& p, long long r, long long start,
                                                    long long end, long long seed, const KvcWarpEntry& e,
                                                    bool has_expected) {
  const int lane = threadIdx.x & 31;
  if (seed > KVC_SEED_INVALID && seed <= KVC_SEED_INVALID + KVC_BATCH_FIELD_MAX) return 0;  // rejected
  if ((seed >= p.num_slots || seed < KVC_CHAIN_HEAD) && lane == 0)  // a seed slot outside the buffer
    kvc_record(p, r, seed, KVC_NO_POSITION, 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_SLOT_OUT_OF_RANGE);
  // The lost-write check: the lane that stores a slot checks its earlier occurrences in the
  // request (they store nothing), in order, then its own entry (the shuffles in every lane).
  const int n = (int)(end - start);
  if (p.num_sources > 0) {  // the same in every lane: a write without fingerprints checks nothing
    const bool checks = lane < n && !e.repeated && kvc_checks_lost_write(p, e.slot);
    KvcPrevRecord prev{0, 0, 0};
    if (checks) prev = kvc_prev_record(p, e.slot);
    for (int j = 0; j < n; ++j) {
      const long long sj = __shfl_sync(KVC_FULL_MASK, e.slot, j), tj = __shfl_sync(KVC_FULL_MASK, e.token, j);
      const long long pj = __shfl_sync(KVC_FULL_MASK, e.position, j);
      const uint64_t cj = __shfl_sync(KVC_FULL_MASK, e.chain, j), fj = __shfl_sync(KVC_FULL_MASK, e.rkv, j);
      if (checks && j <= lane && sj == e.slot) prev = kvc_lost_write(p, r, e.slot, prev, tj, pj, cj, fj);
    }
  }
  if (lane >= n) return 0;
  return kvc_write_entry(p, r, start + lane, e.slot, e.token, e.position, e.chain, e.prev_position, e.rkv,
                         has_expected, e.pos_assert, !e.repeated);
}

// Both halves of request r stamped by the whole block, K then V (a request past a warp's tokens).
__device__ __forceinline__ void kvc_fold_block(const KvcPrepareWritePair& p, long long r, long long tokens_before,
                                               long long tokens, long long seed, const bool* has_expected,
                                               const bool* asserts, unsigned* stamped) {
  __shared__ KvcWriteShared sh;
#pragma unroll
  for (int h = 0; h < KVC_HALVES; ++h) {
    const KvcWriteParams& w = p.half[h];
    if (r >= w.req_capacity) continue;  // as kvc_write clamps its request count
    const long long start = kvc_clamp(tokens_before, 0, w.num_tokens);
    const long long end = kvc_clamp(tokens_before + tokens, start, w.num_tokens);
    stamped[h] += kvc_write_request(w, sh, r, start, end, seed, has_expected[h], asserts[h]);
  }
}

// HEAD's first launch of a small step (abi.FOLD_MAX_BATCH, FOLD_MAX_TOKENS): kvc_prepare and both
// halves' writes in one launch, so a decode step spends no launch on its plan. Block b takes
// requests b, b + gridDim.x, ...: for each it sums the entries and tokens of the requests before it
// (carried from its previous request), clears the request's verdict word when the build starts the
// step (§5.7), checks the request as kvc_prepare does (its rows, its seed) and stores its plan
// entries, then stamps its tokens into both halves as kvc_write would from that plan: a request of at
// most 32 tokens by warps 0 (K) and 1 (V) side by side, a longer one by the whole block, K then V.
// Every row this launch attributes to request r comes from r's block, after that clear; the cells
// past the batch are cleared by any block (no row names them). The block of the last request
// (block 0 of an empty batch) also runs kvc_prepare's whole-batch part. The verify launched next
// reads the plan this launch stored.
// kWarps: every request of the step has at most a warp's new tokens (the host launches this variant
// when the step has at most 32): no block path, so no shared write stage.
template <bool kWarps>
__device__ __forceinline__ void kvc_prepare_write(const KvcPrepareWritePair& p) {
  __shared__ long long warp_totals[32];
  __shared__ long long request_seed;
  const KvcPrepareParams& q = p.plan[0];
  const bool reset = q.verdict_reset != 0;
  if (reset)
    for (long long c = q.batch_size + (long long)blockIdx.x * blockDim.x + threadIdx.x; c < q.verdict_len;
         c += (long long)gridDim.x * blockDim.x)
      kvc_verdict_clear(q, c);
  bool has_expected[KVC_HALVES], asserts[KVC_HALVES];
  unsigned stamped[KVC_HALVES];
#pragma unroll
  for (int h = 0; h < KVC_HALVES; ++h) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(p.half[h].kernel_run_counter, 1ULL);
    has_expected[h] = kvc_write_has_expected(p.half[h]);
    asserts[h] = kvc_write_asserts(p.half[h]);
    stamped[h] = 0;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  long long entries_before = 0, tokens_before = 0, counted = 0;  // sums over requests [0, counted)
  for (long long r = blockIdx.x; r < q.batch_size; r += gridDim.x) {
    long long entries = 0, tokens = 0;
    for (long long j = counted + threadIdx.x; j < r; j += blockDim.x) {
      const KvcRequest x = kvc_request(q, j);
      entries += x.n;
      tokens += x.tokens;
    }
    entries_before += kvc_block_sum(entries, warp_totals);
    tokens_before += kvc_block_sum(tokens, warp_totals);
    counted = r;
    const KvcRequest x = kvc_request(q, r);
    if (kWarps || x.tokens <= 32) {
      // Warps 0 (K) and 1 (V) read and chain their half while warp 2 clears the request's verdict;
      // after the barrier warp 2 reports the request and stores its plan entries, warps 0 and 1
      // check, report and store their tokens: every row of the request lands after the clear.
      const long long seed = kvc_request_seed(q, x);
      KvcWarpEntry e;
      long long start = 0, end = 0;
      const bool writes = warp < KVC_HALVES && r < p.half[warp].req_capacity;  // as kvc_write clamps
      if (writes) {
        const KvcWriteParams& w = p.half[warp];
        start = kvc_clamp(tokens_before, 0, w.num_tokens);
        end = kvc_clamp(tokens_before + x.tokens, start, w.num_tokens);
        e = kvc_warp_load(w, start, end, seed, asserts[warp]);
      }
      if (warp == KVC_HALVES && lane == 0 && reset) kvc_verdict_clear(q, r);
      __syncthreads();
      if (writes) stamped[warp] += kvc_warp_commit(p.half[warp], r, start, end, seed, e, has_expected[warp]);
      if (warp == KVC_HALVES && lane == 0) {
        kvc_report_request(q, r, x);
        q.entry_offsets[r + 1] = entries_before + x.n;
        q.write_offsets[r + 1] = tokens_before + x.tokens;
        q.write_seed[r] = seed;
      }
    } else {
      if (threadIdx.x == 0) {
        if (reset) kvc_verdict_clear(q, r);
        const long long seed = kvc_prepare_request(q, r, x);
        q.entry_offsets[r + 1] = entries_before + x.n;
        q.write_offsets[r + 1] = tokens_before + x.tokens;
        q.write_seed[r] = seed;
        request_seed = seed;
      }
      __syncthreads();
      if constexpr (!kWarps) kvc_fold_block(p, r, tokens_before, x.tokens, request_seed, has_expected, asserts, stamped);
    }
    if (r == q.batch_size - 1) kvc_prepare_finish(q, entries_before + x.n, tokens_before + x.tokens);
  }
  if (q.batch_size <= 0 && blockIdx.x == 0) kvc_prepare_finish(q, 0, 0);
#pragma unroll
  for (int h = 0; h < KVC_HALVES; ++h) kvc_write_count(p.half[h], stamped[h]);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS)
kvc_prepare_write_pair(const __grid_constant__ KvcPrepareWritePair p) {
  KVC_AFTER_PREVIOUS_GRID();
  kvc_prepare_write<false>(p);
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS)
kvc_prepare_write_pair_warps(const __grid_constant__ KvcPrepareWritePair p) {
  KVC_AFTER_PREVIOUS_GRID();
  kvc_prepare_write<true>(p);
}
