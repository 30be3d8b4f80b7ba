// An engine's step staged into a Batch's persistent buffers, one launch instead of an adapter's
// framework ops: kvc_stage_vllm (below), kvc_stage_paged and kvc_stage_sglang (at the end).
//
// kvc_stage_vllm: one step of vLLM attention metadata (kvcanary.adapters.vllm_stager.VllmBatchStager; the
// values of kvcanary.adapters.vllm.vllm_batch): request-pool rows r + 1, extend =
// query_start_loc[r + 1] - query_start_loc[r], prefix = seq_lens[r] - extend, req_to_token row r + 1 = block_table[r][p / block_size] * block_size + p % block_size for
// p < seq_lens[r] and 0 past it (row 0 all 0; the slot truncated to int32 as the adapter's cast
// does), and the tokens' ids, positions and slots widened to int64.
//
// The host checked every extent it reads: num_reqs rows of the block table (max_len <= its
// max_blocks * block_size), num_reqs + 1 query starts, num_tokens of each token array. Values are
// not checked: a wrong length or block id becomes a wrong slot or length in the Batch, which the
// plan and verify kernels bound-check and report. Grid-stride, any grid; never raises, never waits.
#include "common.cuh"

// a - b wrapping at 64 bits, as the int64 framework ops do (signed overflow is undefined in C++)
__device__ __forceinline__ long long kvc_sub_wrap(long long a, long long b) {
  return (long long)((unsigned long long)a - (unsigned long long)b);
}

__device__ __forceinline__ long long kvc_stage_load(const void* base, long long i, int wide, int which) {
  return (wide >> which) & 1 ? static_cast<const long long*>(base)[i] : (long long)static_cast<const int*>(base)[i];
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS) kvc_stage_vllm(const __grid_constant__ KvcStageVllmParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  const long long stride = (long long)gridDim.x * blockDim.x, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long r = first; r < p.num_reqs; r += stride) {
    const long long q0 = kvc_stage_load(p.query_start_loc, r, p.wide, KVC_STAGE_VLLM_QUERY_START_LOC);
    const long long q1 = kvc_stage_load(p.query_start_loc, r + 1, p.wide, KVC_STAGE_VLLM_QUERY_START_LOC);
    const long long seq = kvc_stage_load(p.seq_lens, r, p.wide, KVC_STAGE_VLLM_SEQ_LENS);
    p.rows[r] = r + 1;
    p.extend_lens[r] = kvc_sub_wrap(q1, q0);
    p.prefix_lens[r] = kvc_sub_wrap(seq, kvc_sub_wrap(q1, q0));
  }
  for (long long i = first; i < p.num_tokens; i += stride) {
    p.out_input_ids[i] = kvc_stage_load(p.input_ids, i, p.wide, KVC_STAGE_VLLM_INPUT_IDS);
    p.out_positions[i] = kvc_stage_load(p.positions, i, p.wide, KVC_STAGE_VLLM_POSITIONS);
    p.out_cache_loc[i] = kvc_stage_load(p.slot_mapping, i, p.wide, KVC_STAGE_VLLM_SLOT_MAPPING);
  }
  const long long cells = (p.num_reqs + 1) * p.max_len;
  for (long long c = first; c < cells; c += stride) {
    const long long row = c / p.max_len, pos = c - row * p.max_len;
    long long slot = 0;
    if (row > 0 && pos < kvc_stage_load(p.seq_lens, row - 1, p.wide, KVC_STAGE_VLLM_SEQ_LENS)) {
      const long long blk = pos / p.block_size;
      const long long id = kvc_stage_load(p.block_table, (row - 1) * p.block_table_stride + blk, p.wide,
                                          KVC_STAGE_VLLM_BLOCK_TABLE);  // any value: wraps as the int64 ops do
      slot = (long long)((unsigned long long)id * (unsigned long long)p.block_size + (unsigned long long)(pos - blk * p.block_size));
    }
    p.req_to_token[c] = (int)slot;
  }
}

// Canary slot of physical cache index p (kvcanary.adapters.transformers_layout.PagedLayout.to_slots):
// block p / block_stride (floor), token p mod block_stride (non-negative) of its page; an index
// that names no token (negative, an offset past the page, a slot past the buffer) is num_slots.
__device__ __forceinline__ long long kvc_stage_slot(const KvcStagePagedParams& p, long long index) {
  long long block = index / p.block_stride, offset = index % p.block_stride;
  if (offset < 0) {  // floor division
    offset += p.block_stride;
    --block;
  }
  const long long slot = (long long)((unsigned long long)block * (unsigned long long)p.page_size
                                     + (unsigned long long)offset);  // wraps as torch's int64 ops do
  return (index < 0 || offset >= p.page_size || slot >= p.num_slots) ? p.num_slots : slot;
}

