// Shared device code: hashing (docs/format.md §3), ring records (§5) and the engine-batch reads of
// the plan builder and the fused verify (§8). Every constant comes from kvcanary_abi.cuh, generated
// from kvcanary/abi.py. Device code never raises and never synchronises with the host, and every
// index it reads from device memory is checked against sizes known at launch before it addresses
// memory: an index out of range becomes a ring row (or a counted skip), never an access.
#pragma once
#include "kvcanary_abi.cuh"

// Programmatic dependent launch (docs/performance.md): on sm_90+ the host may launch a kernel while
// the previous kernel of its stream is still running (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_
// SERIALIZATION), so its blocks are resident when that kernel ends. Every kernel's first statement
// is KVC_AFTER_PREVIOUS_GRID(): griddepcontrol.wait returns once the previous grid has completed and
// its memory operations are visible (at once for a kernel launched without the attribute), so no
// kernel reads or writes global memory before the work ahead of it in the stream is done. It then
// lets the next grid launch: that grid waits for this one's completion in turn.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= KVC_PDL_CUDA_ARCH
#define KVC_AFTER_PREVIOUS_GRID() \
  asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define KVC_AFTER_PREVIOUS_GRID() ((void)0)
#endif

__device__ __forceinline__ uint64_t kvc_sm(uint64_t x) {
  x ^= x >> KVC_SM_SHIFT1;
  x *= KVC_SM_MUL1;
  x ^= x >> KVC_SM_SHIFT2;
  x *= KVC_SM_MUL2;
  x ^= x >> KVC_SM_SHIFT3;
  return x;
}

__device__ __forceinline__ uint64_t kvc_mix3(uint64_t a, uint64_t b, uint64_t c) {
  return kvc_sm(kvc_sm(kvc_sm(a) ^ b) ^ c);
}

