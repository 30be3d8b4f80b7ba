"""A paged engine's step (transformers continuous batching) staged on the device in one launch
(``kvc_stage_paged``, kernels_src/stage.cu): the values of the torch path of
:class:`~.transformers_batch.StepBatches` (:mod:`.stager` says how a stager works)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .. import abi
from ..errors import ValidationError
from ..interop.arrays import ArrayView
from ..ops.batch import Batch
from ..ops.packing import KEPT, PackCache
from ..runtime import memory
from ..validate import boolean, integer
from .stager import Stager


class PagedBatchStager(Stager):
    """Persistent device buffers of the Batch of a paged engine whose step is given as cumulative
    query / key lengths (``cu_q``, ``cu_k``: ``[n + 1]``), the physical cache indices each request
    reads (``read_index``, request by request; an engine's whole index row may be given: the
    kernel reads ``cu_k[n]`` entries) and writes (``write_index``), or instead a block table of page
    entries (``block_table``, ``[n, cols]``: transformers' decode fast path), and the tokens' ids and
    positions (transformers continuous batching; module docstring). Tokens past ``cu_q[n]`` and
    reads past ``cu_k[n]`` are a static-shape batch's padding (CUDA graphs, torch.compile): slot -1,
    no trace in the map. Under async batching token i is ``prev_output_ids[carry_over_ids[i]]``
    where that index is in range, as the engine's forward takes it. With ``expected=True`` the
    Batch carries the expected ids and positions the caller copied (in stream order) into
    :meth:`expected_buffer`; a negative expected id (unknown to the host) becomes the token.
    ``layout`` maps physical indices to canary slots (``stride``, ``page_size``, ``num_slots``, as
    :class:`~.transformers_layout.PagedLayout`). The int32 ``req_to_token`` map (``max_reqs + 1``
    rows) and the token buffers grow, doubling, when a step needs more (the host says how long the
    longest request is: ``max_len``); ``max_len`` given here allocates the map for requests that
    long now, so that steps up to that length never allocate (a step captured into a CUDA graph
    must not). More than ``max_reqs`` requests are refused. A step of one shape returns the same Batch.

    ``fixed=True``: every step returns the one Batch of the buffers' whole capacity (``max_reqs``
    requests, ``max_tokens`` tokens, ``max_writes`` writes; expected positions at ``max_tokens``),
    the step's tail past its own requests and tokens set after the launch to padding (requests of
    map row 0 with no tokens, tokens 0 at position 0 writing no slot): the canary's launches are
    then packed once for every step shape (an engine that captures each shape into a CUDA graph
    runs the canary's packing once, not once per shape). The caller writes the expected tokens
    into :meth:`expected_buffer` laid out the same way (ids, 0 up to ``max_tokens``, positions)."""

    KERNEL = "kvc_stage_paged"
    INPUTS = abi.STAGE_PAGED_INPUTS
    OPTIONAL = frozenset({"block_table", "carry_over_ids", "prev_output_ids"})
    SCALARS = ("expected",)

    def __init__(self, layout, *, max_reqs: int, max_tokens: int, max_writes: int, device: int = 0,
                 max_len: int = 0, fixed: bool = False):
        self.layout, self.fixed = layout, boolean("fixed", fixed)
        max_len = integer("max_len", max_len, lo=0, fix="pass the longest request (cached + new tokens) to plan for")
        max_reqs = integer("max_reqs", max_reqs, lo=1, fix="pass the most requests a step schedules")
        max_tokens = integer("max_tokens", max_tokens, lo=1, fix="pass the most tokens a step schedules")
        max_writes = integer("max_writes", max_writes, lo=1, fix="pass the most tokens a step writes")
        super().__init__(device, {"rows": max_reqs, "prefix": max_reqs, "extend": max_reqs, "ids": max_tokens,
                                  "pos": max_tokens, "exp": 2 * max_tokens, "loc": max_writes})
        self.map_rows, self.req_to_token = max_reqs + 1, None  # the map: allocated by the first step
        if max_len:
            self._grow(max_len, 0, 0)

    @property
    def token_capacity(self) -> int:
        """The tokens a step may carry now (a ``fixed`` Batch's token count)."""
        return self.buffers["ids"].shape[0]

    @property
    def columns(self) -> int:
        """The longest request the map holds now (0 before it is allocated)."""
        return 0 if self.req_to_token is None else self.req_to_token.shape[1]

    def expected_buffer(self, tokens: int) -> memory.DeviceArray:
        """The int64 buffer of a step's expected ids ``[0, tokens)`` and positions ``[tokens, 2 tokens)``
        (``fixed``: ids ``[0, capacity)`` and positions ``[capacity, 2 capacity)``, :attr:`token_capacity`)."""
        if 2 * tokens > self.buffers["exp"].shape[0]:
            self._grow(0, tokens, 0)
        return self.buffers["exp"]

    def __call__(self, *, cu_q, cu_k, read_index, write_index, input_ids, positions, max_len: int,
                 block_table=None, carry_over_ids=None, prev_output_ids=None, expected: bool = False,
                 stream=None) -> Batch:
        """The step's Batch, staged on ``stream``; ``max_len``: the step's longest request (cached +
        new tokens), which the map's columns must hold."""
        max_len = integer("max_len", max_len, lo=0, fix="pass the step's longest request (cached + new tokens)")
        cols, b = 0 if self.req_to_token is None else self.req_to_token.shape[1], self.buffers
        tokens, writes = int(input_ids.shape[0]), int(write_index.shape[0])
        if max_len > cols or tokens > b["ids"].shape[0] or writes > b["loc"].shape[0]:
            self._grow(max_len, tokens, writes)
        if (carry_over_ids is None) != (prev_output_ids is None):
            raise ValidationError("kv-canary: carry_over_ids and prev_output_ids come together (async batching), got "
                                  "one of them. Fix: pass both, or neither")
        arrays = (cu_q, cu_k, read_index, write_index, input_ids, positions, block_table, carry_over_ids,
                  prev_output_ids)
        return self._stage(arrays, (bool(expected),), stream)

    def grow(self, max_len: int) -> None:
        """A map for requests of ``max_len`` tokens now (the packed launches and Batches go, as in a
        step that needs it; a CUDA graph that captured a step of the old map must go too)."""
        if max_len > self.columns:
            self._grow(max_len, 0, 0)

    def _grow(self, max_len: int, tokens: int, writes: int) -> None:
        """Larger buffers (doubling) for a step that needs them; the packed launches and Batches
        name the old ones, so they go too."""
        z, b = memory.zeros, self.buffers
        cols = 0 if self.req_to_token is None else self.req_to_token.shape[1]
        if max_len > cols or self.req_to_token is None:  # as StepBatches.req_to_token grows its map
            self.req_to_token = z((self.map_rows, max(max_len, 2 * cols, 256)), np.int32, self.device)
        for names, n in ((("ids", "pos"), tokens), (("exp",), 2 * tokens), (("loc",), writes)):
            if n > b[names[0]].shape[0]:
                for name in names:
                    b[name] = z((max(n, 2 * b[name].shape[0]),), np.int64, self.device)
        if b["exp"].shape[0] < 2 * b["ids"].shape[0]:  # expected ids and positions: one per token each
            b["exp"] = z((2 * b["ids"].shape[0],), np.int64, self.device)
        self.packed, self.batches = PackCache(KEPT), OrderedDict()

    def _batch_key(self, shape) -> tuple:
        return (shape[3],) if self.fixed else shape  # fixed: one Batch (with or without expected tokens)

    def _launched(self, shape, stream: int) -> None:
        """``fixed``: the tail past the step's requests and tokens becomes padding (memsets on the
        stream, in order before the canary's launches; captured with the step, they run at each replay)."""
        if not self.fixed:
            return
        n, t, w, _ = shape
        b, fill = self.buffers, memory.fill_async
        for name, count in (("rows", n), ("prefix", n), ("extend", n), ("ids", t), ("pos", t)):
            buf = b[name]
            fill(buf.ptr + 8 * count, 0, 8 * (buf.shape[0] - count), stream, self.device)
        fill(b["loc"].ptr + 8 * w, 0xFF, 8 * (b["loc"].shape[0] - w), stream, self.device)  # -1: no slot

    def _batch(self, s: int, n: int, t: int, w: int, expected: bool) -> Batch:
        v, rtt = self._view, self.req_to_token
        if self.fixed:  # the whole capacity, the same for every step
            n, t, w = self.buffers["rows"].shape[0], self.buffers["ids"].shape[0], self.buffers["loc"].shape[0]
        rows, cols = rtt.shape
        table = ArrayView(rtt.ptr, (rows, cols), (4 * cols, 4), rtt.dtype, "int32", self.device, False, rtt, s)
        exp = {}
        if expected:
            buf = self.buffers["exp"]
            exp = {"expected_input_ids": v("exp", t, s), "expected_positions": ArrayView(
                buf.ptr + 8 * t, (t,), (8,), buf.dtype, buf.dtype.name, self.device, False, buf, s)}
        return Batch(v("rows", n, s), v("prefix", n, s), v("extend", n, s), table, input_ids=v("ids", t, s),
                     positions=v("pos", t, s), out_cache_loc=v("loc", w, s), **exp)

    def _pack(self, arrays, expected: bool):
        views, wide = self._inputs(arrays, (1, 1, 1, 1, 1, 1, 2, 1, 1))
        cu_q, cu_k, read, write, ids, pos, table, carry, prev = views
        n, rtt = cu_q.shape[0] - 1, self.req_to_token
        if n < 0 or cu_k.shape[0] != n + 1:
            raise ValidationError(f"kv-canary: cu_seq_lens_q and cu_seq_lens_k must hold num_reqs + 1 offsets each, "
                                  f"got {cu_q.shape[0]} and {cu_k.shape[0]}. Fix: pass the step's model inputs")
        t = min(ids.shape[0], pos.shape[0])
        self._fits({"requests": (n, "rows"), "tokens": (t, "ids"), "writes": (write.shape[0], "loc")},
                   "build the stager with the engine's max requests and tokens per batch")
        b, lay = {k: buf.ptr for k, buf in self.buffers.items()}, self.layout
        p = abi.StagePagedParams(
            cu_q=cu_q.ptr, cu_k=cu_k.ptr, read_index=read.ptr, write_index=write.ptr, input_ids=ids.ptr,
            positions=pos.ptr, rows=b["rows"], prefix_lens=b["prefix"], extend_lens=b["extend"],
            req_to_token=rtt.ptr, out_input_ids=b["ids"], out_positions=b["pos"], out_cache_loc=b["loc"],
            rtt_cols=rtt.shape[1], num_reqs=n, num_read=read.shape[0], num_write=write.shape[0], num_tokens=t,
            block_stride=lay.stride, page_size=lay.page_size, num_slots=lay.num_slots, wide=wide,
            expected_ids=b["exp"] if expected else 0)
        if table is not None:
            if table.shape[0] < n:
                raise ValidationError(f"kv-canary: block_table must have a row per request (>= {n}), got shape "
                                      f"{table.shape}. Fix: pass the step's block table (the model's block_table[0])")
            p.block_table, p.table_cols = table.ptr, table.shape[1]
            p.table_stride = table.strides[0] // table.itemsize
        if carry is not None:
            if carry.shape[0] < t:
                raise ValidationError(f"kv-canary: carry_over_ids must cover the step's {t} tokens, got shape "
                                      f"{carry.shape}. Fix: pass the engine's carry_over_ids of the same IO pair")
            p.carry_ids, p.prev_output, p.prev_len = carry.ptr, prev.ptr, prev.shape[0]
        cells = n * rtt.shape[1]  # at most the map's cells are read (a whole index row may be longer)
        work = max(n, t, write.shape[0], min(read.shape[0], cells), 0 if table is None else cells)
        launch = self._launch(p, work)
        launch.keep = (launch.keep, rtt)
        return launch, (n, t, write.shape[0], expected)
