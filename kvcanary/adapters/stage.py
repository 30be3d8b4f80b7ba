"""An engine's step staged on the device into persistent Batch buffers: one launch per step
(kernels_src/stage.cu) instead of an adapter's framework ops.

An adapter that builds the canary's :class:`~kvcanary.Batch` with framework ops pays a launch's
host time for each and hands the canary new tensors every step to key. A stager does the same in
one kernel into buffers it owns and hands back the same Batch object for every step of one shape,
so the canary's launches replay without keying and a captured CUDA graph keeps every address. The
Batch's views name the stream the step was staged on (a canary step given no stream runs there).

- :class:`VllmBatchStager`: vLLM attention metadata, the values of :func:`~.vllm.vllm_batch`;
- :class:`PagedBatchStager`: cumulative query / key lengths and physical cache indices (transformers
  continuous batching), the values of :class:`~.transformers_batch.StepBatches`' torch path.

Per call the engine's arrays are keyed (layout and address), validated once per layout (int32 or
int64, on the stager's device, contiguous, covering what the kernel reads) and the packed launch
replayed with their addresses on the caller's stream (explicit, else the framework's current one).
Nothing is read back to the host; values are not checked: a wrong length or index becomes a wrong
slot in the Batch, which the canary bound-checks and reports.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .. import abi
from ..errors import ValidationError, ValidationTypeError
from ..interop.arrays import ArrayView, as_view
from ..ops.batch import Batch
from ..ops.packing import KEPT, PackCache, arg_keys
from ..ops.sources import resolved
from ..runtime import driver, memory, streams
from ..runtime.launch import Launch
from ..validate import integer
from .vllm import step_requests

_INT = ("int32", "int64")


class _Stager:
    """The keying, packing and replay of one staging kernel into int64 buffers it owns."""

    KERNEL = ""
    INPUTS: tuple[str, ...] = ()
    OPTIONAL: frozenset = frozenset()  # inputs that may be None (a NULL pointer for the kernel)
    SCALARS: tuple[str, ...] = ()

    def __init__(self, device: int, sizes: dict):
        self.device = integer("device", device, lo=0, fix="pass a CUDA device ordinal")
        self.rt = driver.runtime(self.device)
        self.rt.functions.library(abi.family_of(self.KERNEL))  # loaded now, never in a stream capture of a step
        self.buffers = {name: memory.zeros((n,), np.int64, self.device) for name, n in sizes.items()}
        self.packed = PackCache(KEPT)
        self.batches: OrderedDict = OrderedDict()  # the shape of a step -> its Batch of views
        self.launches = 0

    def _stage(self, arrays, scalars, stream, expected_input_ids=None, expected_positions=None) -> Batch:
        objs = (*arrays, *scalars)
        key, ptrs, _ = arg_keys(objs)
        with self.packed.lock:  # a replay patches the shared params: patch and launch under it
            entry = None if key is None else self.packed.get(key, ptrs)
            if entry is None:
                launch, shape = self._pack(arrays, *scalars)
                if key is not None:  # else not keyable: validated and packed every call
                    self.packed.put(key, [launch], objs, ptrs, (*self.INPUTS, *self.SCALARS), extra=shape)
            else:
                launch, shape = entry.launches[0], entry.extra
            s = streams.stream_handle(stream) if stream is not None else streams.framework_stream(arrays, self.device)
            s = driver.PER_THREAD_STREAM if s is None else s
            launch.go(s)
            self.launches += 1
        batch = self.batches.get((shape, s))
        if batch is None:  # its views name the stream: a canary step given no stream runs there too
            batch = self.batches[(shape, s)] = self._batch(s, *shape)
            while len(self.batches) > KEPT:
                self.batches.popitem(last=False)
        if expected_input_ids is None and expected_positions is None:
            return batch
        return Batch(**{**batch.__dict__, "expected_input_ids": expected_input_ids,
                        "expected_positions": expected_positions})

    def _view(self, name: str, n: int, stream: int) -> ArrayView:
        buf = self.buffers[name]
        return ArrayView(buf.ptr, (n,), (8,), buf.dtype, buf.dtype.name, self.device, False, buf, stream)

    def _inputs(self, arrays, ndims) -> tuple[list[ArrayView], int]:
        """The validated views of the engine's arrays and the kernel's int64 bit mask."""
        views, wide = [], 0
        for i, (a, name, want) in enumerate(zip(arrays, self.INPUTS, ndims)):
            if a is None and name in self.OPTIONAL:
                views.append(None)
                continue
            v = resolved(as_view(a, name=name))
            if v.dtype_name not in _INT:
                raise ValidationTypeError(f"kv-canary: {name} must be int32 or int64, got {v.dtype_name}. Fix: pass "
                                          f"the engine's own {name}")
            if v.ndim != want or (v.numel and v.strides[-1] != v.itemsize):
                raise ValidationError(f"kv-canary: {name} must be a {want}-D array with contiguous "
                                      f"{'rows' if want == 2 else 'elements'}, got shape {v.shape}, strides "
                                      f"{v.strides}. Fix: pass the engine's {name} (or .contiguous())")
            if v.device != self.device:
                raise ValidationError(f"kv-canary: {name} must live on cuda:{self.device} (the stager's device), "
                                      f"got {v.describe()}. Fix: build the stager with device={v.device}")
            views.append(v)
            wide |= int(v.itemsize == 8) << i
        return views, wide

    def _launch(self, params, work: int) -> Launch:
        grid = max(1, min(self.rt.resident_blocks(self.KERNEL, abi.BLOCK_THREADS), -(-work // abi.BLOCK_THREADS)))
        return Launch(self.rt, self.KERNEL, grid, abi.BLOCK_THREADS, params, driver.PER_THREAD_STREAM,
                      tuple(self.buffers.values()))

    def _fits(self, what: dict, fix: str) -> None:
        over = {k: (n, self.buffers[b].shape[0]) for k, (n, b) in what.items() if n > self.buffers[b].shape[0]}
        if over:
            got = ", ".join(f"{k}={n} (capacity {cap})" for k, (n, cap) in over.items())
            raise ValidationError(f"kv-canary: a step of {got} does not fit the {type(self).__name__}. Fix: {fix}")

    def _batch(self, stream: int, *shape) -> Batch:
        raise NotImplementedError

    def _pack(self, arrays, *scalars):
        raise NotImplementedError


class VllmBatchStager(_Stager):
    """Persistent device buffers of the Batch of one vLLM KV cache group, filled by one launch per
    step from that step's attention metadata (module docstring). ``max_reqs`` / ``max_tokens``
    bound a step's requests and new tokens, ``max_len`` is the width of ``req_to_token`` (each
    request's length must fit; at most the block table's ``max_blocks * block_size``),
    ``block_size`` the cache's tokens per block; the buffers live on ``device``. ``launches``
    counts the staging launches made."""

    KERNEL = "kvc_stage_vllm"
    INPUTS = abi.STAGE_VLLM_INPUTS
    SCALARS = ("num_reqs", "num_tokens")

    def __init__(self, *, max_reqs: int, max_tokens: int, max_len: int, block_size: int, device: int = 0):
        self.max_reqs = integer("max_reqs", max_reqs, lo=1, fix="pass the most requests a step schedules")
        self.max_tokens = integer("max_tokens", max_tokens, lo=1, fix="pass the most tokens a step schedules")
        self.max_len = integer("max_len", max_len, lo=1, fix="pass the longest request length (max_model_len)")
        self.block_size = integer("block_size", block_size, lo=1, fix="pass the cache's tokens per block, e.g. 16")
        super().__init__(device, {"rows": self.max_reqs, "prefix": self.max_reqs, "extend": self.max_reqs,
                                  "ids": self.max_tokens, "pos": self.max_tokens, "loc": self.max_tokens})
        self.req_to_token = memory.zeros((self.max_reqs + 1, self.max_len), np.int32, self.device)

    def __call__(self, *, block_table, seq_lens, query_start_loc, slot_mapping, input_ids, positions,
                 num_reqs: int | None = None, num_tokens: int | None = None, expected_input_ids=None,
                 expected_positions=None, stream=None) -> Batch:
        """The step's Batch (views of the stager's buffers), staged on ``stream``. Arguments as
        :func:`~.vllm.vllm_batch`'s: ``num_reqs`` / ``num_tokens`` trim padded metadata (default:
        the rows of the block table and query starts, the tokens of the three token arrays)."""
        return self._stage((block_table, seq_lens, query_start_loc, slot_mapping, input_ids, positions),
                           (num_reqs, num_tokens), stream, expected_input_ids, expected_positions)

    def _batch(self, s: int, n: int, t: int) -> Batch:
        v, rtt = self._view, self.req_to_token
        table = ArrayView(rtt.ptr, (n + 1, self.max_len), (4 * self.max_len, 4), rtt.dtype, "int32", self.device,
                          False, rtt, s)
        return Batch(v("rows", n, s), v("prefix", n, s), v("extend", n, s), table, input_ids=v("ids", t, s),
                     positions=v("pos", t, s), out_cache_loc=v("loc", t, s))

    def _pack(self, arrays, num_reqs, num_tokens):
        """The validated launch of one metadata layout, and the step's (requests, tokens)."""
        views, wide = self._inputs(arrays, (2, 1, 1, 1, 1, 1))
        bt, seq, qsl, *tok = views
        n = step_requests(bt.shape[0], qsl.shape[0], num_reqs)
        if seq.shape[0] < n:  # as block_table_to_req_to_token refuses it
            raise ValidationError(f"kv-canary: seq_lens must have one length per request (>= {n}), got "
                                  f"{seq.shape[0]}. Fix: pass the seq_lens of the same step")
        have = min(x.shape[0] for x in tok)
        t = have if num_tokens is None else integer("num_tokens", num_tokens, lo=0, hi=have,
                                                    fix=f"pass at most the {have} tokens given")
        self._fits({"requests": (n, "rows"), "tokens": (t, "ids")},
                   "build the VllmBatchStager with the scheduler's max_num_seqs and max_num_batched_tokens")
        if self.max_len > bt.shape[1] * self.block_size:
            raise ValidationError(f"kv-canary: the stager's max_len={self.max_len} exceeds what the block table maps "
                                  f"({bt.shape[1]} blocks x block_size {self.block_size}). Fix: build the stager with "
                                  f"max_len <= {bt.shape[1] * self.block_size}, or pass the full block table")
        b = {k: buf.ptr for k, buf in self.buffers.items()}
        p = abi.StageVllmParams(
            block_table=bt.ptr, seq_lens=seq.ptr, query_start_loc=qsl.ptr, slot_mapping=tok[0].ptr,
            input_ids=tok[1].ptr, positions=tok[2].ptr, rows=b["rows"], prefix_lens=b["prefix"],
            extend_lens=b["extend"], req_to_token=self.req_to_token.ptr, out_input_ids=b["ids"],
            out_positions=b["pos"], out_cache_loc=b["loc"], block_table_stride=bt.strides[0] // bt.itemsize,
            num_reqs=n, num_tokens=t, block_size=self.block_size, max_len=self.max_len, wide=wide)
        launch = self._launch(p, max(n + 1, t, (n + 1) * self.max_len))
        launch.keep = (launch.keep, self.req_to_token)
        return launch, (n, t)