// Physical cache index of position pos of request r in a decode-fast-path block table, whose entries
// name pages (block * pages per block): entry * page_size + pos mod page_size; KVC_STAGE_NO_INDEX (no token)
// for a position outside the table's columns.
__device__ __forceinline__ long long kvc_stage_table_index(const KvcStagePagedParams& p, long long r, long long pos) {
  if (pos < 0 || pos / p.page_size >= p.table_cols) return KVC_STAGE_NO_INDEX;
  const long long blk = pos / p.page_size;
  const long long entry = kvc_stage_load(p.block_table, r * p.table_stride + blk, p.wide, KVC_STAGE_PAGED_BLOCK_TABLE);
  return (long long)((unsigned long long)entry * (unsigned long long)p.page_size
                     + (unsigned long long)(pos - blk * p.page_size));  // wraps as the int64 ops do
}

// r = #{ m in [1, n] : cum[m] <= j } (binary search; cum is cu_q or cu_k), at most n - 1.
__device__ __forceinline__ long long kvc_stage_request(const void* cum, int which, const KvcStagePagedParams& p,
                                                       long long j) {
  long long lo = 0, hi = p.num_reqs;
  while (lo < hi) {
    const long long mid = (lo + hi) / 2;
    if (kvc_stage_load(cum, mid + 1, p.wide, which) <= j) lo = mid + 1;
    else hi = mid;
  }
  return lo < p.num_reqs - 1 ? lo : p.num_reqs - 1;
}

// One step of a paged engine given as cumulative query / key lengths and physical indices
// (transformers continuous batching; the values of kvcanary.adapters.transformers_batch's torch
// path): rows r + 1, extend = cu_q[r + 1] - cu_q[r], prefix = cu_k[r + 1] - cu_k[r] - extend, the
// tokens' ids (async batching's carried-over ones taken from the previous batch's output, as the
// forward's first op takes them; a negative expected id becomes the token) and positions widened, and
// - without a block table: out_cache_loc[i] the slot of write_index[i], and read index j <
//   cu_k[n] scattered into req_to_token row r + 1, column j - cu_k[r], where r =
//   kvc_stage_request(cu_k, j) and the column is clamped into the row;
// - with one (the decode fast path, where the kernel reads and writes the cache through it):
//   req_to_token row r + 1, column c < cu_k[r + 1] - cu_k[r] (and < rtt_cols) the slot of position c
//   of request r, and out_cache_loc[i] the slot of position prefix + i - cu_q[r] of request r =
//   kvc_stage_request(cu_q, i).
// Tokens past cu_q[n] are the padding of a static-shape batch (CUDA graphs, torch.compile): their
// slot is KVC_SKIP_SLOT, and read indices past cu_k[n] (padding reads) are not scattered. Wrong
// lengths become wrong slots, never an access outside the map. Grid-stride, any grid; never
// raises, never waits.
extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS) kvc_stage_paged(const __grid_constant__ KvcStagePagedParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  const long long stride = (long long)gridDim.x * blockDim.x, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long r = first; r < p.num_reqs; r += stride) {
    const long long q = kvc_sub_wrap(kvc_stage_load(p.cu_q, r + 1, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_Q),
                                     kvc_stage_load(p.cu_q, r, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_Q));
    const long long k = kvc_sub_wrap(kvc_stage_load(p.cu_k, r + 1, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_K),
                                     kvc_stage_load(p.cu_k, r, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_K));
    p.rows[r] = r + 1;
    p.extend_lens[r] = q;
    p.prefix_lens[r] = kvc_sub_wrap(k, q);
  }
  for (long long i = first; i < p.num_tokens; i += stride) {
    long long id = kvc_stage_load(p.input_ids, i, p.wide, KVC_STAGE_PAGED_INPUT_IDS);
    if (p.carry_ids != nullptr) {
      const long long c = kvc_stage_load(p.carry_ids, i, p.wide, KVC_STAGE_PAGED_CARRY_OVER_IDS);
      if (c >= 0 && c < p.prev_len) id = kvc_stage_load(p.prev_output, c, p.wide, KVC_STAGE_PAGED_PREV_OUTPUT_IDS);
    }
    p.out_input_ids[i] = id;
    p.out_positions[i] = kvc_stage_load(p.positions, i, p.wide, KVC_STAGE_PAGED_POSITION_IDS);
    if (p.expected_ids != nullptr && p.expected_ids[i] < 0) p.expected_ids[i] = id;
  }
  const long long n = p.num_reqs;
  const long long total_q = n > 0 ? kvc_stage_load(p.cu_q, n, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_Q) : 0;
  const long long total_k = n > 0 ? kvc_stage_load(p.cu_k, n, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_K) : 0;
  for (long long i = first; i < p.num_write; i += stride) {
    long long slot = KVC_SKIP_SLOT;
    if (i < total_q) {
      if (p.block_table == nullptr) {
        slot = kvc_stage_slot(p, kvc_stage_load(p.write_index, i, p.wide, KVC_STAGE_PAGED_WRITE_INDEX));
      } else {
        const long long r = kvc_stage_request(p.cu_q, KVC_STAGE_PAGED_CU_SEQ_LENS_Q, p, i);
        const long long q0 = kvc_stage_load(p.cu_q, r, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_Q);
        const long long q1 = kvc_stage_load(p.cu_q, r + 1, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_Q);
        const long long k0 = kvc_stage_load(p.cu_k, r, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_K);
        const long long k1 = kvc_stage_load(p.cu_k, r + 1, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_K);
        const long long pos = kvc_sub_wrap(kvc_sub_wrap(k1, k0), kvc_sub_wrap(q1, q0)) + kvc_sub_wrap(i, q0);
        slot = kvc_stage_slot(p, kvc_stage_table_index(p, r, pos));
      }
    }
    p.out_cache_loc[i] = slot;
  }
  if (n <= 0) return;
  if (p.block_table != nullptr) {
    const long long cells = n * p.rtt_cols;
    for (long long c = first; c < cells; c += stride) {
      const long long r = c / p.rtt_cols, col = c - r * p.rtt_cols;
      const long long len = kvc_sub_wrap(kvc_stage_load(p.cu_k, r + 1, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_K),
                                         kvc_stage_load(p.cu_k, r, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_K));
      if (col < len) p.req_to_token[(r + 1) * p.rtt_cols + col] = (int)kvc_stage_slot(p, kvc_stage_table_index(p, r, col));
    }
    return;
  }
  const long long reads = total_k < p.num_read ? total_k : p.num_read;
  for (long long j = first; j < reads; j += stride) {
    const long long r = kvc_stage_request(p.cu_k, KVC_STAGE_PAGED_CU_SEQ_LENS_K, p, j);
    const long long col = kvc_clamp(kvc_sub_wrap(j, kvc_stage_load(p.cu_k, r, p.wide, KVC_STAGE_PAGED_CU_SEQ_LENS_K)), 0, p.rtt_cols - 1);
    p.req_to_token[(r + 1) * p.rtt_cols + col] = (int)kvc_stage_slot(p, kvc_stage_load(p.read_index, j, p.wide, KVC_STAGE_PAGED_READ_INDEX));
  }
}

