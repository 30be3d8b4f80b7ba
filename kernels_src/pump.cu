// The pump's status snapshot (docs/format.md §10). Launched once per step on the step's stream, after the
// step's canary launches: copies the int64 status block (ring write index, per-launch counters,
// plan flags) into one FIFO slot of pinned host memory mapped for the device, then writes the
// slot's completion word, which the host polls with plain loads (no driver call).
//
// Ordering: every thread stores its part of the payload and fences at system scope; after the
// block barrier thread 0 fences again and only then stores the ticket. A host that reads
// *done == ticket therefore reads the complete payload. Never raises, never waits on the host;
// one block (the status block is a few hundred words at most).
#include "common.cuh"

extern "C" __global__ void kvc_snapshot(const __grid_constant__ KvcSnapshotParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  if (blockIdx.x != 0) return;
  const volatile long long* src = p.status;  // written by this stream's earlier launches
  volatile long long* dst = p.payload;
  // the verdict tail (cells past head) only when the step failed a request (cell head != 0, §5.7)
  const long long n = (p.head >= 0 && p.head < p.n && src[p.head] == 0) ? p.head + 1 : p.n;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    *reinterpret_cast<volatile long long*>(p.done) = p.ticket;
  }
}
