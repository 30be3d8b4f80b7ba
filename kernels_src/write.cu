// Write kernel (SPEC §7). One warp per request, 32 entries per round: every lane loads one entry
// and fingerprints its slot's real KV in parallel, then the warp advances the serial chain over the
// round (all lanes compute it in lockstep, reading tokens and positions through shuffles), then
// every lane checks its entry and stores its record. Graph-safe: per-step values live on the device.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) kvc_write(const __grid_constant__ KvcWriteParams p) {
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(p.kernel_run_counter, 1ULL);
  const long long num_reqs = kvc_clamp(*p.num_valid_reqs, 0, p.req_capacity);
  const long long T = p.num_tokens;
  const bool has_expected = p.expected_input_ids != 0 && p.expected_positions != 0;
  const bool assert_flag = p.chain_position_assert != 0 && *p.chain_position_assert != 0;

  for (long long r = warp; r < num_reqs; r += nwarps) {
    const long long start = kvc_clamp(p.offsets[r], 0, T);
    const long long end = kvc_clamp(p.offsets[r + 1], start, T);
    const long long seed = p.seed[r];
    uint64_t running = kvc_sm(KVC_ANCHOR);
    long long running_pos = 0;
    bool pos_assert = false;
    if (seed >= p.num_slots) {
      if (lane == 0) kvc_record(p, seed, -1, 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_SLOT_OUT_OF_RANGE);
    } else if (seed >= 0) {
      running = kvc_slot_hash(p, seed);
      pos_assert = assert_flag;
      running_pos = kvc_slot(p, seed)[KVC_FIELD_POSITION];
    }
    unsigned long long stamped = 0;
    for (long long base = start; base < end; base += 32) {
      const long long i = base + lane;
      const bool valid = i < end;
      const long long slot = valid ? p.out_cache_loc[i] : -1;
      const long long token = valid ? p.input_ids[i] : 0;
      const long long position = valid ? p.positions[i] : 0;
      const bool stamp = valid && slot >= 0 && slot < p.num_slots;
      const bool out_of_range = valid && slot >= p.num_slots;
      const uint64_t rkv = stamp ? kvc_fingerprint(p, slot) : 0;
      const unsigned stamp_mask = __ballot_sync(KVC_FULL_MASK, stamp);
      // Serial chain over the round; lane j keeps the values in force when entry j is reached.
      uint64_t my_running = 0;
      long long my_running_pos = 0;
      const int n = (int)(end - base < 32 ? end - base : 32);
#pragma unroll 4
      for (int j = 0; j < n; ++j) {
        const long long tj = __shfl_sync(KVC_FULL_MASK, token, j);
        const long long pj = __shfl_sync(KVC_FULL_MASK, position, j);
        if (lane == j) {
          my_running = running;
          my_running_pos = running_pos;
        }
        if ((stamp_mask >> j) & 1u) {
          running = kvc_mix3(running, (uint64_t)tj, (uint64_t)pj);
          running_pos = pj;
        }
      }
      if (out_of_range)
        kvc_record(p, slot, position, token, KVC_NO_EXPECTED_TOKEN, my_running, 0, KVC_SLOT_OUT_OF_RANGE);
      if (stamp) {
        if (has_expected) {
          const long long et = p.expected_input_ids[i], ep = p.expected_positions[i];
          const long long bits = (token != et ? KVC_WRITE_TOKEN_MISMATCH : 0) |
                                 (position != ep ? KVC_WRITE_POSITION_MISMATCH : 0);
          if (bits) kvc_record(p, slot, position, token, et, my_running, (uint64_t)ep, bits);
        }
        if (pos_assert && position != my_running_pos + 1)
          kvc_record(p, slot, position, token, KVC_NO_EXPECTED_TOKEN, my_running,
                     (uint64_t)(my_running_pos + 1), KVC_WRITE_POSITION_MISMATCH);
      }
      // A slot repeated inside one round: only its last occurrence stores (sequential semantics).
      const unsigned same = __match_any_sync(KVC_FULL_MASK, stamp ? slot : -1 - (long long)lane);
      if (stamp && (31 - __clz(same)) == lane) {
        long long* f = p.canary + slot * p.slot_stride_words;
        f[KVC_FIELD_TOKEN] = token;
        f[KVC_FIELD_POSITION] = position;
        f[KVC_FIELD_PREV_HASH] = (long long)my_running;
        f[KVC_FIELD_REAL_KV_HASH] = (long long)rkv;
      }
      stamped += __popc(stamp_mask);
      __syncwarp();
    }
    if (lane == 0 && stamped) atomicAdd(p.slot_run_counter, stamped);
  }
}
