// Shared device code: hashing (SPEC §3), the real-KV fingerprint, ring records (SPEC §5) and the
// engine-batch helpers of the plan builder (SPEC §8). Every constant comes from kvcanary_abi.cuh,
// generated from kvcanary/abi.py. Device code never raises and never synchronises with the host.
#pragma once
#include "kvcanary_abi.cuh"

#define KVC_FULL_MASK 0xffffffffu

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

// Hint: bring the 32-byte sector at `p` into L2 (no register, no wait). The CPU emulator of the
// tests has no cache: a no-op there.
__device__ __forceinline__ void kvc_prefetch_l2(const void* p) {
#ifndef KVC_EMULATED
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// Strip address of `slot` in source s (SPEC §4).
__device__ __forceinline__ const ulonglong2* kvc_strip(const KvcSourceDesc& s, long long slot) {
  const long long row = s.page_size == 1 ? slot : slot / s.page_size, col = slot - row * s.page_size;
  return reinterpret_cast<const ulonglong2*>(s.base + row * s.row_stride + col * (long long)s.bytes_per_token);
}

// Fingerprint of one source strip: h = sm(h ^ w) over little-endian 64-bit words, 16-byte loads,
// eight loads (128 bytes) in flight before the first fold.
__device__ __forceinline__ uint64_t kvc_fold_strip(const KvcSourceDesc& s, long long slot) {
  const ulonglong2* p = kvc_strip(s, slot);
  const int n = s.hash_bytes >> 4;
  uint64_t h = 0;
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    ulonglong2 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __ldg(p + i + k);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
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

// slot_hash of SPEC §3: the chain value a successor of `slot` expects (slot >= 0, in range).
template <class P>
__device__ __forceinline__ uint64_t kvc_slot_hash(const P& p, long long slot) {
  const long long* f = kvc_slot(p, slot);
  return kvc_mix3((uint64_t)f[KVC_FIELD_PREV_HASH], (uint64_t)f[KVC_FIELD_TOKEN],
                  (uint64_t)f[KVC_FIELD_POSITION]);
}

// Fill-once ring append (SPEC §5): rows past capacity are counted, never stored.
template <class P>
__device__ __noinline__ void kvc_record(const P& p, long long slot, long long position,
                                        long long stored_token, long long expected_token,
                                        uint64_t stored_chain, uint64_t expected_aux, long long bits) {
  const int i = atomicAdd(p.write_index, 1);
  if (i >= 0 && i < p.ring_capacity) {
    long long* row = p.ring + (long long)i * KVC_RING_COLS;
    row[KVC_COL_KERNEL_KIND] = p.tag;
    row[KVC_COL_SLOT_IDX] = slot;
    row[KVC_COL_POSITION] = position;
    row[KVC_COL_STORED_TOKEN] = stored_token;
    row[KVC_COL_EXPECTED_TOKEN] = expected_token;
    row[KVC_COL_STORED_CHAIN_HASH] = (long long)stored_chain;
    row[KVC_COL_EXPECTED_AUX] = (long long)expected_aux;
    row[KVC_COL_FAIL_REASON_BITS] = bits;
  }
  __threadfence_system();
}

// Verify one plan entry (SPEC §6 step 2-3).
template <class P>
__device__ __forceinline__ void kvc_verify_entry(const P& p, long long slot, long long expected_token,
                                                 long long expected_position, long long prev_slot,
                                                 bool check_expected_token) {
  if (slot == KVC_PADDING_SLOT) return;
  if (slot < 0 || slot >= p.num_slots) {
    kvc_record(p, slot, expected_position, 0, KVC_NO_EXPECTED_TOKEN, 0, 0, KVC_SLOT_OUT_OF_RANGE);
    return;
  }
  const long long* f = kvc_slot(p, slot);
  const long long token = f[KVC_FIELD_TOKEN], position = f[KVC_FIELD_POSITION];
  const uint64_t prev_hash = (uint64_t)f[KVC_FIELD_PREV_HASH], rkv = (uint64_t)f[KVC_FIELD_REAL_KV_HASH];
  long long bits = 0;
  uint64_t expected_chain = prev_hash;
  if (prev_slot < 0) {
    expected_chain = kvc_sm(KVC_ANCHOR);
  } else if (prev_slot >= p.num_slots) {
    expected_chain = 0;
    bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH | KVC_SLOT_OUT_OF_RANGE;
  } else if (prev_slot != KVC_PADDING_SLOT) {
    expected_chain = kvc_slot_hash(p, prev_slot);
  }
  if (prev_hash != expected_chain) bits |= KVC_VERIFY_CHAIN_HASH_MISMATCH;
  if (position != expected_position) bits |= KVC_VERIFY_POSITION_MISMATCH;
  if (rkv != kvc_fingerprint(p, slot)) bits |= KVC_VERIFY_REAL_KV_HASH_MISMATCH;
  if (check_expected_token && expected_token != KVC_NO_EXPECTED_TOKEN && token != expected_token)
    bits |= KVC_VERIFY_TOKEN_MISMATCH;
  if (bits)
    kvc_record(p, slot, position, token, check_expected_token ? expected_token : KVC_NO_EXPECTED_TOKEN,
               prev_hash, expected_chain, bits);
}

// ---- the engine's batch (SPEC §8) ------------------------------------------------------------
struct KvcRequest {
  long long row;      // request-pool row; padding requests have no entries
  long long lo;       // first verified position
  long long prefix;   // verified positions are [lo, prefix)
  long long extend;   // tokens written this step
  bool padding;
};

template <class B>
__device__ __forceinline__ KvcRequest kvc_request(const B& b, long long r) {
  KvcRequest q;
  q.row = b.req_pool_indices[r];
  q.padding = q.row <= 0 || q.row >= b.rtt_rows;
  q.prefix = q.padding ? 0 : kvc_clamp(b.prefix_lens[r], 0, b.rtt_max_len);
  q.extend = q.padding ? 0 : (b.extend_lens[r] > 0 ? b.extend_lens[r] : 0);
  q.lo = (b.swa_window > 0 && q.prefix > b.swa_window) ? q.prefix - b.swa_window : 0;
  return q;
}

template <class B>
__device__ __forceinline__ long long kvc_map_slot(const B& b, long long full_slot) {
  if (b.swa_map == 0) return full_slot;
  return (full_slot >= 0 && full_slot < b.swa_map_len) ? b.swa_map[full_slot] : -2;
}

template <class B>
__device__ __forceinline__ long long kvc_rtt(const B& b, long long row, long long pos) {
  return (long long)b.req_to_token[row * b.rtt_row_stride + pos];
}

// Expected token of request r's entry at `pos` (SPEC §8), -1 when there is none.
template <class B>
__device__ __forceinline__ long long kvc_expected_token(const B& b, long long r, const KvcRequest& q,
                                                        long long pos) {
  if (b.expected_pool == 0) return KVC_NO_EXPECTED_TOKEN;
  const long long at = pos + b.expected_token_offset;
  long long valid = b.expected_valid_lens != 0 ? b.expected_valid_lens[r] : b.expected_pool_len;
  if (valid > b.expected_pool_len) valid = b.expected_pool_len;
  return (at >= 0 && at < valid) ? b.expected_pool[q.row * b.expected_row_stride + at] : KVC_NO_EXPECTED_TOKEN;
}

// Slot, predecessor and expected token of request r's entry at `pos`.
template <class B>
__device__ __forceinline__ void kvc_entry(const B& b, long long r, const KvcRequest& q, long long pos,
                                          long long* slot, long long* prev, long long* expected_token) {
  *slot = kvc_map_slot(b, kvc_rtt(b, q.row, pos));
  *prev = pos > 0 ? kvc_map_slot(b, kvc_rtt(b, q.row, pos - 1)) : KVC_CHAIN_HEAD;
  *expected_token = kvc_expected_token(b, r, q, pos);
}

// Request owning flat entry e among requests [lo, hi): the last r with entry_offsets[r] <= e
// (offsets are non-decreasing and entry_offsets[lo] <= e).
template <class B>
__device__ __forceinline__ long long kvc_owner_in(const B& b, long long e, long long lo, long long hi) {
  while (hi - lo > 1) {
    const long long mid = (lo + hi) >> 1;
    if (b.entry_offsets[mid] <= e) lo = mid; else hi = mid;
  }
  return lo;
}

template <class B>
__device__ __forceinline__ long long kvc_owner(const B& b, long long e) {
  return kvc_owner_in(b, e, 0, b.batch_size);
}
