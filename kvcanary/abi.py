"""The ABI shared by Python and the CUDA kernels, declared once.

Every constant, enum and params-struct layout the device code uses lives here. From these tables
come (1) the ctypes structs the launcher fills and (2) the C++ prelude handed to NVRTC as an
in-memory header, which ``static_assert``s every struct's size and every field's offset, so a
layout drift fails the compile on a CPU-only machine. No kvcanary number is typed into a ``.cu``
file. This module imports nothing from CUDA.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass
from dataclasses import field as dataclass_field

FORMAT_VERSION = 1

# ---- canary buffer (docs/format.md §2) -------------------------------------------------------------------
SLOT_BYTES = 32
FIELD_TOKEN = 0
FIELD_POSITION = 1
FIELD_PREV_HASH = 2
FIELD_REAL_KV_HASH = 3
FIELDS_PER_SLOT = 4
PADDING_SLOT = 0

# ---- hashing (docs/format.md §3) ----------------------------------------------------------------------------
ANCHOR = 0xC0FFEE1234567890
SM_MUL1 = 0xBF58476D1CE4E5B9
SM_MUL2 = 0x94D049BB133111EB
SM_SHIFT1, SM_SHIFT2, SM_SHIFT3 = 30, 27, 31
PARTIAL_HASH_BYTES = 16
REAL_KV_ALIGN = 16

# ---- violation ring (docs/format.md §5) ----------------------------------------------------------------------
RING_COLS = 8
COL_KERNEL_KIND = 0
COL_SLOT_IDX = 1
COL_POSITION = 2
COL_STORED_TOKEN = 3
COL_EXPECTED_TOKEN = 4
COL_STORED_CHAIN_HASH = 5
COL_EXPECTED_AUX = 6
COL_FAIL_REASON_BITS = 7
DEFAULT_RING_CAPACITY = 4096

MAX_REAL_KV_SOURCES = 64
WORD_BYTES = 8               # an int64 word: a record field, a ring column, a status cell, a plan entry
WARP_SIZE = 32               # threads of a warp (the kernels' warp tiles; CUDA's, on every supported arch)

# Launch shapes the kernels are written for (ops launches exactly these; the kernels size shared
# memory and split warps by them).
BLOCK_THREADS = 256          # verify, write and expand blocks
PREPARE_THREADS = 1024       # the one block of kvc_prepare
WIDE_VERIFY_THREADS = 128    # blocks of the warp-cooperative *_wide verify kernels
VERIFY_LANE_ENTRIES = 2      # entries per lane in a warp tile of the narrow verify kernels (no fingerprint)
HASHED_LANE_ENTRIES = 1      # the same when they fingerprint real KV (a lane's strips keep its loads in flight)
VERIFY_MIN_BLOCKS = 4        # blocks per SM the narrow verify kernels are compiled for (64 registers)
MANY_SOURCES = 4             # sources (short strips) from which the *_many verifies batch their loads
SOURCE_BATCH = 8             # sources whose first pieces a *_many verify loads before folding any
MANY_VERIFY_MIN_BLOCKS = 2   # blocks per SM the *_many verifies are compiled for (the batch's registers)
MANY_SPREAD_TILES = 4        # most warp tiles a block of a *_many fused verify spreads its warps over at once
MANY_SPREAD_STRIPS = 64      # (tile, source) strip folds its shared memory holds: tiles x sources <= this
WIDE_HASH_BYTES = 64         # a source fingerprinting this many bytes per slot selects the *_wide verifies
STRIP_PIECE_BYTES = 16       # fingerprints load strips in 16-byte pieces (hash_bytes is a multiple)
STRIP_BATCH = 8              # pieces of one strip kvc_fold_strip loads before folding any (128 bytes in flight)
WIDE_PIECES = 8              # pieces of each strip a *_wide verify stages per round: a 128-byte line
WIDE_DEPTH = 2               # rounds in flight per warp of a *_wide verify (kvc_fingerprint_warp's waits assume 2)
PDL_CUDA_ARCH = 900          # first __CUDA_ARCH__ (sm_90) with programmatic dependent launch (griddepcontrol)
MIN_ARCH = 80                # the oldest arch the kernels build and run on (sm_80's warp reductions, e.g. __reduce_add_sync)
FULL_MASK = 0xFFFFFFFF       # every lane of a warp (CUDA's 32): the mask of the *_sync warp intrinsics
NO_EXPECTED_TOKEN = -1
CHAIN_HEAD = -1
SWA_UNMAPPED = -2            # a full-pool slot outside the full->SWA map (never a valid SWA slot)
PREV_ON_PADDING = -3         # plan prev_slot: a required predecessor is the padding slot 0 (reported)
NO_SLOT = -1                 # SLOT_IDX of a BATCH_INDEX_OUT_OF_RANGE row whose value names no slot
NO_REQUEST = -1              # POSITION of a BATCH_INDEX_OUT_OF_RANGE row of a TOKENS_* field (no one request)
NO_POSITION = -1             # POSITION of a write's SLOT_OUT_OF_RANGE row for a seed outside the buffer
SKIP_SLOT = -1               # a write entry's slot that stamps nothing (any negative; engines pad with -1)
NO_RING_ROW = -1             # device-internal: kvc_record's ring index of a row not kept (its claim still counts)
PLAN_DISABLED = -1           # device-internal: kvc_verify_begin's entry count of a disabled plan (any negative)
STAGE_NO_INDEX = -1          # device-internal: stage.cu's physical index of a position outside a block table
SEED_INVALID = -(1 << 63)    # WritePlan.seed of a request the plan builder rejected: + BatchField code
INT32_MASK = 0xFFFFFFFF      # the low int32 of an int64 status cell (little-endian)
FAIL_BITS_MASK = 0x7FFFFFFF  # FAIL_REASON_BITS holds reason bits in a non-negative int32
MAX_REQUEST_TOKENS = (1 << 31) - 1  # new tokens a request owns at most (sums over a batch never wrap)
# The self-test record (docs/format.md §11): a verify that expects SELF_TEST_POSITION and
# SELF_TEST_TOKEN at a canary-only slot whose record holds SELF_TEST_POSITION + 1 (known bad).
SELF_TEST_TOKEN = 0x5E1F7E57
SELF_TEST_POSITION = 0


class FailReason(enum.IntFlag):
    """Bits of ring column FAIL_REASON_BITS. Values 1..32 are format v1 (SGLang-compatible).

    Bits 64 and up are kvcanary extensions (docs/format.md): format v1 readers see an unknown bit,
    the row is never silently dropped.
    - SLOT_OUT_OF_RANGE: a slot read from device memory (plan entry, predecessor, seed,
      out_cache_loc, SWA map entry) lies outside the canary buffer.
    - BATCH_INDEX_OUT_OF_RANGE: a value of the engine's batch read on the device is outside what
      the launch's arrays allow (request-pool row outside [1, rows), a length outside
      req_to_token, a padding row before a real one, tokens past the batch's write ranges, entry
      offsets that disagree with the batch). The row's EXPECTED_TOKEN names the field (BatchField).
    - PADDING_SLOT_READ: a real request's verify entry, or its required predecessor, is slot 0.
    - SELF_TEST: the row of a verify launch's self-test (docs/format.md §11): the canary-only
      known-bad record the launch checked every ``self_test_every``-th run. Not a violation.
    - LOST_WRITE: a write that fingerprints real KV (hash mode PARTIAL or ALL, at least one
      source) found the slot's bytes unchanged since the record it replaces although that record
      holds another token: the engine's store of this token's KV never reached the slot (K14,
      docs/format.md §7.1). Reported at write time, in the step that missed the store.
    """

    VERIFY_CHAIN_HASH_MISMATCH = 1
    VERIFY_POSITION_MISMATCH = 2
    VERIFY_REAL_KV_HASH_MISMATCH = 4
    WRITE_TOKEN_MISMATCH = 8
    WRITE_POSITION_MISMATCH = 16
    VERIFY_TOKEN_MISMATCH = 32
    SLOT_OUT_OF_RANGE = 64
    BATCH_INDEX_OUT_OF_RANGE = 128
    PADDING_SLOT_READ = 256
    SELF_TEST = 512
    LOST_WRITE = 1024


class BatchField(enum.IntEnum):
    """EXPECTED_TOKEN of a BATCH_INDEX_OUT_OF_RANGE row: which batch value was out of range.
    Such a row has SLOT_IDX -1 (TOKENS_UNOWNED: the slot the token names), POSITION = the
    request's index in the batch (-1 for the TOKENS fields), STORED_TOKEN = the value read,
    EXPECTED_AUX = the bound it broke."""

    REQ_POOL_INDEX = 1   # row outside [1, rtt_rows); bound rtt_rows
    PREFIX_LEN = 2       # prefix_lens outside [0, rtt_max_len]; bound rtt_max_len
    EXTEND_LEN = 3       # extend_lens < 0; bound 0
    ENTRY_COUNT = 4      # the plan's entry count for the request (value) != the batch's (bound)
    PADDING_ORDER = 5    # a padding request (row 0) before a real one; value 0, bound the real row
    TOKENS_SHORT = 6     # the write ranges need more tokens than T; value sum(extend_lens), bound T
    TOKENS_UNOWNED = 7   # a token past every write range has a real slot (> 0); value its index, bound the sum


class LaunchTag(enum.IntEnum):
    """Ring column KERNEL_KIND: which launch recorded a row. Value order is ABI."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11


