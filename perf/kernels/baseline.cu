// The "plan + verify + one-thread-write" design of issue 6, for comparison only (perf/, never
// shipped): the shape SGLang's KV canary uses, with kvcanary's own semantics. Both kernels take
// kvcanary's params structs unchanged (packed by kvcanary.ops.prepare_verify / prepare_write) and
// reuse kernels_src's device functions, so they differ from kvcanary's kernels in launch shape
// and work split only:
//  - kvcb_verify_persistent: the materialised plan, grid-stride over a 64 x 512 persistent grid;
//  - kvcb_write_one_thread: one thread per request, fingerprint and chain serially per entry
//    (no expected-input or position asserts: the benchmark workloads use neither).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(512)
kvcb_verify_persistent(const __grid_constant__ KvcVerifyParams p) {
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (tid == 0) atomicAdd(p.kernel_run_counter, 1ULL);
  if (*p.plan_enable == 0) return;
  const long long active = kvc_clamp(*p.plan_num_valid, 0, p.plan_capacity);
  if (tid == 0) atomicAdd(p.slot_run_counter, (unsigned long long)active);
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long e = tid; e < active; e += stride)
    kvc_verify_entry(p, p.plan_slot[e], p.plan_expected_token[e], p.plan_expected_position[e],
                     p.plan_prev_slot[e], p.check_expected_token != 0);
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
