"""The vLLM connector's step bookkeeping, free of vLLM (:mod:`.vllm_connector` wires it in).

- :class:`SchedulerNotes` (scheduler process): from each ``SchedulerOutput``, what the workers need
  to build the canary's batch and cannot know themselves — each scheduled request's new blocks,
  computed tokens, scheduled tokens and the token ids of the scheduled positions (only those: a
  prompt travels once, chunk by chunk). A token the scheduler does not know yet (async scheduling's
  newest decode token, a placeholder draft) is ``-1``.
- :class:`WorkerSteps` (each worker): a request-pool row per request and a host mirror of its
  block ids; per step one packed int64 array (rows, lengths, tokens, positions, slots) and the
  ``req_to_token`` cells of new blocks, copied to the device from pinned memory (two copies), one
  scatter of the new cells, and a :class:`~kvcanary.Batch` of views that stays the same object for
  every step of one shape (the canary replays its launches without keying anything).

Nothing here reads vLLM internals: only the fields ``build_connector_meta`` is handed. Values are
not checked on the host: a wrong block id or length becomes a wrong slot, which the canary's
kernels bound-check and report. Positions past the mirror's columns are clipped into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..ops.batch import Batch


@dataclass
class StepNotes:
    """One scheduled step as the workers need it, in batch order (new requests first: the first
    ``fresh`` of ``ids``, new or resumed after preemption). ``blocks``: ``(batch index, block ids)``
    for every fresh request (its whole list, replacing what the worker had) and every other request
    that got blocks this step (appended). ``computed``: tokens before the step. ``scheduled``: tokens
    this step, or None when every request has one (a decode step). ``tokens``: the scheduled
    positions' ids request after request (``-1``: not sent), or None when none is sent.
    ``dropped``: finished or preempted requests, whose rows the worker frees first."""

    dropped: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    fresh: int = 0
    computed: list = field(default_factory=list)
    scheduled: list | None = None
    tokens: list | None = None


class SchedulerNotes:
    """Scheduler side: keeps the live requests (``add`` from ``on_new_request``, ``drop`` from
    ``request_finished``) and turns a ``SchedulerOutput`` into :class:`StepNotes`.

    Token ids are sent where they cost a slice per request: the prompt chunks of new and resumed
    requests and the multi-token steps of running ones (a chunked prefill's next chunk, drafts). A
    decode step's token is sent as unknown (``-1``): under async scheduling (vLLM's default) the
    scheduler does not know it yet, and without it reading it costs two Python-level lookups per
    request per step (about 70 us at 256 requests). The record of a generated token then holds -1
    as its token; its position, hash chain and KV fingerprint are checked as any other."""

    def __init__(self):
        self.requests: dict = {}

    def add(self, request) -> None:
        self.requests[request.request_id] = request

    def drop(self, request_id) -> None:
        self.requests.pop(request_id, None)

    def build(self, out) -> StepNotes:
        """The notes of ``out`` (a ``SchedulerOutput``, before the scheduler advances its requests'
        computed tokens)."""
        new, cached = out.scheduled_new_reqs, out.scheduled_cached_reqs
        counts, drafts = out.num_scheduled_tokens, out.scheduled_spec_decode_tokens
        dropped = list(out.finished_req_ids)
        if out.preempted_req_ids:
            dropped += out.preempted_req_ids
        fresh = len(new)
        ids = [r.req_id for r in new] + cached.req_ids
        blocks = [(i, r.block_ids[0]) for i, r in enumerate(new)]
        blocks += [(i, b[0]) for i, b in enumerate(cached.new_block_ids, fresh) if b is not None and b[0]]
        computed = [r.num_computed_tokens for r in new] + cached.num_computed_tokens
        if out.total_num_scheduled_tokens == len(ids) and not fresh:
            return StepNotes(dropped, ids, blocks, 0, computed, None, None)
        scheduled = [counts[r] for r in ids]
        tokens: list = []
        for r in new:
            _extend(tokens, r.prefill_token_ids, r.num_computed_tokens, counts[r.req_id], drafts.get(r.req_id))
        requests = self.requests
        for rid, nc, n in zip(cached.req_ids, cached.num_computed_tokens, scheduled[fresh:]):
            if n == 1:
                tokens.append(-1)
            else:
                _extend(tokens, requests[rid].all_token_ids, nc, n, drafts.get(rid))
        return StepNotes(dropped, ids, blocks, fresh, computed, scheduled, tokens)


def _extend(tokens: list, known, start: int, n: int, drafts) -> None:
    """Append the ids of positions [start, start + n): the known ones, then the scheduled drafts,
    then -1 for any the scheduler does not hold yet."""
    part = list(known[start:start + n])
    if len(part) < n and drafts:
        part += list(drafts[:n - len(part)])
    tokens += part
    if len(part) < n:
        tokens += [-1] * (n - len(part))


class WorkerSteps:
    """Worker side: rows, block mirror and the per-step :class:`~kvcanary.Batch` (module docstring).
    ``device``: a CUDA ordinal (torch tensors on it) or None (numpy arrays, the host canary).
    ``max_len``: the ``req_to_token`` columns (>= max_model_len plus drafts, a block multiple)."""

    def __init__(self, *, block_size: int, max_len: int, rows: int, device: int | None):
        self.block_size, self.device = block_size, device
        self.max_blocks = -(-max_len // block_size)
        self.max_len = self.max_blocks * block_size
        self.row_of: dict = {}
        self.free: list = []
        self.table = np.zeros((0, self.max_blocks), np.int32)  # host mirror: row -> block ids
        self.nblocks = np.zeros(0, np.int64)
        self.rtt = None
        self.batches: dict = {}  # (bs, tokens) -> Batch of views into `self.staged`
        self.staged = None       # the step buffer those views are of
        self.host = None
        self.within = np.arange(block_size, dtype=np.int64)
        self.ring = None if device is None else _DeviceSteps(device, 3 * rows + 3 * 4096, 4096)
        self.ids: list = []      # the last step's request ids, in batch order
        self.rows = np.zeros(0, np.int64)  # and their rows
        self._grow(rows)

    # ---- rows and blocks ----------------------------------------------------------------------
    def _grow(self, rows: int) -> None:
        """Room for ``rows`` request rows (row 0 stays the padding row); the device map grows too."""
        old = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros((rows + 1 - old, self.max_blocks), np.int32)])
        self.nblocks = np.concatenate([self.nblocks, np.zeros(rows + 1 - old, np.int64)])
        self.free += range(rows, max(old, 1) - 1, -1)
        rtt = self._zeros((rows + 2, self.max_len), "int32")  # the last row: a spare cell for padded writes
        if self.rtt is not None:
            rtt[:old] = self.rtt[:old]
        self.rtt, self.rtt_rows = rtt, rtt[:rows + 1]
        self.rtt_flat = rtt.reshape(-1) if self.device is None else rtt.view(-1)
        self.batches.clear()

    def _row(self, rid) -> int:
        row = self.row_of.get(rid)
        if row is None:
            if not self.free:
                self._grow(2 * (self.table.shape[0] - 1))
            row = self.row_of[rid] = self.free.pop()
            self.nblocks[row] = 0
        return row

    def apply(self, notes: StepNotes):
        """Take the step's notes: free dropped rows, place new blocks. Returns (rows int64 [n], the new
        blocks as (row, first block index, count) triples). The rows of a step with the same requests
        in the same order as the last one are the last ones."""
        for rid in notes.dropped:
            row = self.row_of.pop(rid, None)
            if row is not None:
                self.free.append(row)
        if notes.fresh or notes.dropped or notes.ids != self.ids:
            row_of, make = self.row_of, self._row
            self.rows = np.array([row_of.get(r) or make(r) for r in notes.ids], np.int64)
        self.ids = notes.ids
        table, nblocks, rows, placed = self.table, self.nblocks, self.rows, []
        fresh, cols = notes.fresh, self.max_blocks
        for i, blk in notes.blocks:
            row = int(rows[i])
            k0 = 0 if i < fresh else int(nblocks[row])  # fresh: its block list starts again
            k = min(len(blk), cols - k0)  # past the columns: an engine bug, reported as bad slots
            if k == 1:
                table[row, k0] = blk[0]
            else:
                table[row, k0:k0 + k] = blk[:k]
            nblocks[row] = k0 + k
            placed.append((row, k0, k))
        return rows, placed

    # ---- the step's Batch -----------------------------------------------------------------------
    def batch(self, notes: StepNotes, stream=None) -> Batch | None:
        """The canary Batch of the step (None for a step without requests), staged on ``stream``."""
        rows, placed = self.apply(notes)
        n = rows.shape[0]
        if n == 0:
            return None
        bsz = self.block_size
        computed = np.asarray(notes.computed, np.int64)
        if notes.scheduled is None:  # decode: one token a request, at position `computed`
            t, extend, pos, tok_rows = n, 1, computed, rows
        else:
            extend = np.asarray(notes.scheduled, np.int64)
            t = int(extend.sum())
            pos = np.repeat(computed - (np.cumsum(extend) - extend), extend) + np.arange(t, dtype=np.int64)
            tok_rows = np.repeat(rows, extend)
        loc = self.table[tok_rows, np.minimum(pos // bsz, self.max_blocks - 1)] * bsz + pos % bsz
        cells, vals = self._cells(placed)
        u = cells.shape[0]
        words = 3 * n + 3 * t
        buf = self._host(words) if self.device is None else self.ring.take(words)
        o = 3 * n
        buf[:n], buf[n:2 * n], buf[2 * n:o] = rows, computed, extend
        tokens = notes.tokens
        if tokens is None:
            buf[o:o + t] = -1
        else:
            buf[o:o + t] = tokens[:t] if len(tokens) >= t else tokens + [-1] * (t - len(tokens))
        buf[o + t:o + 2 * t], buf[o + 2 * t:words] = pos, loc
        return self._stage(buf, words, n, t, cells, vals, stream)

    def _cells(self, placed):
        """The ``req_to_token`` cells (flat indices) of the placed blocks and their slots."""
        if not placed:
            return _EMPTY, _EMPTY
        bsz = self.block_size
        p = np.asarray(placed, np.int64)
        if p.shape[0] == int(p[:, 2].sum()):  # one block each (decode): no expansion of the counts
            row, first = p[:, 0], p[:, 1]
        else:
            count = p[:, 2]
            row = np.repeat(p[:, 0], count)
            first = np.repeat(p[:, 1] - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
        within = self.within
        cells = (row * self.max_len + first * bsz)[:, None] + within
        vals = self.table[row, first][:, None] * bsz + within
        return cells.reshape(-1), vals.reshape(-1)

    def _host(self, size: int):
        """The host canary's step buffer, of at least ``size`` int64 words (its views are the Batch's)."""
        if self.host is None or self.host.shape[0] < size:
            self.host = np.zeros(max(size, 2 * (0 if self.host is None else self.host.shape[0]), 4096), np.int64)
        return self.host

    def _stage(self, buf, words: int, n: int, t: int, cells, vals, stream):
        o, u = 3 * n, cells.shape[0]
        if self.device is None:
            if u:
                self.rtt_flat[cells] = vals
            dev = buf
        else:
            dev = self.ring.send(buf, words, cells, vals, self.rtt_flat, stream)
        if dev is not self.staged:  # a new (larger) step buffer: the views of the old one go
            self.batches.clear()
            self.staged = dev
        batch = self.batches.get((n, t))
        if batch is None:
            batch = self.batches[(n, t)] = Batch(dev[:n], dev[n:2 * n], dev[2 * n:o], self.rtt_rows,
                                              input_ids=dev[o:o + t], positions=dev[o + t:o + 2 * t],
                                              out_cache_loc=dev[o + 2 * t:o + 3 * t])
        return batch

    def _zeros(self, shape, dtype: str):
        if self.device is None:
            return np.zeros(shape, dtype)
        import torch
        return torch.zeros(shape, dtype=getattr(torch, dtype), device=f"cuda:{self.device}")


_EMPTY = np.zeros(0, np.int64)


class _DeviceSteps:
    """CUDA staging of :class:`WorkerSteps`: ``DEPTH`` pinned host buffers used in turn (one is reused
    once the copies that read it have run: its event, recorded after them), a device int64 buffer of
    ``words`` step words followed by the cells region, and per capacity class of cells one int32
    (index, value) view pair into that region. A step is one copy of its step words, one copy of its
    cells region (padded to the class with writes of 0 to a spare cell past the map's rows), and one
    scatter: three stream operations whatever the batch."""

    DEPTH = 4

    def __init__(self, device: int, words: int, cells: int):
        self.device, self.words, self.cells = device, words, 0
        self.turn, self.events, self.host = -1, [], []
        self.dev = self.views = None
        self._alloc(words, cells)

    def _alloc(self, words: int, cells: int) -> None:
        import torch
        from ..runtime import memory
        self.words, self.cells = max(words, self.words), max(cells, self.cells)
        total = self.words + self.cells
        for event in self.events:  # the old buffers' copies have run before they go (a rare growth)
            if event is not None:
                event.synchronize()
        self.host = [memory.PinnedBuffer((total,), np.int64, self.device) for _ in range(self.DEPTH)]
        self.events = [None] * self.DEPTH
        self.dev = torch.zeros(total, dtype=torch.int64, device=f"cuda:{self.device}")
        self.views = {}

    def take(self, size: int):
        """A free host buffer of at least ``size`` step words (its numpy view)."""
        if size > self.words:
            self._alloc(2 * size, self.cells)
        self.turn = (self.turn + 1) % self.DEPTH
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()  # the copies 4 steps ago: long done
        return self.host[self.turn].array

    def send(self, buf, size: int, cells, vals, rtt_flat, stream):
        """Copy the step words (and the cells, scattered into ``rtt_flat``) on ``stream``; the device buffer."""
        import torch
        from ..runtime import memory
        u = cells.shape[0]
        if u > self.cells:  # more new cells than ever: a larger region (the step words already written stay)
            old = buf[:size].copy()
            self._alloc(self.words, 2 * u)
            buf = self.take(size)
            buf[:size] = old
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        h = int(stream.cuda_stream) if hasattr(stream, "cuda_stream") else int(stream)
        host = self.host[self.turn]
        memory.copy_async(self.dev.data_ptr(), host.ptr, 8 * size, h, self.device)
        if u:
            c = 256
            while c < u:
                c *= 2
            c = min(c, self.cells)
            pairs = buf[self.words:self.words + c].view(np.int32)
            pairs[:u], pairs[c:c + u] = cells, vals
            pairs[u:c], pairs[c + u:2 * c] = rtt_flat.numel() - 1, 0  # the spare cell
            memory.copy_async(self.dev.data_ptr() + 8 * self.words, host.ptr + 8 * self.words, 8 * c, h, self.device)
            view = self.views.get(c)
            if view is None:
                region = self.dev[self.words:self.words + c].view(torch.int32)
                view = self.views[c] = (region[:c], region[c:])
            rtt_flat.index_put_((view[0],), view[1])
        if self.events[self.turn] is None:
            self.events[self.turn] = memory.Event(self.device)
        self.events[self.turn].record(h)
        return self.dev
