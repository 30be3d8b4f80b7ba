"""The canary :class:`~kvcanary.Batch` of one ``transformers`` continuous-batching step
(:mod:`.transformers_paged`): what the host noted of the scheduled requests after
``prepare_batch_tensors`` (:class:`Scheduled`), and the step's model inputs read where they are:
request lengths from ``cu_seq_lens_q/k``, slots from ``read_index`` (expanded on the device into
the persistent ``req_to_token`` map) and ``write_index``, tokens and positions from the model
inputs. Only the expected tokens come from the host, copied without blocking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import abi
from ..errors import ValidationError
from ..interop.arrays import ArrayView
from ..ops.batch import Batch
from ..runtime import driver, memory, streams
from .paged_stager import PagedBatchStager


@dataclass
class Scheduled:
    """One step's requests as the host noted them: ``requests`` ``[(request_id, past_len, query_len)]``
    in batch order, their RequestStates, the expected tokens and positions of the new tokens in
    order, the longest request (past + query) and the cached tokens read."""

    requests: list = field(default_factory=list)
    states: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    max_len: int = 0
    cached: int = 0


@dataclass
class StepInfo:
    """One engine step as the hooks see it: ``requests`` is ``[(request_id, past_len, query_len)]``
    in batch order, ``states`` the matching RequestState objects, ``batch_data`` the model kwargs
    (device tensors), ``cache`` the PagedAttentionCache, ``batch`` the canary's Batch as torch
    tensors (set for ``after_step``)."""

    step: int
    requests: list
    states: list
    batch_data: dict
    cache: object
    batch: Batch | None = None


def tokens(state, start: int, count: int) -> list[int]:
    """Tokens at positions [start, start + count) of prompt + generated tokens, without concatenating;
    -1 for a position past what the host holds (under async batching the newest token of a decoding
    request is the previous batch's output, carried over on the device before the host sees it)."""
    first = state.initial_tokens
    end = start + count
    if end <= len(first):
        return list(first[start:end])
    head = list(first[start:]) if start < len(first) else []
    out = head + list(state.generated_tokens[max(0, start - len(first)):end - len(first)])
    return out + [-1] * (count - len(out))


class StepBatches:
    """The Batch of each step over one cache :class:`~.transformers_layout.PagedLayout`; the
    ``req_to_token`` map (``rows`` rows: the canary's max_batch + 1) is kept across steps. On a
    CUDA ``device`` the step is staged in one launch (:class:`~.paged_stager.PagedBatchStager`: the same
    values as the torch ops below, which a host canary uses)."""

    def __init__(self, layout, rows: int, device: int | None = None, tokens: int = 256, max_len: int = 0,
                 fixed: bool = False):
        self.layout, self.rows, self.rtt = layout, rows, None
        self.stager = None if device is None else PagedBatchStager(
            layout, max_reqs=rows - 1, max_tokens=tokens, max_writes=tokens, device=device, max_len=max_len,
            fixed=fixed)
        self.torch_batches: dict = {}  # id(staged Batch) -> (it, its torch twin)
        self.host = None if device is None else _PinnedRing(device)  # the expected tokens' staging
        self.pinned: dict = {}  # an engine IO pair -> the pinned buffer its steps' expected tokens are written to
        if self.stager is not None:
            self.stager.expected_buffer(tokens)  # allocated now: a captured step must not allocate

    def req_to_token(self, length: int, like):
        """The persistent int32 [rows + 1, >= length] map, grown (doubling) on the host's say-so only;
        its last row takes the padding reads of a static-shape batch (no request reads it)."""
        import torch  # on first use: torch stays optional (import kvcanary.adapters never imports it)
        if self.rtt is None or self.rtt.shape[1] < length:
            cols = max(length, 2 * (0 if self.rtt is None else self.rtt.shape[1]), 256)
            self.rtt = torch.zeros((self.rows + 1, cols), dtype=torch.int32, device=like.device)
        return self.rtt

    def batch(self, data: dict, pending: Scheduled, check_inputs: bool, carry=None, *, stream=None,
              stage_expected: bool = True) -> Batch:
        """The canary Batch of a step from its model kwargs ``data`` (device tensors) and what the
        host noted of it (``pending``); ``check_inputs``: with the expected tokens and positions.
        A decode-fast-path step (``data["block_table"]``) reads and writes the cache through its
        block table, not ``read_index`` / ``write_index``; a static-shape step (CUDA graphs,
        torch.compile) pads tokens past ``cu_seq_lens_q[n]`` (slot -1 here) and reads past
        ``cu_seq_lens_k[n]`` (left out of the map). A staged Batch holds views of the stager's
        buffers, the same object for every step of a shape (the canary replays its launches without
        keying them); :meth:`as_torch` gives its torch twin. ``carry`` (async batching): ``(carry_over_ids,
        previous output ids)``, token i being ``previous[carry_over_ids[i]]`` where that is in range,
        as the engine's forward takes it; the engine's tensors are never written. ``stream``: where
        a staged step runs (default: torch's current stream); ``stage_expected=False``: the caller
        copied the expected tokens already (:meth:`stage_expected`, before a captured step)."""
        import torch  # on first use, as above
        cu_q, cu_k = data["cu_seq_lens_q"], data["cu_seq_lens_k"]
        if isinstance(cu_k, dict):
            cu_k = cu_k["full_attention"]
        table = data.get("block_table")
        table = None if table is None else table[0]  # the full-attention group's [n, cols] page entries
        if self.stager is not None:
            ids = data["input_ids"][0]
            if stream is None:  # the framework's current stream, as the stager would pick it
                stream = streams.framework_stream((ids,), self.stager.device)
                stream = driver.PER_THREAD_STREAM if stream is None else stream
            if check_inputs and stage_expected:
                self.stage_expected(pending, int(ids.shape[0]), stream)
            return self.stager(
                cu_q=cu_q, cu_k=cu_k, read_index=whole_row(data["read_index"][0]),
                write_index=data["write_index"][0], input_ids=ids, positions=data["position_ids"][0],
                max_len=pending.max_len, block_table=table, carry_over_ids=None if carry is None else carry[0],
                prev_output_ids=None if carry is None else carry[1], expected=check_inputs, stream=stream)
        cu_q, cu_k = cu_q.to(torch.int64), cu_k.to(torch.int64)
        n = int(cu_q.shape[0]) - 1
        extend = cu_q[1:] - cu_q[:-1]
        lens = cu_k[1:] - cu_k[:-1]
        prefix = lens - extend
        read, write = data["read_index"][0], data["write_index"][0]
        rtt = self.req_to_token(pending.max_len, cu_q)
        w = torch.arange(write.numel(), device=write.device)
        loc = torch.full_like(w, abi.SKIP_SLOT)
        if n > 0 and table is None:
            if read.numel():  # request r's read slots, positions 0.., go to row r + 1
                j = torch.arange(read.numel(), device=read.device)
                r = torch.searchsorted(cu_k[1:].contiguous(), j, right=True).clamp_(max=n - 1)
                col = (j - cu_k[r]).clamp_(0, rtt.shape[1] - 1)  # bad lengths: wrong slots, never a device fault
                row = torch.where(j < cu_k[n], r + 1, rtt.shape[0] - 1)  # padding reads: the spare last row
                rtt[row, col] = self.layout.to_slots(read).to(torch.int32)
            loc = torch.where(w < cu_q[n], self.layout.to_slots(write), loc)
        elif n > 0:
            tab = table.to(torch.int64)
            c = torch.arange(rtt.shape[1], device=tab.device)
            r = torch.arange(n, device=tab.device)[:, None]
            cells = self.layout.to_slots(self.table_index(tab, r, c[None, :])).to(torch.int32)
            rtt[1:n + 1] = torch.where(c[None, :] < lens[:, None], cells, rtt[1:n + 1])
            r = torch.searchsorted(cu_q[1:].contiguous(), w, right=True).clamp_(max=n - 1)
            slots = self.layout.to_slots(self.table_index(tab, r, prefix[r] + w - cu_q[r]))
            loc = torch.where(w < cu_q[n], slots, loc)
        ids = data["input_ids"][0].to(torch.int64)
        if carry is not None:
            c, prev = carry[0][:ids.numel()].to(torch.int64), carry[1]
            inside = (c >= 0) & (c < prev.numel())
            ids = torch.where(inside, prev[c.clamp(0, max(prev.numel() - 1, 0))].to(torch.int64), ids)
        pos = data["position_ids"][0].to(torch.int64)
        exp_ids, exp_pos = self.expected(ids, pending) if check_inputs else (None, None)
        return Batch(torch.arange(1, n + 1, device=cu_q.device), prefix, extend, rtt[:self.rows], input_ids=ids,
                     positions=pos, out_cache_loc=loc, expected_input_ids=exp_ids, expected_positions=exp_pos)

    def table_index(self, table, r, pos):
        """Physical cache indices of positions ``pos`` of requests ``r`` (broadcast) in a block table
        of page entries: entry * page_size + pos % page_size, -1 outside the table's columns."""
        import torch  # on first use, as above
        page, cols = self.layout.page_size, table.shape[1]
        blk = torch.div(pos, page, rounding_mode="floor")
        inside = (pos >= 0) & (blk < cols)
        entry = table[r, blk.clamp(0, max(cols - 1, 0))] if cols else torch.zeros_like(pos)
        return torch.where(inside, entry * page + pos - blk * page, torch.full_like(pos, abi.STAGE_NO_INDEX))

    def as_torch(self, batch: Batch) -> Batch:
        """The staged Batch with torch tensors over the stager's buffers (zero-copy, one per shape:
        callbacks see ``info.batch`` as torch tensors, as from the torch path)."""
        import torch  # on first use, as above
        kept = self.torch_batches.get(id(batch))
        if kept is None or kept[0] is not batch:  # a new shape: drop the twins of Batches the stager dropped
            live = {id(b) for b in self.stager.batches.values()}
            self.torch_batches = {k: v for k, v in self.torch_batches.items() if k in live}
            def twin(v):  # a view's owner is the stager's DeviceArray: its leading elements, or a 1-D run
                if not isinstance(v, ArrayView):
                    return v
                start = (v.ptr - v.owner.ptr) // v.itemsize
                if len(v.shape) == 1:
                    return torch.from_dlpack(v.owner)[start:start + v.shape[0]]
                return torch.from_dlpack(v.owner)[tuple(slice(0, n) for n in v.shape)]
            fields = {k: twin(v) for k, v in batch.__dict__.items()}
            kept = self.torch_batches[id(batch)] = (batch, Batch(**fields))
        return kept[1]

    def stage_expected(self, pending: Scheduled, t: int, stream: int) -> None:
        """Copy the step's expected ids and positions (``t`` tokens; 0 past the noted ones, -1 for a
        token the host does not know) into the stager's expected buffer on ``stream`` (a handle),
        from a pinned slot of :attr:`host`: one driver copy, no allocation, never waiting for the stream."""
        buf = self.stager.expected_buffer(t)  # a step of more tokens than ever grows it (never a captured one)
        _fill_expected(self.host.take(2 * t), pending, t, t)
        self.host.send(buf.ptr, 2 * t, stream)

    def pin_expected(self, pairs: int) -> None:
        """Pinned buffers for the expected tokens of ``pairs`` engine IO pairs (allocated now: a
        captured step must not allocate), each the size of the stager's expected buffer."""
        for pair in range(pairs):
            if pair not in self.pinned:
                n = self.stager.buffers["exp"].shape[0]
                self.pinned[pair] = memory.PinnedBuffer((n,), np.int64, self.stager.device)

    def _expected_span(self, t: int) -> int:
        """Where a step of ``t`` tokens' expected positions start (a fixed stager: its capacity)."""
        return self.stager.token_capacity if self.stager.fixed else t

    def write_expected(self, pending: Scheduled, t: int, pair: int) -> None:
        """Write a step's expected ids and positions (as :meth:`stage_expected`; positions from
        :meth:`_expected_span`) into IO pair ``pair``'s pinned buffer, which the step's
        :meth:`copy_expected` (run now, or captured into the engine's graph and run at each replay)
        copies to the device. No driver call. The engine rewrites a pair's own pinned inputs only
        once that pair's previous step has run (its update waits for the step's outputs); this
        buffer is written at the same point."""
        array, at = self.pinned[pair].array, self._expected_span(t)
        if 2 * at > array.shape[0]:  # the stager's token buffers grew past the pinned copy's source
            raise ValidationError(f"kv-canary: a step's expected tokens must fit the pinned buffer its graph copies "
                                  f"from ({array.shape[0] // 2} tokens), got a stager of {at} tokens (a step of "
                                  f"{t} tokens grew it). Fix: build the client with the engine's max_batch_tokens")
        _fill_expected(array, pending, t, at)

    def copy_expected(self, t: int, pair: int, stream: int) -> None:
        """Enqueue (or capture) the copy of pair ``pair``'s expected tokens to the stager's buffer."""
        memory.copy_async(self.stager.buffers["exp"].ptr, self.pinned[pair].ptr, 16 * self._expected_span(t), stream,
                          self.stager.device)

    def shaped(self, data: dict, check_inputs: bool, stream: int) -> Batch | None:
        """The staged Batch of the shape of the model inputs ``data`` on ``stream`` (a step that a
        replayed CUDA graph staged: the Batch its capture staged), None if none was staged."""
        cu_q, ids, pos = data["cu_seq_lens_q"], data["input_ids"][0], data["position_ids"][0]
        shape = (int(cu_q.shape[0]) - 1, min(int(ids.shape[0]), int(pos.shape[0])),
                 int(data["write_index"][0].shape[0]), bool(check_inputs))
        return self.stager.batches.get((self.stager._batch_key(shape), stream))

    @staticmethod
    def expected(ids, pending: Scheduled):
        """(expected ids, expected positions) int64 on the device of ``ids``, one per token of the
        step (0 past the noted ones), from the host's notes; a token the host does not know yet
        (async batching's carried-over tokens) expects what ``ids`` (int64) holds."""
        import torch  # on first use, as above
        t = int(ids.shape[0])
        # A copy from pageable memory to a CUDA device waits for the stream (the host stalls
        # behind the previous step's forward): stage in pinned memory and copy asynchronously.
        # torch's pinned allocator reuses the block only once the copy is done.
        cuda = ids.device.type == "cuda"
        exp = torch.zeros((2, t), dtype=torch.int64, pin_memory=cuda)
        m = min(t, len(pending.ids))
        exp[0, :m] = torch.tensor(pending.ids[:m], dtype=torch.int64)
        exp[1, :m] = torch.tensor(pending.positions[:m], dtype=torch.int64)
        exp = exp.to(ids.device, non_blocking=cuda)
        if -1 in pending.ids[:m]:  # async batching's carried-over tokens
            return torch.where(exp[0] < 0, ids, exp[0]), exp[1]
        return exp[0], exp[1]


def _fill_expected(array, pending: Scheduled, t: int, at: int) -> None:
    """A step's expected ids ``[0, t)`` and positions ``[at, at + t)`` into ``array`` (0 past the
    noted tokens, up to ``at`` and ``2 at``; -1 for a token the host does not know)."""
    m = min(t, len(pending.ids))
    array[:m] = pending.ids[:m]
    array[m:at] = 0
    array[at:at + m] = pending.positions[:m]
    array[at + m:2 * at] = 0


def whole_row(index):
    """The whole storage row of an engine's index tensor from its start (a 1-D contiguous view): the
    stager reads only the step's entries (``cu_seq_lens_k[n]``, on the device), so every step has
    one layout. An empty index (no cached reads) stays empty."""
    if type(index).__module__.split(".")[0] != "torch" or not index.numel() or not index.is_contiguous():
        return index
    rest = index.untyped_storage().nbytes() // index.element_size() - index.storage_offset()
    return index.as_strided((rest,), (1,))


class _PinnedRing:
    """Pinned int64 host buffers the expected tokens are staged in, used in turn; a buffer is
    reused once the copy that last read it has run (its event), so a copy in flight is never
    overwritten, and nothing is allocated per step (kvcanary's driver layer: a copy and an event
    record are two driver calls, no torch op)."""

    DEPTH = 4

    def __init__(self, device: int):
        self.device, self.size, self.turn = device, 0, -1
        self.buffers: list = []
        self.events: list = []

    def take(self, n: int):
        """The numpy view of a free pinned buffer of >= n elements."""
        if n > self.size:
            for event in self.events:  # the old buffers' copies have run before they go (a rare growth)
                if event is not None:
                    event.synchronize()
            self.size = max(n, 2 * self.size, 1024)
            self.buffers = [memory.PinnedBuffer((self.size,), np.int64, self.device) for _ in range(self.DEPTH)]
            self.events = [None] * self.DEPTH
        self.turn = (self.turn + 1) % self.DEPTH
        event = self.events[self.turn]
        if event is not None:
            event.synchronize()  # the copy DEPTH steps ago: long done
        return self.buffers[self.turn].array

    def send(self, dst: int, n: int, stream: int) -> None:
        """Copy the first ``n`` elements of the buffer last taken to ``dst`` on ``stream``."""
        memory.copy_async(dst, self.buffers[self.turn].ptr, 8 * n, stream, self.device)
        event = self.events[self.turn]
        if event is None:
            event = self.events[self.turn] = memory.Event(self.device)
        event.record(stream)