class HashMode(enum.IntEnum):
    """How much of each real-KV source strip is fingerprinted (docs/format.md §3)."""

    NONE = 0
    PARTIAL = 1
    ALL = 2


# ---- status block (docs/format.md §10) ---------------------------------------------------------------
# int64 cells the kernels count into and the pump snapshots once per step: three fixed cells,
# then (kernel runs, slot runs) per verify context, then (num_valid, enable) per plan (their low
# int32 halves are the plan's int32 [1] arrays).
STATUS_CLAIM = 0      # ring rows claimed: the 64-bit violation total; its low int32 is the v1 write index
STATUS_CONSUMED = 1   # ring rows the host has taken (a device cell the host updates by an async copy)
STATUS_SKIPS = 2      # verify entries skipped because the plan and the launch's batch disagree
STATUS_FIXED_CELLS = 3


@dataclass(frozen=True)
class StatusLayout:
    """Cell indices of a status block for ``contexts`` verify contexts and ``plans`` plans, then,
    with ``requests`` > 0, the step's request verdicts (docs/format.md §5.7): the count of failed
    requests, then one verdict word per batch index (both reset by the step's first plan build)."""

    contexts: int
    plans: int
    requests: int = 0

    def runs(self, i: int) -> int:
        """Cell of context i's kernel_run_counter (its slot_run_counter is the next one)."""
        return STATUS_FIXED_CELLS + 2 * i

    def plan(self, k: int) -> int:
        """Cell of plan k's num_valid (its enable flag is the next one)."""
        return STATUS_FIXED_CELLS + 2 * self.contexts + 2 * k

    @property
    def failed(self) -> int:
        """Cell of the step's failed-request count (the verdict words follow it)."""
        return STATUS_FIXED_CELLS + 2 * (self.contexts + self.plans)

    @property
    def size(self) -> int:
        return self.failed + (1 + self.requests if self.requests else 0)


# ---- params structs ---------------------------------------------------------------------------------
# A field is (name, kind). kind is a scalar ("i32", "i64", "u64"), a typed device pointer
# ("ptr:T" with T a C type; 8 bytes, carried as uint64 on the host) or ("struct", Name, count).
_SCALARS = {
    "i32": (4, ctypes.c_int32, "int"),
    "i64": (8, ctypes.c_int64, "long long"),
    "u64": (8, ctypes.c_uint64, "unsigned long long"),
}


@dataclass(frozen=True)
class Field:
    name: str
    kind: str
    count: int = 1  # > 1 only for arrays of structs


@dataclass(frozen=True)
class StructDecl:
    """A params struct: fields in order, no implicit padding (explicit _pad fields instead)."""

    name: str
    fields: tuple[Field, ...]


def _F(name: str, kind: str, count: int = 1) -> Field:
    return Field(name, kind, count)


