// Real-KV fingerprints for the verify kernels (docs/format.md §3, §4): a lane's own strips one 16-byte load
// at a time (short strips), or a warp's 32 strips fetched together with cp.async, a 128-byte line
// of each strip per round straight into shared memory, every lane folding its own strip there.
#pragma once
#include "common.cuh"

// KVC_WIDE_PIECES 16-byte pieces of each strip staged per round (a 128-byte line), KVC_WIDE_DEPTH
// rounds in flight per warp (abi.py); a copy instruction of a warp stages STRIPS_PER_LOAD strips.
#define KVC_WIDE_STRIPS_PER_LOAD (32 / KVC_WIDE_PIECES)
#define KVC_WIDE_LOADS (32 / KVC_WIDE_STRIPS_PER_LOAD)
static_assert(32 % KVC_WIDE_PIECES == 0, "a warp's lanes split evenly over the pieces of a round");
static_assert(KVC_WIDE_DEPTH == 2, "kvc_fingerprint_warp waits for all but the one newer round");
static_assert((long long)sizeof(ulonglong2) == KVC_STRIP_PIECE_BYTES, "a strip piece is one 16-byte vector load");

// One warp's staging area: KVC_WIDE_DEPTH rounds in flight, a row of pieces per lane's strip (+1
// piece so rows start in other banks).
struct KvcWideStage {
  ulonglong2 piece[KVC_WIDE_DEPTH][32][KVC_WIDE_PIECES + 1];
};

// 16 bytes global -> shared without registers (cp.async, sm_80+); zero-fills when !valid. (The
// CPU emulator of the tests copies at once: one valid schedule of the asynchronous copy.)
#ifdef KVC_EMULATED
__device__ __forceinline__ void kvc_copy16_async(ulonglong2* dst, const ulonglong2* src, bool valid) {
  *dst = valid ? *src : ulonglong2{0, 0};
}
__device__ __forceinline__ void kvc_copy_commit() {}
template <int N>
__device__ __forceinline__ void kvc_copy_wait() {}
#else
__device__ __forceinline__ void kvc_copy16_async(ulonglong2* dst, const ulonglong2* src, bool valid) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  // cp-size 16 (the one size of .cg): a whole piece; src-size 0 zero-fills it
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? (int)sizeof(ulonglong2) : 0) : "memory");
}
__device__ __forceinline__ void kvc_copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void kvc_copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
#endif

// Fingerprint of `slot`, one 16-byte load at a time: few registers, for short strips (< KVC_WIDE_HASH_BYTES)
// of one or a few sources.
template <class P>
__device__ __forceinline__ uint64_t kvc_fingerprint_narrow(const P& p, long long slot) {
  uint64_t total = 0;
  for (int i = 0; i < p.num_sources; ++i) {
    const ulonglong2* q = kvc_strip(p.sources[i], slot);
    uint64_t h = 0;
    for (int k = 0; k < p.sources[i].hash_bytes / KVC_STRIP_PIECE_BYTES; ++k) {
      const ulonglong2 w = __ldg(q + k);
      h = kvc_sm(h ^ w.x);
      h = kvc_sm(h ^ w.y);
    }
    total = kvc_sm(total ^ h);
  }
  return total;
}

// The same over many sources (a layer each, KVC_MANY_SOURCES or more): the first 16-byte piece of
// KVC_SOURCE_BATCH sources is loaded before any is folded, so a slot fingerprinted over every layer
// waits for memory once per batch of sources, not once per source (more registers: the *_many
// kernels run fewer blocks per SM).
template <class P>
__device__ __forceinline__ uint64_t kvc_fingerprint_many(const P& p, long long slot) {
  uint64_t total = 0;
  for (int i0 = 0; i0 < p.num_sources; i0 += KVC_SOURCE_BATCH) {
    ulonglong2 first[KVC_SOURCE_BATCH];
#pragma unroll
    for (int k = 0; k < KVC_SOURCE_BATCH; ++k)
      first[k] = i0 + k < p.num_sources ? __ldg(kvc_strip(p.sources[i0 + k], slot)) : ulonglong2{0, 0};
#pragma unroll
    for (int k = 0; k < KVC_SOURCE_BATCH; ++k) {
      if (i0 + k < p.num_sources) {
        const KvcSourceDesc& s = p.sources[i0 + k];
        uint64_t h = kvc_sm(kvc_sm(first[k].x) ^ first[k].y);  // h = 0 folded with the first piece
        const ulonglong2* q = kvc_strip(s, slot);
        for (int j = 1; j < s.hash_bytes / KVC_STRIP_PIECE_BYTES; ++j) {
          const ulonglong2 w = __ldg(q + j);
          h = kvc_sm(h ^ w.x);
          h = kvc_sm(h ^ w.y);
        }
        total = kvc_sm(total ^ h);
      }
    }
  }
  return total;
}

