// One step of vLLM attention metadata staged into a Batch's persistent buffers
// (kvcanary.adapters.vllm_stage; the values of kvcanary.adapters.vllm.vllm_batch): request-pool
// rows r + 1, extend = query_start_loc[r + 1] - query_start_loc[r], prefix = seq_lens[r] - extend,
// req_to_token row r + 1 = block_table[r][p / block_size] * block_size + p % block_size for
// p < seq_lens[r] and 0 past it (row 0 all 0; the slot truncated to int32 as the adapter's cast
// does), and the tokens' ids, positions and slots widened to int64.
//
// The host checked every extent it reads: num_reqs rows of the block table (max_len <= its
// max_blocks * block_size), num_reqs + 1 query starts, num_tokens of each token array. Values are
// not checked: a wrong length or block id becomes a wrong slot or length in the Batch, which the
// plan and verify kernels bound-check and report. Grid-stride, any grid; never raises, never waits.
#include "common.cuh"

__device__ __forceinline__ long long kvc_stage_load(const void* base, long long i, int wide, int which) {
  return (wide >> which) & 1 ? static_cast<const long long*>(base)[i] : (long long)static_cast<const int*>(base)[i];
}

extern "C" __global__ void __launch_bounds__(KVC_BLOCK_THREADS) kvc_stage_vllm(const __grid_constant__ KvcStageVllmParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  const long long stride = (long long)gridDim.x * blockDim.x, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long r = first; r < p.num_reqs; r += stride) {
    const long long q0 = kvc_stage_load(p.query_start_loc, r, p.wide, KVC_STAGE_QUERY_START_LOC);
    const long long q1 = kvc_stage_load(p.query_start_loc, r + 1, p.wide, KVC_STAGE_QUERY_START_LOC);
    const long long seq = kvc_stage_load(p.seq_lens, r, p.wide, KVC_STAGE_SEQ_LENS);
    p.rows[r] = r + 1;
    p.extend_lens[r] = q1 - q0;
    p.prefix_lens[r] = seq - (q1 - q0);
  }
  for (long long i = first; i < p.num_tokens; i += stride) {
    p.out_input_ids[i] = kvc_stage_load(p.input_ids, i, p.wide, KVC_STAGE_INPUT_IDS);
    p.out_positions[i] = kvc_stage_load(p.positions, i, p.wide, KVC_STAGE_POSITIONS);
    p.out_cache_loc[i] = kvc_stage_load(p.slot_mapping, i, p.wide, KVC_STAGE_SLOT_MAPPING);
  }
  const long long cells = (p.num_reqs + 1) * p.max_len;
  for (long long c = first; c < cells; c += stride) {
    const long long row = c / p.max_len, pos = c - row * p.max_len;
    long long slot = 0;
    if (row > 0 && pos < kvc_stage_load(p.seq_lens, row - 1, p.wide, KVC_STAGE_SEQ_LENS)) {
      const long long blk = pos / p.block_size;
      slot = kvc_stage_load(p.block_table, (row - 1) * p.block_table_stride + blk, p.wide, KVC_STAGE_BLOCK_TABLE)
             * p.block_size + (pos - blk * p.block_size);
    }
    p.req_to_token[c] = (int)slot;
  }
}