SOURCE_DESC = StructDecl("KvcSourceDesc", (
    _F("base", "ptr:const unsigned char"),
    _F("row_stride", "i64"),        # bytes between rows of the uint8 view
    _F("page_size", "i32"),
    _F("bytes_per_token", "i32"),
    _F("hash_bytes", "i32"),        # bytes fingerprinted per slot: 16 (PARTIAL) or read_bytes (ALL)
    _F("_pad0", "i32"),
))

# Fields every canary launch shares: the buffer, the sink, the counters and the sources. The
# sources are a device array of the context (num_sources KvcSourceDesc), not inline: params
# stay ~150 bytes, which is what cuLaunchKernel copies and the GPU loads per launch.
COMMON = (
    _F("canary", "ptr:long long"),
    _F("slot_stride_words", "i64"),  # slot stride in int64 words
    _F("num_slots", "i64"),
    _F("ring", "ptr:long long"),
    _F("ring_capacity", "i64"),
    _F("write_index", "ptr:int"),
    _F("kernel_run_counter", "ptr:unsigned long long"),
    _F("slot_run_counter", "ptr:unsigned long long"),
    _F("tag", "i32"),
    _F("num_sources", "i32"),
    _F("sources", "ptr:const KvcSourceDesc"),
    # 0, or a 64-bit claim counter for ring rows (the status block's cell, whose low int32 is
    # the v1 write index): rows are then kept in a window of ring_capacity after ring_consumed.
    _F("ring_claim", "ptr:unsigned long long"),
    _F("ring_consumed", "ptr:const long long"),   # 0 = fill once (format v1)
    _F("skip_counter", "ptr:unsigned long long"),  # 0, or verify entries skipped (plan != batch)
    # Request verdicts (docs/format.md §5.7, a kvcanary extension): a row attributed to request r of
    # the batch ORs its fail bits into verdicts[r] (r < verdict_len); failed_requests counts the words
    # that became nonzero; ring_requests[i] names the request of the row stored at ring index i (-1:
    # none). Each 0 = off.
    _F("verdicts", "ptr:unsigned long long"),
    _F("verdict_len", "i64"),
    _F("failed_requests", "ptr:unsigned long long"),
    _F("ring_requests", "ptr:long long"),
)

# The pump's status snapshot (docs/format.md §10): the status block copied into a slot of mapped pinned
# host memory, then the slot's completion word; by the step's last launch (kvc_step_end: a verify's
# `snap`, the last of its blocks to finish) or by a kvc_snapshot launch of its own (pump.cu).
SNAPSHOT_PARAMS = StructDecl("KvcSnapshotParams", (
    _F("status", "ptr:const long long"),    # the int64 status block (device memory)
    _F("payload", "ptr:long long"),         # the slot's n int64 (pinned host, device address)
    _F("done", "ptr:long long"),            # the slot's completion word (pinned host, device address); 0 = none
    _F("n", "i64"),
    _F("ticket", "i64"),                    # written to *done last; never 0
    # cells [0, head] are always copied; (head, n) only when cell head (the step's failed-request
    # count, docs/format.md §5.7) is nonzero. head = n - 1 copies everything.
    _F("head", "i64"),
    _F("arrive", "ptr:unsigned long long"),  # folded into a launch: its blocks that finished (0 between launches)
))

# Tail of both verify structs: the expected-token switch and the self-test (docs/format.md §11).
_VERIFY_TAIL = (
    _F("check_expected_token", "i32"),
    _F("self_test_every", "i32"),                  # 0 = off
    _F("self_test", "ptr:const long long"),        # the canary-only known-bad record (FIELDS_PER_SLOT words)
    # the fingerprint budget (docs/format.md §6.1; fused verify only): 1 = every entry
    _F("fingerprint_every", "i32"),
    _F("_pad1", "i32"),
    _F("fingerprint_phase", "ptr:const unsigned long long"),  # 0 = phase 0
    # the pump's snapshot when this launch ends the step (eager TAIL's last verify; done 0 = none).
    # A paired launch takes half 0's.
    _F("snap", "struct:KvcSnapshotParams"),
)

VERIFY_PARAMS = StructDecl("KvcVerifyParams", COMMON + (
    _F("plan_slot", "ptr:const long long"),
    _F("plan_expected_token", "ptr:const long long"),
    _F("plan_expected_position", "ptr:const long long"),
    _F("plan_prev_slot", "ptr:const long long"),
    _F("plan_num_valid", "ptr:const int"),
    _F("plan_enable", "ptr:const int"),
    _F("plan_capacity", "i64"),
    # the plan builder's entry offsets [plan_requests + 1], which attribute a row to its request
    # (docs/format.md §5.7); 0 = rows not attributed (a sweep's plan)
    _F("plan_entry_offsets", "ptr:const long long"),
    _F("plan_requests", "i64"),
    *_VERIFY_TAIL,
))

WRITE_PARAMS = StructDecl("KvcWriteParams", COMMON + (
    _F("offsets", "ptr:const long long"),
    _F("seed", "ptr:const long long"),
    _F("num_valid_reqs", "ptr:const int"),
    _F("req_capacity", "i64"),
    _F("input_ids", "ptr:const long long"),
    _F("positions", "ptr:const long long"),
    _F("out_cache_loc", "ptr:const long long"),
    _F("num_tokens", "i64"),
    _F("expected_input_ids", "ptr:const long long"),   # 0 when not given
    _F("expected_positions", "ptr:const long long"),   # 0 when not given
    _F("chain_position_assert", "ptr:const int"),      # 0 when not given (assert off)
    _F("chain_source", "ptr:const long long"),         # 0, or a buffer of the group stamped with these tokens
))

# The engine's batch, as the plan builder and the fused verify read it (docs/format.md §8).
_BATCH = (
    _F("req_pool_indices", "ptr:const long long"),
    _F("prefix_lens", "ptr:const long long"),
    _F("extend_lens", "ptr:const long long"),
    _F("batch_size", "i64"),
    _F("req_to_token", "ptr:const int"),
    _F("rtt_rows", "i64"),
    _F("rtt_row_stride", "i64"),                 # elements
    _F("rtt_max_len", "i64"),
    _F("swa_window", "i64"),                     # 0 = no window
    _F("swa_map", "ptr:const long long"),        # 0 = identity
    _F("swa_map_len", "i64"),
    _F("expected_pool", "ptr:const long long"),  # 0 = no expected tokens
    _F("expected_row_stride", "i64"),            # elements
    _F("expected_pool_len", "i64"),
    _F("expected_valid_lens", "ptr:const long long"),
    _F("expected_token_offset", "i64"),
    _F("entry_offsets", "ptr:long long"),        # [batch_size + 1] verify entries per request
    _F("verify_num_valid", "ptr:int"),
    _F("verify_enable", "ptr:int"),
    _F("verify_capacity", "i64"),
)