// kvc_stage_sglang: one SGLang ForwardBatch (kvcanary.adapters.sglang_stager.SglangBatchStager; the
// values of kvcanary.adapters.sglang_batch): request-pool rows req_pool_indices[r], extend =
// extend_seq_lens[r] (or uniform_extend when that array is NULL: 1 for DECODE, draft_token_num for
// TARGET_VERIFY), prefix = extend_prefix_lens[r] (or seq_lens[r] - extend when seq_lens counts the
// step's new tokens, seq_lens[r] when it does not), and the tokens' ids, positions and slots widened
// to int64. The host checked every extent it reads; values are not checked (a wrong length or row
// is reported by the plan kernel). Grid-stride, any grid; never raises, never waits.
extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS) kvc_stage_sglang(const __grid_constant__ KvcStageSglangParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  const long long stride = (long long)gridDim.x * blockDim.x, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long r = first; r < p.num_reqs; r += stride) {
    const long long ext = p.extend_seq_lens != nullptr
        ? kvc_stage_load(p.extend_seq_lens, r, p.wide, KVC_STAGE_SGLANG_EXTEND_SEQ_LENS) : p.uniform_extend;
    const long long seq = kvc_stage_load(p.seq_lens, r, p.wide, KVC_STAGE_SGLANG_SEQ_LENS);
    p.rows[r] = kvc_stage_load(p.req_pool_indices, r, p.wide, KVC_STAGE_SGLANG_REQ_POOL_INDICES);
    p.extend_lens[r] = ext;
    p.prefix_lens[r] = p.extend_prefix_lens != nullptr
        ? kvc_stage_load(p.extend_prefix_lens, r, p.wide, KVC_STAGE_SGLANG_EXTEND_PREFIX_LENS)
        : (p.seq_includes_new ? kvc_sub_wrap(seq, ext) : seq);
  }
  for (long long i = first; i < p.num_tokens; i += stride) {
    p.out_input_ids[i] = kvc_stage_load(p.input_ids, i, p.wide, KVC_STAGE_SGLANG_INPUT_IDS);
    p.out_positions[i] = kvc_stage_load(p.positions, i, p.wide, KVC_STAGE_SGLANG_POSITIONS);
    p.out_loc[i] = kvc_stage_load(p.out_cache_loc, i, p.wide, KVC_STAGE_SGLANG_OUT_CACHE_LOC);
  }
}
