// Canary records that travel with their KV (offload, disaggregated transfer, migration): one
// launch copies the records of `n` slots of a pool group's buffers (HEAD/TAIL x K/V, all of one
// shape) into a compact [buffers, n, FIELDS_PER_SLOT] array (export) or back from it (import).
// A slot outside the buffers is reported (SLOT_OUT_OF_RANGE, POSITION = its index in `slots`)
// and skipped: nothing is read or written for it. Never raises, never waits.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS) kvc_copy_records(const __grid_constant__ KvcRecordsParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  long long* bufs[KVC_MAX_RECORD_BUFFERS] = {p.canary, p.canary1, p.canary2, p.canary3};
  const int nb = p.num_buffers < KVC_MAX_RECORD_BUFFERS ? p.num_buffers : KVC_MAX_RECORD_BUFFERS;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += stride) {
    const long long slot = p.slots[i];
    if (slot < 0 || slot >= p.num_slots) {
      kvc_record(p, KVC_NO_REQUEST, slot, i, 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_SLOT_OUT_OF_RANGE);
      continue;
    }
    for (int b = 0; b < nb; ++b) {
      long long* f = bufs[b] + slot * p.slot_stride_words;
      long long* r = p.records + (b * p.n + i) * KVC_FIELDS_PER_SLOT;
#pragma unroll
      for (int k = 0; k < KVC_FIELDS_PER_SLOT; ++k) {
        if (p.import_records) f[k] = r[k];
        else r[k] = f[k];
      }
    }
  }
}