# The plan builder reports what it rejects through a sink (the _COMMON ring fields; it counts no
# launch of its own) and checks the group's new tokens against the write ranges.
PREPARE_PARAMS = StructDecl("KvcPrepareParams", COMMON + _BATCH + (
    _F("write_offsets", "ptr:long long"),        # WritePlan.offsets [req_capacity + 1]
    _F("write_seed", "ptr:long long"),           # WritePlan.seed [req_capacity]
    _F("write_num_valid_reqs", "ptr:int"),
    _F("write_req_capacity", "i64"),
    _F("out_cache_loc", "ptr:const long long"),  # the group's slots of the new tokens, or 0
    _F("num_tokens", "i64"),
    _F("verdict_reset", "i32"),                  # 1: zero the verdicts and failed_requests first (a step's first build)
    _F("_pad_reset", "i32"),
))

EXPAND_PARAMS = StructDecl("KvcExpandParams", _BATCH + (
    _F("plan_slot", "ptr:long long"),
    _F("plan_expected_token", "ptr:long long"),
    _F("plan_expected_position", "ptr:long long"),
    _F("plan_prev_slot", "ptr:long long"),
))

FUSED_VERIFY_PARAMS = StructDecl("KvcFusedVerifyParams", COMMON + _BATCH + _VERIFY_TAIL)

# Records that travel (kernels_src/records.cu): the group's buffers (canary = the first), the slots
# and the compact [buffers, n, FIELDS_PER_SLOT] array; the _COMMON ring fields report bad slots.
MAX_RECORD_BUFFERS = 4  # HEAD and TAIL x K and V of one pool group
RECORDS_PARAMS = StructDecl("KvcRecordsParams", COMMON + (
    _F("canary1", "ptr:long long"),
    _F("canary2", "ptr:long long"),
    _F("canary3", "ptr:long long"),
    _F("slots", "ptr:const long long"),
    _F("n", "i64"),
    _F("records", "ptr:long long"),
    _F("num_buffers", "i32"),
    _F("import_records", "i32"),   # 0: buffers -> records (export), 1: records -> buffers (import)
))

PROBE_PARAMS = StructDecl("KvcProbeParams", (
    _F("out", "ptr:long long"),
    _F("a_i32", "i32"),
    _F("b_i32", "i32"),
    _F("c_i64", "i64"),
    _F("d_u64", "u64"),
    _F("sources", "struct:KvcSourceDesc", 2),
))

# One step of vLLM attention metadata staged into a Batch's persistent buffers (kernels_src/stage.cu,
# kvcanary.adapters.vllm_stager): one launch instead of the adapter's torch ops. Each input is int32
# or int64: bit i of `wide` is set when input i of STAGE_VLLM_INPUTS is int64 (KVC_STAGE_VLLM_<NAME>
# in the kernel); the 1-D inputs are contiguous, the block table's rows too.
STAGE_VLLM_INPUTS = ("block_table", "seq_lens", "query_start_loc", "slot_mapping", "input_ids", "positions")
STAGE_VLLM_PARAMS = StructDecl("KvcStageVllmParams", (
    _F("block_table", "ptr:const void"),     # [>= num_reqs, max_blocks], block_table_stride elements a row
    _F("seq_lens", "ptr:const void"),        # [>= num_reqs] lengths after the step
    _F("query_start_loc", "ptr:const void"), # [>= num_reqs + 1]
    _F("slot_mapping", "ptr:const void"),    # [>= num_tokens]
    _F("input_ids", "ptr:const void"),
    _F("positions", "ptr:const void"),
    _F("rows", "ptr:long long"),             # out [num_reqs]: request-pool row r + 1
    _F("prefix_lens", "ptr:long long"),      # out [num_reqs]: seq_lens - extend
    _F("extend_lens", "ptr:long long"),      # out [num_reqs]: query_start_loc[r + 1] - query_start_loc[r]
    _F("req_to_token", "ptr:int"),           # out [num_reqs + 1, max_len]; row 0 the padding row
    _F("out_input_ids", "ptr:long long"),    # out [num_tokens]
    _F("out_positions", "ptr:long long"),
    _F("out_cache_loc", "ptr:long long"),
    _F("block_table_stride", "i64"),
    _F("num_reqs", "i64"),
    _F("num_tokens", "i64"),
    _F("block_size", "i64"),
    _F("max_len", "i64"),                    # <= max_blocks * block_size (checked on the host)
    _F("wide", "i32"),
    _F("_pad", "i32"),
))

# One SGLang ForwardBatch staged like the vLLM step above (kvcanary.adapters.sglang_stager): bit i of
# `wide`, input i of STAGE_SGLANG_INPUTS (KVC_STAGE_SGLANG_<NAME>); the two extend arrays may be NULL.
STAGE_SGLANG_INPUTS = ("req_pool_indices", "seq_lens", "input_ids", "positions", "out_cache_loc", "extend_seq_lens",
                       "extend_prefix_lens")
STAGE_SGLANG_PARAMS = StructDecl("KvcStageSglangParams", (
    _F("req_pool_indices", "ptr:const void"),  # [>= num_reqs]
    _F("seq_lens", "ptr:const void"),          # [>= num_reqs]
    _F("input_ids", "ptr:const void"),         # [>= num_tokens]
    _F("positions", "ptr:const void"),
    _F("out_cache_loc", "ptr:const void"),
    _F("extend_seq_lens", "ptr:const void"),   # [>= num_reqs] or NULL: every request extends by uniform_extend
    _F("extend_prefix_lens", "ptr:const void"),  # [>= num_reqs] or NULL: prefix = seq_lens - seq_includes_new * extend
    _F("rows", "ptr:long long"),               # out [num_reqs]: req_pool_indices widened
    _F("prefix_lens", "ptr:long long"),        # out [num_reqs]
    _F("extend_lens", "ptr:long long"),        # out [num_reqs]
    _F("out_input_ids", "ptr:long long"),      # out [num_tokens]
    _F("out_positions", "ptr:long long"),
    _F("out_loc", "ptr:long long"),
    _F("num_reqs", "i64"),
    _F("num_tokens", "i64"),
    _F("uniform_extend", "i64"),               # used when extend_seq_lens is NULL
    _F("seq_includes_new", "i32"),             # 1: seq_lens counts the step's new tokens (DECODE, EXTEND)
    _F("wide", "i32"),
))