__device__ __forceinline__ long long kvc_clamp(long long v, long long lo, long long hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// Strip address of `slot` (0 <= slot < num_slots, which the sources cover) in source s (§4).
__device__ __forceinline__ const ulonglong2* kvc_strip(const KvcSourceDesc& s, long long slot) {
  const long long row = s.page_size == 1 ? slot : slot / s.page_size, col = slot - row * s.page_size;
  return reinterpret_cast<const ulonglong2*>(s.base + row * s.row_stride + col * (long long)s.bytes_per_token);
}

// Fingerprint of one source strip: h = sm(h ^ w) over little-endian 64-bit words, 16-byte loads,
// KVC_STRIP_BATCH loads (128 bytes) in flight before the first fold.
__device__ __forceinline__ uint64_t kvc_fold_strip(const KvcSourceDesc& s, long long slot) {
  const ulonglong2* p = kvc_strip(s, slot);
  const int n = s.hash_bytes / KVC_STRIP_PIECE_BYTES;
  uint64_t h = 0;
  int i = 0;
  for (; i + KVC_STRIP_BATCH <= n; i += KVC_STRIP_BATCH) {
    ulonglong2 v[KVC_STRIP_BATCH];
#pragma unroll
    for (int k = 0; k < KVC_STRIP_BATCH; ++k) v[k] = __ldg(p + i + k);
#pragma unroll
    for (int k = 0; k < KVC_STRIP_BATCH; ++k) {
      h = kvc_sm(h ^ v[k].x);
      h = kvc_sm(h ^ v[k].y);
    }
  }
  for (; i < n; ++i) {
    const ulonglong2 v = __ldg(p + i);
    h = kvc_sm(h ^ v.x);
    h = kvc_sm(h ^ v.y);
  }
  return h;
}

// Real-KV fingerprint of a slot over every configured source (0 with none).
template <class P>
__device__ __forceinline__ uint64_t kvc_fingerprint(const P& p, long long slot) {
  uint64_t total = 0;
  for (int i = 0; i < p.num_sources; ++i) total = kvc_sm(total ^ kvc_fold_strip(p.sources[i], slot));
  return total;
}

template <class P>
__device__ __forceinline__ const long long* kvc_slot(const P& p, long long slot) {
  return p.canary + slot * p.slot_stride_words;
}

// slot_hash of §3: the chain value a successor of `slot` expects (0 <= slot < num_slots).
template <class P>
__device__ __forceinline__ uint64_t kvc_slot_hash(const P& p, long long slot) {
  const long long* f = kvc_slot(p, slot);
  return kvc_mix3((uint64_t)f[KVC_FIELD_PREV_HASH], (uint64_t)f[KVC_FIELD_TOKEN],
                  (uint64_t)f[KVC_FIELD_POSITION]);
}

// Ring append (§5). Format v1 (ring_claim == 0): i = atomicAdd(write_index, 1), the row is kept
// iff i < capacity (fill once). With a 64-bit claim counter (the manager's status cell, whose low
// int32 is the v1 write index): row i is kept at i % capacity iff i - consumed < capacity, where
// the host advances `consumed` once it has taken the rows before it; with consumed = 0 that is
// fill once again. Rows not kept are counted by the claim, never stored over unread rows.
// `request`: the batch index the row is attributed to, KVC_NO_REQUEST for none (§5.7): its bits are
// ORed into that request's verdict word whether or not the row is kept, and a kept row's request
// is stored beside it.
template <class P>
__device__ __noinline__ void kvc_record(const P& p, long long request, long long slot, long long position,
                                        long long stored_token, long long expected_token,
                                        uint64_t stored_chain, uint64_t expected_aux, long long bits) {
  long long i, at = KVC_NO_RING_ROW;
  if (p.ring_claim != 0) {
    i = (long long)atomicAdd(p.ring_claim, 1ULL);
    const long long consumed = p.ring_consumed != 0 ? *p.ring_consumed : 0;
    if (i - consumed >= 0 && i - consumed < p.ring_capacity) at = i % p.ring_capacity;
  } else {
    i = atomicAdd(p.write_index, 1);
    if (i >= 0 && i < p.ring_capacity) at = i;
  }
  if (at >= 0) {
    long long* row = p.ring + at * KVC_RING_COLS;
    row[KVC_COL_KERNEL_KIND] = p.tag;
    row[KVC_COL_SLOT_IDX] = slot;
    row[KVC_COL_POSITION] = position;
    row[KVC_COL_STORED_TOKEN] = stored_token;
    row[KVC_COL_EXPECTED_TOKEN] = expected_token;
    row[KVC_COL_STORED_CHAIN_HASH] = (long long)stored_chain;
    row[KVC_COL_EXPECTED_AUX] = (long long)expected_aux;
    row[KVC_COL_FAIL_REASON_BITS] = bits;
    if (p.ring_requests != 0) p.ring_requests[at] = request;
  }
  if (p.verdicts != 0 && request >= 0 && request < p.verdict_len) {
    const unsigned long long before = atomicOr(p.verdicts + request, (unsigned long long)bits);
    if (before == 0ULL && p.failed_requests != 0) atomicAdd(p.failed_requests, 1ULL);
  }
  __threadfence_system();
}

// Request r's verdict word cleared for a new step (§5.7) with one atomic, keeping failed_requests
// the count of nonzero words: a word cleared from nonzero takes one off, as kvc_record adds one for
// a word it makes nonzero. So a launch may clear a word while other blocks record other requests.
// The count stays exact from any state in which it was (kvcanary's own arrays: zeroed at allocation,
// reset together by kvc_prepare, otherwise changed only by these two atomics).
template <class P>
__device__ __forceinline__ void kvc_verdict_clear(const P& p, long long r) {
  if (p.verdicts == 0 || r < 0 || r >= p.verdict_len) return;
  if (atomicExch(p.verdicts + r, 0ULL) != 0ULL && p.failed_requests != 0) atomicAdd(p.failed_requests, ~0ULL);
}

// A BATCH_INDEX_OUT_OF_RANGE row (abi.BatchField names the columns): slot KVC_NO_SLOT unless the
// value names one, the request's index in the batch (KVC_NO_REQUEST for the flat token arrays; the
// row is attributed to it), the value read, the field, the bound it broke.
template <class P>
__device__ __forceinline__ void kvc_record_batch(const P& p, long long slot, long long request, long long field,
                                                 long long value, long long bound) {
  kvc_record(p, request, slot, request, value, field, 0, (uint64_t)bound, KVC_BATCH_INDEX_OUT_OF_RANGE);
}

// Warp-aggregated add of per-lane counts (every lane of the warp must call it).
__device__ __forceinline__ void kvc_warp_count(unsigned long long* counter, unsigned n) {
  const unsigned total = __reduce_add_sync(KVC_FULL_MASK, n);
  if (counter != 0 && total != 0 && (threadIdx.x & 31) == 0) atomicAdd(counter, (unsigned long long)total);
}

// ---- the engine's batch (§8) ------------------------------------------------------------------
// Request r as read from the batch and checked against the launch's sizes. `field` != 0 names the
// first value out of range (abi.BatchField); such a request has no entries and stamps nothing,
// but a non-padding one still owns its extend_lens tokens, so later requests keep theirs.
struct KvcRequest {
  long long row;      // request-pool row (valid only when ok)
  long long lo;       // first verified position
  long long n;        // verified positions [lo, lo + n)
  long long prefix;   // cached tokens
  long long tokens;   // new tokens this request owns in the flat arrays
  long long field, value, bound;  // the first out-of-range value (field 0: none)
  bool ok;            // a real request whose values are all in range
};

template <class B>
__device__ __forceinline__ KvcRequest kvc_request(const B& b, long long r) {
  KvcRequest q;
  q.row = b.req_pool_indices[r];
  const long long prefix = b.prefix_lens[r], extend = b.extend_lens[r];
  q.field = 0;
  q.value = 0;
  q.bound = 0;
  if (q.row != 0 && (q.row < 0 || q.row >= b.rtt_rows)) {
    q.field = KVC_BATCH_REQ_POOL_INDEX; q.value = q.row; q.bound = b.rtt_rows;
  } else if (q.row != 0 && (prefix < 0 || prefix > b.rtt_max_len)) {
    q.field = KVC_BATCH_PREFIX_LEN; q.value = prefix; q.bound = b.rtt_max_len;
  } else if (q.row != 0 && extend < 0) {
    q.field = KVC_BATCH_EXTEND_LEN; q.value = extend; q.bound = 0;
  }
  q.ok = q.row != 0 && q.field == 0;
  q.prefix = q.ok ? prefix : 0;
  // at most INT32_MAX each: sums over the batch never wrap (a larger extend is TOKENS_SHORT anyway)
  q.tokens = (q.row != 0 && extend > 0) ? (extend < KVC_MAX_REQUEST_TOKENS ? extend : KVC_MAX_REQUEST_TOKENS) : 0;
  q.lo = (q.ok && b.swa_window > 0 && prefix > b.swa_window) ? prefix - b.swa_window : 0;
  q.n = q.prefix - q.lo;
  return q;
}

// The group's slot of a full-pool slot: itself, or its full->SWA map entry (KVC_SWA_UNMAPPED for
// a full slot outside the map).
template <class B>
__device__ __forceinline__ long long kvc_map_slot(const B& b, long long full_slot) {
  if (b.swa_map == 0) return full_slot;
  return (full_slot >= 0 && full_slot < b.swa_map_len) ? b.swa_map[full_slot] : KVC_SWA_UNMAPPED;
}

// req_to_token[row, pos] of a request whose row and position were checked.
template <class B>
__device__ __forceinline__ long long kvc_rtt(const B& b, long long row, long long pos) {
  return (long long)b.req_to_token[row * b.rtt_row_stride + pos];
}

// Expected token of request r's entry at `pos` (§8), -1 when there is none. Rows are checked
// (row < rtt_rows <= the pool's rows, which the host checks); `at` against the valid length.
template <class B>
__device__ __forceinline__ long long kvc_expected_token(const B& b, long long r, long long row, long long pos) {
  if (b.expected_pool == 0) return KVC_NO_EXPECTED_TOKEN;
  const long long at = pos + b.expected_token_offset;
  long long valid = b.expected_valid_lens != 0 ? b.expected_valid_lens[r] : b.expected_pool_len;
  if (valid > b.expected_pool_len) valid = b.expected_pool_len;
  return (at >= 0 && at < valid) ? b.expected_pool[row * b.expected_row_stride + at] : KVC_NO_EXPECTED_TOKEN;
}

// Request owning flat entry e among requests [lo, hi): the last r with offsets[r] <= e, for
// non-decreasing entry offsets. Offsets are device data: whatever they hold, the answer is in
// [lo, hi), and the caller checks that e really lies in that request's range.
__device__ __forceinline__ long long kvc_owner_in(const long long* offsets, long long e, long long lo, long long hi) {
  while (hi - lo > 1) {
    const long long mid = (lo + hi) >> 1;
    if (offsets[mid] <= e) lo = mid; else hi = mid;
  }
  return lo;
}

template <class B>
__device__ __forceinline__ long long kvc_owner(const B& b, long long e) {
  return kvc_owner_in(b.entry_offsets, e, 0, b.batch_size);
}

// One verify entry as a materialised plan stores it (§8) and the checks of §6 read it: `live` is
// false for an entry the launch must not verify (past the plan, or not an entry of its request in
// the batch this launch was given).
struct KvcEntry {
  long long slot, prev, expected_token, position;
  bool live;
};

// Entry e (owned by request r per the plan's entry offsets) derived from the batch: what
// kvc_expand stores and the fused verify checks. A required predecessor (inside the verified
// range) on the padding slot becomes KVC_PREV_ON_PADDING; a map value that collides with that
// marker becomes KVC_SWA_UNMAPPED (out of range). Nothing is read for an entry that is not live.
template <class B>
__device__ __forceinline__ KvcEntry kvc_fused_entry(const B& b, long long e, long long r) {
  const KvcRequest q = kvc_request(b, r);
  const long long k = e - b.entry_offsets[r];
  KvcEntry x;
  x.live = q.ok && k >= 0 && k < q.n;
  x.position = q.lo + (x.live ? k : 0);
  x.slot = x.live ? kvc_map_slot(b, kvc_rtt(b, q.row, x.position)) : KVC_SWA_UNMAPPED;
  x.prev = KVC_CHAIN_HEAD;
  if (x.live && x.position > 0) {
    x.prev = kvc_map_slot(b, kvc_rtt(b, q.row, x.position - 1));
    if (x.prev == KVC_PREV_ON_PADDING) x.prev = KVC_SWA_UNMAPPED;
    if (k > 0 && x.prev == KVC_PADDING_SLOT) x.prev = KVC_PREV_ON_PADDING;
  }
  x.expected_token = x.live ? kvc_expected_token(b, r, q.row, x.position) : KVC_NO_EXPECTED_TOKEN;
  return x;
}

// ---- the pump's snapshot (docs/format.md §10) ----------------------------------------------------
// The status block into the snapshot's FIFO slot of mapped pinned memory, then the slot's ticket
// into its completion word (every thread of one block). Every thread stores its part of the payload
// and fences at system scope; after the barrier thread 0 fences again and only then stores the
// ticket, so a host that reads *done == ticket reads the complete payload. The verdict cells past
// `head` are copied only when the step failed a request (cell head != 0, §5.7).
__device__ __forceinline__ void kvc_snapshot_copy(const KvcSnapshotParams& p) {
  const volatile long long* src = p.status;  // written by this stream's earlier launches
  volatile long long* dst = p.payload;
  const long long n = (p.head >= 0 && p.head < p.n && src[p.head] == 0) ? p.head + 1 : p.n;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    *reinterpret_cast<volatile long long*>(p.done) = p.ticket;
  }
}

// The snapshot folded into a step's last launch (p.done == 0: none this launch, e.g. one captured
// into a graph). Each block arrives on p.arrive once its work is done, its stores and atomics fenced
// first; the last block to arrive fences again, clears the counter for the next launch of this
// FIFO slot and takes the snapshot, which so covers every block of this launch and every launch
// before it in the stream. No block waits for another. Every thread of every block must call it.
__device__ __forceinline__ void kvc_step_end(const KvcSnapshotParams& p) {
  if (p.done == 0 || p.arrive == 0) return;
  __shared__ int kvc_last_block;
  __syncthreads();  // this block's work is done
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned long long blocks = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
    kvc_last_block = atomicAdd(p.arrive, 1ULL) + 1ULL == blocks;
  }
  __syncthreads();
  if (!kvc_last_block) return;
  __threadfence();
  if (threadIdx.x == 0) *p.arrive = 0ULL;
  kvc_snapshot_copy(p);
}
