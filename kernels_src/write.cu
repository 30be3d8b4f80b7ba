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
#include "common.cuh"

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

// Entries [base, min(base + CHUNK, end)) into `st`; slot -1 pads the tail of the chunk.
__device__ __forceinline__ void kvc_write_load(const KvcWriteParams& p, KvcWriteStage& st, long long base,
                                               long long end, int t) {
  for (int j = t; j < KVC_WRITE_CHUNK; j += KVC_WRITE_WORKERS) {
    const long long i = base + j;
    long long slot = -1, token = 0, position = 0;
    uint64_t rkv = 0;
    if (i < end) {
      slot = p.out_cache_loc[i];
      token = p.input_ids[i];
      position = p.positions[i];
      if (slot >= 0 && slot < p.num_slots) rkv = kvc_fingerprint(p, slot);
    }
    st.slot[j] = slot;
    st.token[j] = token;
    st.position[j] = position;
    st.rkv[j] = rkv;
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

// Check and store the n entries of a chunk whose chain values are in `ch` (worker threads).
// Returns the entries this thread stamped.
__device__ __forceinline__ unsigned kvc_write_store(const KvcWriteParams& p, const KvcWriteStage& st,
                                                    const KvcWriteChain& ch, long long base, int n, int t,
                                                    bool has_expected, bool pos_assert) {
  unsigned stamped = 0;
  for (int j = t; j < n; j += KVC_WRITE_WORKERS) {
    const long long slot = st.slot[j], token = st.token[j], position = st.position[j];
    const uint64_t chain = ch.prev_hash[j];
    const long long i = base + j;
    if (slot >= p.num_slots) {
      kvc_record(p, slot, position, token, KVC_NO_EXPECTED_TOKEN, chain, 0, KVC_SLOT_OUT_OF_RANGE);
      continue;
    }
    if (slot < 0) continue;
    if (has_expected) {
      const long long et = p.expected_input_ids[i], ep = p.expected_positions[i];
      const long long bits = (token != et ? KVC_WRITE_TOKEN_MISMATCH : 0) |
                             (position != ep ? KVC_WRITE_POSITION_MISMATCH : 0);
      if (bits) kvc_record(p, slot, position, token, et, chain, (uint64_t)ep, bits);
    }
    if (pos_assert && position != ch.position[j] + 1)
      kvc_record(p, slot, position, token, token, chain, (uint64_t)(ch.position[j] + 1),  // SGLang's column 4
                 KVC_WRITE_POSITION_MISMATCH);
    ++stamped;
    bool repeated = false;  // a slot repeated in one chunk: only its last occurrence stores
#pragma unroll 8
    for (int k = j + 1; k < n; ++k) repeated |= st.slot[k] == slot;
    if (!repeated) {
      long long* f = p.canary + slot * p.slot_stride_words;
      f[KVC_FIELD_TOKEN] = token;
      f[KVC_FIELD_POSITION] = position;
      f[KVC_FIELD_PREV_HASH] = (long long)chain;
      f[KVC_FIELD_REAL_KV_HASH] = (long long)st.rkv[j];
    }
  }
  return stamped;
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS) kvc_write(const __grid_constant__ KvcWriteParams p) {
  __shared__ KvcWriteStage stage[3];   // chunk k % 3: chained, stored (k - 1) and loaded (k + 1) at once
  __shared__ KvcWriteChain chain[2];   // chain values of chunk k % 2
  const int tid = threadIdx.x, worker = kvc_write_worker(tid);
  if (blockIdx.x == 0 && tid == 0) atomicAdd(p.kernel_run_counter, 1ULL);
  const long long num_reqs = kvc_clamp(*p.num_valid_reqs, 0, p.req_capacity);
  const long long T = p.num_tokens;
  const bool has_expected = p.expected_input_ids != 0 && p.expected_positions != 0;
  const bool assert_flag = p.chain_position_assert != 0 && *p.chain_position_assert != 0;
  unsigned stamped = 0;

  for (long long r = blockIdx.x; r < num_reqs; r += gridDim.x) {
    const long long start = kvc_clamp(p.offsets[r], 0, T);
    const long long end = kvc_clamp(p.offsets[r + 1], start, T);
    const long long seed = p.seed[r];
    const int chunks = (int)((end - start + KVC_WRITE_CHUNK - 1) / KVC_WRITE_CHUNK);
    uint64_t running = kvc_sm(KVC_ANCHOR);  // meaningful in thread 0, which runs the chain
    long long running_pos = 0;
    bool pos_assert = false;
    if (seed > KVC_SEED_INVALID && seed <= KVC_SEED_INVALID + KVC_BATCH_FIELD_MAX) continue;  // rejected
    __syncthreads();  // the previous request's chunks are consumed
    if (seed >= p.num_slots || seed < KVC_CHAIN_HEAD) {  // a seed slot outside the buffer: chain head
      if (tid == 0) kvc_record(p, seed, -1, 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_SLOT_OUT_OF_RANGE);
    } else if (seed >= 0) {
      pos_assert = assert_flag;
      if (tid == 0) {
        running = kvc_slot_hash(p, seed);
        running_pos = kvc_slot(p, seed)[KVC_FIELD_POSITION];
      }
    }
    if (worker >= 0 && chunks > 0) kvc_write_load(p, stage[0], start, end, worker);
    __syncthreads();
    for (int k = 0; k <= chunks; ++k) {
      const long long base = start + (long long)k * KVC_WRITE_CHUNK;
      if (tid == 0) {
        if (k < chunks) {
          const int n = (int)(end - base < KVC_WRITE_CHUNK ? end - base : KVC_WRITE_CHUNK);
          kvc_write_chain(p, stage[k % 3], n, chain[k & 1], running, running_pos);
        }
      } else if (worker >= 0) {
        if (k > 0) {
          const long long prev_base = base - KVC_WRITE_CHUNK;
          const int n = (int)(end - prev_base < KVC_WRITE_CHUNK ? end - prev_base : KVC_WRITE_CHUNK);
          stamped += kvc_write_store(p, stage[(k - 1) % 3], chain[(k - 1) & 1], prev_base, n, worker,
                                     has_expected, pos_assert);
        }
        if (k + 1 < chunks) kvc_write_load(p, stage[(k + 1) % 3], base + KVC_WRITE_CHUNK, end, worker);
      }
      __syncthreads();
    }
  }
  const unsigned warp_stamped = __reduce_add_sync(KVC_FULL_MASK, stamped);
  if ((tid & 31) == 0 && warp_stamped) atomicAdd(p.slot_run_counter, (unsigned long long)warp_stamped);
}