# One step of a paged engine given as cumulative query / key lengths and physical cache indices
# (transformers continuous batching: kernels_src/stage.cu, kvcanary.adapters.transformers_batch),
# staged like the vLLM step above: bit i of `wide`, input i of STAGE_PAGED_INPUTS (KVC_STAGE_PAGED_<NAME>).
STAGE_PAGED_INPUTS = ("cu_seq_lens_q", "cu_seq_lens_k", "read_index", "write_index", "input_ids", "position_ids",
                      "block_table", "carry_over_ids", "prev_output_ids")
STAGE_PAGED_PARAMS = StructDecl("KvcStagePagedParams", (
    _F("cu_q", "ptr:const void"),            # [num_reqs + 1] cumulative new tokens
    _F("cu_k", "ptr:const void"),            # [num_reqs + 1] cumulative cached + new tokens
    _F("read_index", "ptr:const void"),      # [num_read] physical indices, request by request
    _F("write_index", "ptr:const void"),     # [num_write] physical indices of the new tokens
    _F("input_ids", "ptr:const void"),       # [num_tokens]
    _F("positions", "ptr:const void"),       # [num_tokens]
    _F("block_table", "ptr:const void"),     # NULL, or [num_reqs, table_cols] page entries (the decode fast
                                             # path: read_index / write_index unused)
    _F("carry_ids", "ptr:const void"),       # NULL, or [num_tokens]: token i is prev_output[carry_ids[i]] when
    _F("prev_output", "ptr:const void"),     # 0 <= carry_ids[i] < prev_len (async batching's carried-over tokens)
    _F("expected_ids", "ptr:long long"),     # NULL, or [num_tokens] in/out: a negative entry (the host did not
                                             # know the token) becomes the token
    _F("rows", "ptr:long long"),             # out [num_reqs]: request-pool row r + 1
    _F("prefix_lens", "ptr:long long"),      # out [num_reqs]: key length - query length
    _F("extend_lens", "ptr:long long"),      # out [num_reqs]: query length
    _F("req_to_token", "ptr:int"),           # [rtt_rows, rtt_cols], read slots scattered into rows 1..
    _F("out_input_ids", "ptr:long long"),    # out [num_tokens]
    _F("out_positions", "ptr:long long"),
    _F("out_cache_loc", "ptr:long long"),    # out [num_write]: canary slots of write_index
    _F("rtt_cols", "i64"),
    _F("num_reqs", "i64"),                   # < rtt_rows (checked on the host)
    _F("num_read", "i64"),
    _F("num_write", "i64"),
    _F("num_tokens", "i64"),
    _F("block_stride", "i64"),               # physical rows per block (> 0)
    _F("page_size", "i64"),                  # tokens per page
    _F("num_slots", "i64"),                  # the slot of an index that names no token
    _F("table_stride", "i64"),               # block_table elements per row
    _F("table_cols", "i64"),                 # block_table entries per row
    _F("prev_len", "i64"),                   # prev_output's elements
    _F("wide", "i32"),
    _F("_pad", "i32"),
))

# The K and V halves of a group in one launch (docs/format.md §7): HALVES params structs, one per
# half, and a 2-D grid whose blockIdx.y picks the half; each half runs as its own launch would.
HALVES = 2
WRITE_PAIR = StructDecl("KvcWritePair", (_F("half", "struct:KvcWriteParams", HALVES),))
FUSED_VERIFY_PAIR = StructDecl("KvcFusedVerifyPair", (_F("half", "struct:KvcFusedVerifyParams", HALVES),))
# HEAD's first launch of a small step (kvc_prepare_write_pair): the plan builder's params and the two
# halves' writes, which take their ranges and seeds from the plan this launch builds.
PREPARE_WRITE_PAIR = StructDecl("KvcPrepareWritePair", (_F("plan", "struct:KvcPrepareParams"),
                                                        _F("half", "struct:KvcWriteParams", HALVES)))
# The fold's limits: its blocks each sum the requests before theirs (O(batch) loads a block) and stamp
# a request past a warp's tokens into both halves one after the other (its serial chain twice).
FOLD_MAX_BATCH = 256
FOLD_MAX_TOKENS = 256

STRUCTS: tuple[StructDecl, ...] = (
    SOURCE_DESC, SNAPSHOT_PARAMS, VERIFY_PARAMS, WRITE_PARAMS, PREPARE_PARAMS, EXPAND_PARAMS,
    FUSED_VERIFY_PARAMS, RECORDS_PARAMS, PROBE_PARAMS, WRITE_PAIR, FUSED_VERIFY_PAIR, PREPARE_WRITE_PAIR,
    STAGE_VLLM_PARAMS, STAGE_PAGED_PARAMS, STAGE_SGLANG_PARAMS,
)
_BY_NAME = {s.name: s for s in STRUCTS}
PARAMS_STRUCTS = tuple(s for s in STRUCTS if s is not SOURCE_DESC)
ECHO_BYTES = 4096  # size of the device echo buffer of the ABI probe