// Fingerprint of lane's `slot` (0 unless `own`) for the write kernel, every lane of the warp calling
// it. A warp holding few slots of many sources (a decode step stamped over every layer) spreads each
// slot's sources over its lanes: lane l folds sources l, l + 32, ..., one memory round trip for all
// of them, and the slot's lane folds the per-source values in source order (§3). Otherwise each
// lane fingerprints its own slot: short strips of many sources with their first loads batched
// (kvc_fingerprint_many), else source by source with eight loads of a strip in flight.
template <class P>
__device__ __noinline__ uint64_t kvc_fingerprint_lanes(const P& p, long long slot, bool own) {
  const unsigned mask = __ballot_sync(KVC_FULL_MASK, own);
  const int per_slot = (p.num_sources + 31) / 32, batches = (p.num_sources + KVC_SOURCE_BATCH - 1) / KVC_SOURCE_BATCH;
  if (__popc(mask) * per_slot >= batches) {
    if (!own) return 0;
    const bool short_strips = p.num_sources >= KVC_MANY_SOURCES && p.sources[0].hash_bytes <= KVC_STRIP_PIECE_BYTES;
    return short_strips ? kvc_fingerprint_many(p, slot) : kvc_fingerprint(p, slot);
  }
  const int lane = threadIdx.x & 31;
  uint64_t mine = 0;
  for (int owner = 0; owner < 32; ++owner) {
    if (!((mask >> owner) & 1u)) continue;  // the same in every lane
    const long long s = __shfl_sync(KVC_FULL_MASK, slot, owner);
    uint64_t total = 0;
    for (int i0 = 0; i0 < p.num_sources; i0 += 32) {
      const uint64_t h = i0 + lane < p.num_sources ? kvc_fold_strip(p.sources[i0 + lane], s) : 0;
      const int m = p.num_sources - i0 < 32 ? p.num_sources - i0 : 32;
      for (int k = 0; k < m; ++k) total = kvc_sm(total ^ __shfl_sync(KVC_FULL_MASK, h, k));
    }
    if (lane == owner) mine = total;
  }
  return mine;
}

// Fingerprint of lane's `slot` (0 unless `own`), the strips fetched by the whole warp: each round
// copies the next 128-byte line of every strip straight into shared memory (4 strips per
// instruction, two rounds in flight), and every lane folds its own strip from there. Every lane of
// the warp must call it.
template <class P>
__device__ __forceinline__ uint64_t kvc_fingerprint_warp(const P& p, long long slot, bool own, KvcWideStage& st) {
  const int lane = threadIdx.x & 31, sub = lane % KVC_WIDE_PIECES, grp = lane / KVC_WIDE_PIECES;
  const ulonglong2* dummy = reinterpret_cast<const ulonglong2*>(p.canary);  // never read: zero-size copies
  uint64_t total = 0;
  for (int i = 0; i < p.num_sources; ++i) {
    const KvcSourceDesc& s = p.sources[i];
    const unsigned long long mine = own ? (unsigned long long)kvc_strip(s, slot) : 0;
    const ulonglong2* src[KVC_WIDE_LOADS];  // strip k * STRIPS_PER_LOAD + grp, of another lane
#pragma unroll
    for (int k = 0; k < KVC_WIDE_LOADS; ++k)
      src[k] = reinterpret_cast<const ulonglong2*>(__shfl_sync(KVC_FULL_MASK, mine, k * KVC_WIDE_STRIPS_PER_LOAD + grp));
    const int n = s.hash_bytes / KVC_STRIP_PIECE_BYTES;
    const int rounds = (n + KVC_WIDE_PIECES - 1) / KVC_WIDE_PIECES;
    auto issue = [&](int c) {  // round c: pieces [c * PIECES, (c + 1) * PIECES) of every strip
      const int piece = c * KVC_WIDE_PIECES + sub;
#pragma unroll
      for (int k = 0; k < KVC_WIDE_LOADS; ++k) {
        const bool valid = src[k] != 0 && piece < n;
        kvc_copy16_async(&st.piece[c % KVC_WIDE_DEPTH][k * KVC_WIDE_STRIPS_PER_LOAD + grp][sub],
                         valid ? src[k] + piece : dummy, valid);
      }
      kvc_copy_commit();
    };
    __syncwarp();  // the previous source's folds have read the stage (its copies all landed)
    for (int c = 0; c < KVC_WIDE_DEPTH && c < rounds; ++c) issue(c);
    uint64_t h = 0;
    for (int c = 0; c < rounds; ++c) {
      // This lane's copies of round c have landed: only round c + 1 may still be in flight.
      if (c + 1 < rounds) kvc_copy_wait<KVC_WIDE_DEPTH - 1>(); else kvc_copy_wait<0>();
      __syncwarp();  // ... and every other lane's
      const ulonglong2* row = st.piece[c % KVC_WIDE_DEPTH][lane];
      const int m = n - c * KVC_WIDE_PIECES < KVC_WIDE_PIECES ? n - c * KVC_WIDE_PIECES : KVC_WIDE_PIECES;
      for (int j = 0; j < m; ++j) {
        const ulonglong2 w = row[j];
        h = kvc_sm(h ^ w.x);
        h = kvc_sm(h ^ w.y);
      }
      __syncwarp();  // every lane has read round c's buffer before it is refilled
      if (c + KVC_WIDE_DEPTH < rounds) issue(c + KVC_WIDE_DEPTH);
    }
    total = kvc_sm(total ^ h);
  }
  return own ? total : 0;
}
