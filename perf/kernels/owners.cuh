// The request that owns a verify entry, for the perf kernels that take one entry per lane (the
// simple baseline of baseline.cu and the fused same-loads probe of probes.cu): the last request r
// with entry_offsets[r] <= e, for the plan builder's non-decreasing offsets (docs/format.md §8).
// A warp's lanes hold consecutive entries, so only the owners of its first and last entries are
// searched, both at once: each step every lane tests one of 32 evenly spaced offsets per entry (two
// independent L1 loads and two votes), which settles a batch of up to 1024 requests in two steps
// where a binary search chains ten dependent loads. Lanes then search only between those two owners
// (nothing when one request holds the whole warp, one load when a single request starts in it).
#pragma once
#include "common.cuh"

// Owner of this lane's entry e, first <= e <= last, where first and last are the warp's first and
// last entries; in [0, n) (n >= 1) whatever the offsets hold. Every lane of the warp must call it,
// with the same first, last and n.
__device__ __forceinline__ int kvcb_owner(const long long* offsets, int n, long long first, long long last,
                                          long long e) {
  const int lane = threadIdx.x & 31;
  int lo0 = 0, hi0 = n, lo1 = 0, hi1 = n;  // the owners of first and last lie in [lo, hi)
  while (hi0 - lo0 > 1 || hi1 - lo1 > 1) {
    const int w0 = (hi0 - lo0 + 31) >> 5, w1 = (hi1 - lo1 + 31) >> 5;  // 32 parts of the range cover it
    const int i0 = lo0 + (lane + 1) * w0, i1 = lo1 + (lane + 1) * w1;   // the part lane + 1 starts at
    const unsigned below0 = __ballot_sync(KVC_FULL_MASK, i0 < hi0 && offsets[i0] <= first);
    const unsigned below1 = __ballot_sync(KVC_FULL_MASK, i1 < hi1 && offsets[i1] <= last);
    lo0 += __popc(below0) * w0;  // for non-decreasing offsets the lanes that pass are lanes 0, 1, ...
    hi0 = min(hi0, lo0 + w0);
    lo1 += __popc(below1) * w1;
    hi1 = min(hi1, lo1 + w1);
  }
  return lo0 >= lo1 ? lo0 : (int)kvc_owner_in(offsets, e, lo0, lo1 + 1);
}