@dataclass(frozen=True, eq=False)
class KernelFamily:
    """One NVRTC program: kernels_src/<source>, compiled and cached per arch on its own, loaded on a
    device as one CUlibrary. Every kernel name is declared here once; KERNELS, PAIRED and
    PLAIN_KERNELS are derived from FAMILIES."""

    name: str
    source: str                     # its .cu file in kernels_src (the .cuh headers are shared)
    kernels: dict[str, str]         # extern "C" entry point -> the one params struct it takes by value
    paired: dict[str, str] = dataclass_field(default_factory=dict)  # kernel -> its entry point for both halves
    plain: frozenset[str] = frozenset()  # kernels launched without PDL where it is on (_VERIFY_PLAIN: why)
    core: bool = True               # loaded at a device's runtime creation; else on first use
    variables: tuple[str, ...] = ()  # __device__ variables the host looks up by name (global_address)

    def __post_init__(self):
        names = set(self.paired) | set(self.paired.values()) | self.plain
        if not names <= set(self.kernels):
            raise AssertionError(f"kv-canary: family {self.name} pairs or launches plain "
                                 f"{sorted(names - set(self.kernels))}, which it does not declare; "
                                 f"expected kernels of its table. Fix: add them to its kernels")


_VERIFY_KERNELS = {
    "kvc_verify": VERIFY_PARAMS.name,
    "kvc_verify_wide": VERIFY_PARAMS.name,              # fingerprints of >= WIDE_HASH_BYTES
    "kvc_verify_many": VERIFY_PARAMS.name,              # short strips of >= MANY_SOURCES sources
    "kvc_fused_verify": FUSED_VERIFY_PARAMS.name,
    "kvc_fused_verify_wide": FUSED_VERIFY_PARAMS.name,
    "kvc_fused_verify_many": FUSED_VERIFY_PARAMS.name,
    "kvc_fused_verify_pair": FUSED_VERIFY_PAIR.name,
    "kvc_fused_verify_wide_pair": FUSED_VERIFY_PAIR.name,
    "kvc_fused_verify_many_pair": FUSED_VERIFY_PAIR.name,
}
# Kernels launched without PDL even where it is on: the many-source verifies (2 blocks per SM, 35 KB of
# shared memory each). With them early-resident the 1.1 B model's layers="all" decode step was 4-10 %
# slower than with plain launches on the H200; without, 0.94-1.04x (docs/performance.md).
_VERIFY_PLAIN = frozenset({"kvc_verify_many", "kvc_fused_verify_many", "kvc_fused_verify_many_pair"})

# Core families are loaded on every device when its runtime is created; stage (the adapters' staging)
# and probe (the ABI probe of the GPU tests, the doctor, the launch-overhead benchmark) on first use.
FAMILIES: tuple[KernelFamily, ...] = (
    KernelFamily("plan", "plan.cu", {"kvc_prepare": PREPARE_PARAMS.name, "kvc_expand": EXPAND_PARAMS.name}),
    KernelFamily("verify", "verify.cu", _VERIFY_KERNELS, plain=_VERIFY_PLAIN,
                 paired={"kvc_fused_verify": "kvc_fused_verify_pair", "kvc_fused_verify_wide": "kvc_fused_verify_wide_pair",
                         "kvc_fused_verify_many": "kvc_fused_verify_many_pair"}),
    KernelFamily("write", "write.cu", {"kvc_write": WRITE_PARAMS.name, "kvc_write_pair": WRITE_PAIR.name,
                                       "kvc_prepare_write_pair": PREPARE_WRITE_PAIR.name,
                                       "kvc_prepare_write_pair_warps": PREPARE_WRITE_PAIR.name},
                 paired={"kvc_write": "kvc_write_pair"}),
    KernelFamily("records", "records.cu", {"kvc_copy_records": RECORDS_PARAMS.name}),
    KernelFamily("pump", "pump.cu", {"kvc_snapshot": SNAPSHOT_PARAMS.name}),
    KernelFamily("stage", "stage.cu", {"kvc_stage_vllm": STAGE_VLLM_PARAMS.name,
                                       "kvc_stage_paged": STAGE_PAGED_PARAMS.name,
                                       "kvc_stage_sglang": STAGE_SGLANG_PARAMS.name}, core=False),
    KernelFamily("probe", "probe.cu", {"kvc_empty": PROBE_PARAMS.name, "kvc_abi_layout": PROBE_PARAMS.name,
                                       **{f"kvc_echo_{s.name}": s.name for s in PARAMS_STRUCTS}},
                 core=False, variables=("kvc_echo_buffer",)),
)
CORE_FAMILIES = tuple(f for f in FAMILIES if f.core)
# Derived from FAMILIES: kernel entry point -> its params struct, the paired entry point of a kernel
# (one launch for both halves) by the kernel's name, the kernels launched without PDL.
KERNELS: dict[str, str] = {k: s for f in FAMILIES for k, s in f.kernels.items()}
PAIRED: dict[str, str] = {k: v for f in FAMILIES for k, v in f.paired.items()}
PLAIN_KERNELS: frozenset[str] = frozenset().union(*(f.plain for f in FAMILIES))


def index_families(families: tuple[KernelFamily, ...]) -> dict[str, KernelFamily]:
    """Kernel or variable name -> its family; a name in two families is refused."""
    index: dict[str, KernelFamily] = {}
    for f in families:
        for name in (*f.kernels, *f.variables):
            if name in index:
                raise AssertionError(f"kv-canary: {name} is declared by two families ({index[name].name}, {f.name}); "
                                     f"expected each name in one. Fix: keep it in the family whose .cu defines it")
            index[name] = f
    return index


_FAMILY_OF = index_families(FAMILIES)


def family_of(name: str) -> KernelFamily:
    """The family whose program defines kernel (or __device__ variable) ``name``."""
    try:
        return _FAMILY_OF[name]
    except KeyError:
        raise KeyError(f"kv-canary: no kernel family declares {name!r}; expected a kernel or variable of "
                       f"abi.FAMILIES. Fix: add it to its family's table in kvcanary/abi.py") from None


def field_size(f: Field) -> int:
    if f.kind.startswith("ptr:"):
        return 8
    if f.kind.startswith("struct:"):
        return struct_size(_BY_NAME[f.kind[7:]]) * f.count
    return _SCALARS[f.kind][0]


def field_align(f: Field) -> int:
    return 8 if f.kind.startswith(("ptr:", "struct:")) else _SCALARS[f.kind][0]


def layout(decl: StructDecl) -> dict[str, int]:
    """Field name → byte offset, packing fields in order with no implicit padding."""
    offsets, off = {}, 0
    for f in decl.fields:
        if off % field_align(f):
            raise AssertionError(f"kv-canary: ABI field {decl.name}.{f.name} at offset {off} is "
                                 f"misaligned; add an explicit _pad field before it")
        offsets[f.name] = off
        off += field_size(f)
    return offsets