class PagedBatchStager(_Stager):
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
    longest request is: ``max_len``); more than ``max_reqs`` requests are refused. A step of one
    shape returns the same Batch."""

    KERNEL = "kvc_stage_paged"
    INPUTS = abi.STAGE_PAGED_INPUTS
    OPTIONAL = frozenset({"block_table", "carry_over_ids", "prev_output_ids"})
    SCALARS = ("expected",)

    def __init__(self, layout, *, max_reqs: int, max_tokens: int, max_writes: int, device: int = 0):
        self.layout = layout
        max_reqs = integer("max_reqs", max_reqs, lo=1, fix="pass the most requests a step schedules")
        max_tokens = integer("max_tokens", max_tokens, lo=1, fix="pass the most tokens a step schedules")
        max_writes = integer("max_writes", max_writes, lo=1, fix="pass the most tokens a step writes")
        super().__init__(device, {"rows": max_reqs, "prefix": max_reqs, "extend": max_reqs, "ids": max_tokens,
                                  "pos": max_tokens, "exp": 2 * max_tokens, "loc": max_writes})
        self.map_rows, self.req_to_token = max_reqs + 1, None  # the map: allocated by the first step

    def expected_buffer(self, tokens: int) -> memory.DeviceArray:
        """The int64 buffer of a step's expected ids ``[0, tokens)`` and positions ``[tokens, 2 tokens)``."""
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
        self.packed, self.batches = PackCache(KEPT), OrderedDict()

    def _batch(self, s: int, n: int, t: int, w: int, expected: bool) -> Batch:
        v, rtt = self._view, self.req_to_token
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
