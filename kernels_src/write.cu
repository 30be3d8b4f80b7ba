// Write kernel (SPEC §7). One block per request (grid-stride over requests), entries in chunks.
// While warp 0 advances the serial chain over chunk k (lane 0, reading tokens and positions from
// shared memory), warps 1.. load chunk k+1 and fingerprint its slots' real KV; then every thread
// checks and stores one entry of chunk k. A long prefill is thus bound by the chain's arithmetic,
// not by memory latency or the real-KV folds. Graph-safe: per-step values live on the device.
#include "common.cuh"

#define KVC_WRITE_THREADS 256
#define KVC_WRITE_CHUNK 256

struct KvcWriteStage {
  long long slot[KVC_WRITE_CHUNK];
  long long token[KVC_WRITE_CHUNK];
  long long position[KVC_WRITE_CHUNK];
  uint64_t rkv[KVC_WRITE_CHUNK];
};

// Entries [base, min(base + CHUNK, end)) into `st`; slot -1 pads the tail of the chunk.
__device__ __forceinline__ void kvc_write_load(const KvcWriteParams& p, KvcWriteStage& st, long long base,
                                               long long end, int t, int nthreads) {
  for (int j = t; j < KVC_WRITE_CHUNK; j += nthreads) {
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

#define KVC_CHAIN_GROUP 8

// Entries [j0, j0 + GROUP) of a staged chunk into registers (zeros past the chunk's end).
__device__ __forceinline__ void kvc_chain_group(const KvcWriteStage& st, int j0, long long* s, long long* t,
                                                long long* q) {
#pragma unroll
  for (int u = 0; u < KVC_CHAIN_GROUP; ++u) {
    const bool in = j0 + u < KVC_WRITE_CHUNK;
    s[u] = in ? st.slot[j0 + u] : -1;
    t[u] = in ? st.token[j0 + u] : 0;
    q[u] = in ? st.position[j0 + u] : 0;
  }
}

extern "C" __global__ void __launch_bounds__(KVC_WRITE_THREADS) kvc_write(const __grid_constant__ KvcWriteParams p) {
  __shared__ KvcWriteStage stage[2];
  __shared__ uint64_t chain[KVC_WRITE_CHUNK];     // PREV_HASH stored by each entry of the chunk
  __shared__ long long chain_pos[KVC_WRITE_CHUNK];  // position asserted against (+1) per entry
  const int tid = threadIdx.x, warp = tid >> 5;
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
    uint64_t running = kvc_sm(KVC_ANCHOR);  // meaningful in thread 0, which runs the chain
    long long running_pos = 0;
    bool pos_assert = false;
    if (seed >= p.num_slots) {
      if (tid == 0) kvc_record(p, seed, -1, 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_SLOT_OUT_OF_RANGE);
    } else if (seed >= 0) {
      pos_assert = assert_flag;
      if (tid == 0) {
        running = kvc_slot_hash(p, seed);
        running_pos = kvc_slot(p, seed)[KVC_FIELD_POSITION];
      }
    }
    __syncthreads();  // the previous request's last chunk is fully consumed
    if (start < end) kvc_write_load(p, stage[0], start, end, tid, KVC_WRITE_THREADS);
    __syncthreads();
    int buf = 0;
    for (long long base = start; base < end; base += KVC_WRITE_CHUNK) {
      const int n = (int)(end - base < KVC_WRITE_CHUNK ? end - base : KVC_WRITE_CHUNK);
      const KvcWriteStage& st = stage[buf];
      if (tid == 0) {
        // Groups of 8: the next group is read from shared memory before this group's mix3 steps,
        // and skipped entries select instead of branching, so only the arithmetic is serial.
        long long s0[KVC_CHAIN_GROUP], t0[KVC_CHAIN_GROUP], q0[KVC_CHAIN_GROUP];
        kvc_chain_group(st, 0, s0, t0, q0);
        for (int j0 = 0; j0 < n; j0 += KVC_CHAIN_GROUP) {
          long long s1[KVC_CHAIN_GROUP], t1[KVC_CHAIN_GROUP], q1[KVC_CHAIN_GROUP];
          kvc_chain_group(st, j0 + KVC_CHAIN_GROUP, s1, t1, q1);
#pragma unroll
          for (int u = 0; u < KVC_CHAIN_GROUP; ++u) {
            if (j0 + u < n) {
              chain[j0 + u] = running;
              chain_pos[j0 + u] = running_pos;
              const bool stamp = s0[u] >= 0 && s0[u] < p.num_slots;
              const uint64_t next = kvc_mix3(running, (uint64_t)t0[u], (uint64_t)q0[u]);
              running = stamp ? next : running;
              running_pos = stamp ? q0[u] : running_pos;
            }
          }
#pragma unroll
          for (int u = 0; u < KVC_CHAIN_GROUP; ++u) {
            s0[u] = s1[u];
            t0[u] = t1[u];
            q0[u] = q1[u];
          }
        }
      } else if (warp > 0 && base + KVC_WRITE_CHUNK < end) {
        kvc_write_load(p, stage[buf ^ 1], base + KVC_WRITE_CHUNK, end, tid - 32, KVC_WRITE_THREADS - 32);
      }
      __syncthreads();
      for (int j = tid; j < n; j += KVC_WRITE_THREADS) {
        const long long slot = st.slot[j], token = st.token[j], position = st.position[j];
        const long long i = base + j;
        if (slot >= p.num_slots) {
          kvc_record(p, slot, position, token, KVC_NO_EXPECTED_TOKEN, chain[j], 0, KVC_SLOT_OUT_OF_RANGE);
          continue;
        }
        if (slot < 0) continue;
        if (has_expected) {
          const long long et = p.expected_input_ids[i], ep = p.expected_positions[i];
          const long long bits = (token != et ? KVC_WRITE_TOKEN_MISMATCH : 0) |
                                 (position != ep ? KVC_WRITE_POSITION_MISMATCH : 0);
          if (bits) kvc_record(p, slot, position, token, et, chain[j], (uint64_t)ep, bits);
        }
        if (pos_assert && position != chain_pos[j] + 1)
          kvc_record(p, slot, position, token, KVC_NO_EXPECTED_TOKEN, chain[j], (uint64_t)(chain_pos[j] + 1),
                     KVC_WRITE_POSITION_MISMATCH);
        ++stamped;
        bool last = true;  // a slot repeated in one chunk: only its last occurrence stores
        for (int k = j + 1; k < n && last; ++k) last = st.slot[k] != slot;
        if (last) {
          long long* f = p.canary + slot * p.slot_stride_words;
          f[KVC_FIELD_TOKEN] = token;
          f[KVC_FIELD_POSITION] = position;
          f[KVC_FIELD_PREV_HASH] = (long long)chain[j];
          f[KVC_FIELD_REAL_KV_HASH] = (long long)st.rkv[j];
        }
      }
      __syncthreads();
      buf ^= 1;
    }
  }
  const unsigned warp_stamped = __reduce_add_sync(KVC_FULL_MASK, stamped);
  if ((tid & 31) == 0 && warp_stamped) atomicAdd(p.slot_run_counter, (unsigned long long)warp_stamped);
}