def struct_size(decl: StructDecl) -> int:
    size = sum(field_size(f) for f in decl.fields)
    if size % 8:
        raise AssertionError(f"kv-canary: ABI struct {decl.name} is {size} bytes, not a multiple "
                             f"of 8; add an explicit tail _pad field")
    return size


# ---- ctypes side -------------------------------------------------------------------------------
def _ctype(f: Field):
    if f.kind.startswith("ptr:"):
        return ctypes.c_uint64
    if f.kind.startswith("struct:"):
        return CTYPES[f.kind[7:]] * f.count
    return _SCALARS[f.kind][1]


def _make_ctypes(decl: StructDecl) -> type[ctypes.Structure]:
    return type(decl.name, (ctypes.Structure,), {"_fields_": [(f.name, _ctype(f)) for f in decl.fields]})


CTYPES: dict[str, type[ctypes.Structure]] = {}
for _decl in STRUCTS:
    CTYPES[_decl.name] = _make_ctypes(_decl)

SourceDesc = CTYPES["KvcSourceDesc"]
VerifyParams = CTYPES["KvcVerifyParams"]
WriteParams = CTYPES["KvcWriteParams"]
PrepareParams = CTYPES["KvcPrepareParams"]
ExpandParams = CTYPES["KvcExpandParams"]
FusedVerifyParams = CTYPES["KvcFusedVerifyParams"]
ProbeParams = CTYPES["KvcProbeParams"]
SnapshotParams = CTYPES["KvcSnapshotParams"]
RecordsParams = CTYPES["KvcRecordsParams"]
WritePair = CTYPES["KvcWritePair"]
FusedVerifyPair = CTYPES["KvcFusedVerifyPair"]
PrepareWritePair = CTYPES["KvcPrepareWritePair"]
StageVllmParams = CTYPES["KvcStageVllmParams"]
StagePagedParams = CTYPES["KvcStagePagedParams"]
StageSglangParams = CTYPES["KvcStageSglangParams"]


# ---- C++ side ---------------------------------------------------------------------------------------
def constants() -> dict[str, int]:
    """Every integer constant the device code may use, by its C name."""
    out = {
        "KVC_FORMAT_VERSION": FORMAT_VERSION, "KVC_SLOT_BYTES": SLOT_BYTES,
        "KVC_FIELD_TOKEN": FIELD_TOKEN, "KVC_FIELD_POSITION": FIELD_POSITION,
        "KVC_FIELD_PREV_HASH": FIELD_PREV_HASH, "KVC_FIELD_REAL_KV_HASH": FIELD_REAL_KV_HASH,
        "KVC_PADDING_SLOT": PADDING_SLOT,
        "KVC_ANCHOR": ANCHOR, "KVC_SM_MUL1": SM_MUL1, "KVC_SM_MUL2": SM_MUL2,
        "KVC_SM_SHIFT1": SM_SHIFT1, "KVC_SM_SHIFT2": SM_SHIFT2, "KVC_SM_SHIFT3": SM_SHIFT3,
        "KVC_RING_COLS": RING_COLS, "KVC_MAX_REAL_KV_SOURCES": MAX_REAL_KV_SOURCES,
        "KVC_NO_EXPECTED_TOKEN": NO_EXPECTED_TOKEN, "KVC_CHAIN_HEAD": CHAIN_HEAD,
        "KVC_REAL_KV_ALIGN": REAL_KV_ALIGN, "KVC_ECHO_BYTES": ECHO_BYTES,
        "KVC_BLOCK_THREADS": BLOCK_THREADS, "KVC_PREPARE_THREADS": PREPARE_THREADS,
        "KVC_WIDE_VERIFY_THREADS": WIDE_VERIFY_THREADS, "KVC_VERIFY_LANE_ENTRIES": VERIFY_LANE_ENTRIES,
        "KVC_HASHED_LANE_ENTRIES": HASHED_LANE_ENTRIES,
        "KVC_VERIFY_MIN_BLOCKS": VERIFY_MIN_BLOCKS, "KVC_MANY_SOURCES": MANY_SOURCES,
        "KVC_SOURCE_BATCH": SOURCE_BATCH, "KVC_MANY_VERIFY_MIN_BLOCKS": MANY_VERIFY_MIN_BLOCKS,
        "KVC_MANY_SPREAD_TILES": MANY_SPREAD_TILES, "KVC_MANY_SPREAD_STRIPS": MANY_SPREAD_STRIPS,
        "KVC_WIDE_HASH_BYTES": WIDE_HASH_BYTES, "KVC_STRIP_PIECE_BYTES": STRIP_PIECE_BYTES,
        "KVC_STRIP_BATCH": STRIP_BATCH, "KVC_WIDE_PIECES": WIDE_PIECES, "KVC_WIDE_DEPTH": WIDE_DEPTH,
        "KVC_FULL_MASK": FULL_MASK, "KVC_NO_SLOT": NO_SLOT, "KVC_NO_REQUEST": NO_REQUEST,
        "KVC_NO_POSITION": NO_POSITION, "KVC_SKIP_SLOT": SKIP_SLOT, "KVC_STAGE_NO_INDEX": STAGE_NO_INDEX,
        "KVC_NO_RING_ROW": NO_RING_ROW, "KVC_PLAN_DISABLED": PLAN_DISABLED,
        "KVC_SWA_UNMAPPED": SWA_UNMAPPED, "KVC_PREV_ON_PADDING": PREV_ON_PADDING,
        "KVC_SEED_INVALID": SEED_INVALID, "KVC_INT32_MASK": INT32_MASK, "KVC_FAIL_BITS_MASK": FAIL_BITS_MASK,
        "KVC_MAX_REQUEST_TOKENS": MAX_REQUEST_TOKENS, "KVC_MAX_RECORD_BUFFERS": MAX_RECORD_BUFFERS,
        "KVC_FIELDS_PER_SLOT": FIELDS_PER_SLOT,
        "KVC_SELF_TEST_TOKEN": SELF_TEST_TOKEN, "KVC_SELF_TEST_POSITION": SELF_TEST_POSITION,
        "KVC_HALVES": HALVES, "KVC_PDL_CUDA_ARCH": PDL_CUDA_ARCH,
    }
    for kernel, inputs in (("VLLM", STAGE_VLLM_INPUTS), ("PAGED", STAGE_PAGED_INPUTS), ("SGLANG", STAGE_SGLANG_INPUTS)):
        out.update({f"KVC_STAGE_{kernel}_{name.upper()}": bit for bit, name in enumerate(inputs)})
    for field in BatchField:
        out[f"KVC_BATCH_{field.name}"] = int(field)
    out["KVC_BATCH_FIELD_MAX"] = max(BatchField)
    for name in ("KERNEL_KIND", "SLOT_IDX", "POSITION", "STORED_TOKEN", "EXPECTED_TOKEN",
                 "STORED_CHAIN_HASH", "EXPECTED_AUX", "FAIL_REASON_BITS"):
        out[f"KVC_COL_{name}"] = globals()[f"COL_{name}"]
    for bit in FailReason:
        out[f"KVC_{bit.name}"] = int(bit)
    return out


# Constants the kernels use in 32-bit int arithmetic (loop bounds and strides over int counters,
# shared-memory array extents, template arguments): emitted as int, so that code stays 32-bit.
# Every other constant is a long long (unsigned long long past INT64_MAX).
INT_CONSTANTS = frozenset({"KVC_STRIP_BATCH", "KVC_WIDE_PIECES", "KVC_WIDE_DEPTH", "KVC_MANY_SPREAD_TILES",
                           "KVC_MANY_SPREAD_STRIPS"})
# Constants the preprocessor compares (#if): emitted as bare decimal literals.
PREPROCESSOR_CONSTANTS = frozenset({"KVC_PDL_CUDA_ARCH"})


def _c_literal(value: int, name: str = "") -> str:
    if name in PREPROCESSOR_CONSTANTS:
        return str(value)
    if name in INT_CONSTANTS:
        if not -(1 << 31) <= value < (1 << 31):
            raise AssertionError(f"kv-canary: ABI constant {name} = {value} does not fit an int")
        return f"((int){value}LL)"
    if value > 0x7FFFFFFFFFFFFFFF:
        return f"((unsigned long long){value}ULL)"
    if value == -(1 << 63):  # no such literal in C: -9223372036854775808LL overflows
        return "((long long)(-9223372036854775807LL - 1))"
    return f"((long long){value}LL)"


def _c_decl(f: Field) -> str:
    if f.kind.startswith("ptr:"):
        return f"{f.kind[4:]}* {f.name};"
    if f.kind.startswith("struct:"):
        return f"{f.kind[7:]} {f.name}[{f.count}];"
    return f"{_SCALARS[f.kind][2]} {f.name};"


def render_prelude(structs: tuple[StructDecl, ...] = STRUCTS,
                   offsets: dict[str, dict[str, int]] | None = None) -> str:
    """The C++ header every kernel includes as "kvcanary_abi.cuh".

    NVRTC has no standard headers, so the integer typedefs are spelled out. Offsets are checked
    without offsetof (NVRTC 13.0 rejects __builtin_offsetof and the null-pointer idiom in constant
    expressions): for each field a packed struct of the fields before it must have the field's
    offset as its size, and the real struct's size must equal the sum of its field sizes, which
    rules out implicit padding, so the real offsets equal the packed ones.
    ``offsets`` overrides the expected offsets (tests use it to prove a drift fails the compile).
    """
    lines = [
        "// Generated from kvcanary/abi.py. Do not edit.",
        "#pragma once",
        "#ifdef __CUDACC_RTC__  // NVRTC: no <stdint.h>",
        "typedef signed char int8_t; typedef unsigned char uint8_t;",
        "typedef int int32_t; typedef unsigned int uint32_t;",
        "typedef long long int64_t; typedef unsigned long long uint64_t;",
        "#else  // a host compiler (the CPU emulator of the tests)",
        "#include <stdint.h>",
        "#endif",
        "",
    ]
    for name, value in constants().items():
        lines.append(f"#define {name} {_c_literal(value, name)}")
    lines.append("")
    for decl in structs:
        expected = (offsets or {}).get(decl.name, layout(decl))
        lines.append(f"struct {decl.name} {{")
        lines += [f"  {_c_decl(f)}" for f in decl.fields]
        lines.append("};")
        lines.append(f'static_assert(sizeof({decl.name}) == {struct_size(decl)}, '
                     f'"kv-canary ABI: sizeof({decl.name}) differs from abi.py");')
        for i, f in enumerate(decl.fields[1:], start=1):
            probe = f"{decl.name}__upto_{f.name}"
            lines.append(f"struct __attribute__((packed)) {probe} {{ "
                         + " ".join(_c_decl(g) for g in decl.fields[:i]) + " };")
            lines.append(f'static_assert(sizeof({probe}) == {expected[f.name]}, '
                         f'"kv-canary ABI: offset of {decl.name}.{f.name} differs from abi.py");')
        lines.append("")
    lines.append("#define KVC_FOR_EACH_PARAMS_STRUCT(X) " + " ".join(f"X({d.name})" for d in PARAMS_STRUCTS))
    lines += _layout_dump(structs)
    return "\n".join(lines) + "\n"


def layout_dump_order(structs: tuple[StructDecl, ...] = STRUCTS) -> list[tuple[str, str]]:
    """(struct, field) pairs in the order kvc_abi_layout_dump writes them; field "" is sizeof."""
    return [(d.name, f) for d in structs for f in ("", *(g.name for g in d.fields))]


def _layout_dump(structs: tuple[StructDecl, ...]) -> list[str]:
    """A device function writing sizeof and every field offset as the device compiler sees them."""
    body = ["__device__ __noinline__ void kvc_abi_layout_dump(long long* out) {",
            "  const char* base = (const char*)out;  // any address; members are never dereferenced"]
    k = 0
    for struct, field in layout_dump_order(structs):
        if not field:
            body.append(f"  out[{k}] = (long long)sizeof({struct});")
        else:
            body.append(f"  out[{k}] = (long long)((const char*)&(({struct}*)base)->{field} - base);")
        k += 1
    body.append("}")
    return body
