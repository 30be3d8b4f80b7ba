"""The canary :class:`~kvcanary.Batch` of one ``transformers`` continuous-batching step
(:mod:`.transformers_paged`): what the host noted of the scheduled requests after
``prepare_batch_tensors`` (:class:`Scheduled`), and the step's model inputs read where they are:
request lengths from ``cu_seq_lens_q/k``, slots from ``read_index`` (expanded on the device into
the persistent ``req_to_token`` map) and ``write_index``, tokens and positions from the model
inputs. Only the expected tokens come from the host, copied without blocking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import abi
from ..arrays import ArrayView
from ..plan import Batch
from .stage import PagedBatchStager


@dataclass
class Scheduled:
    """One step's requests as the host noted them: ``requests`` ``[(request_id, past_len, query_len)]``
    in batch order, their RequestStates, the expected tokens and positions of the new tokens in
    order, and the longest request (past + query)."""

    requests: list = field(default_factory=list)
    states: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    max_len: int = 0
    unknown: int = 0  # tokens the host does not know yet (-1 in ids): async batching's carried-over tokens


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
    CUDA ``device`` the step is staged in one launch (:class:`~.stage.PagedBatchStager`: the same
    values as the torch ops below, which a host canary uses)."""

    def __init__(self, layout, rows: int, device: int | None = None, tokens: int = 256):
        self.layout, self.rows, self.rtt = layout, rows, None
        self.stager = None if device is None else PagedBatchStager(layout, max_reqs=rows - 1, max_tokens=tokens,
                                                                   max_writes=tokens, device=device)
        self.torch_batches: dict = {}  # id(staged Batch) -> (it, its torch twin)

    def req_to_token(self, length: int, like):
        """The persistent int32 [rows + 1, >= length] map, grown (doubling) on the host's say-so only;
        its last row takes the padding reads of a static-shape batch (no request reads it)."""
        import torch  # on first use: torch stays optional (import kvcanary.adapters never imports it)
        if self.rtt is None or self.rtt.shape[1] < length:
            cols = max(length, 2 * (0 if self.rtt is None else self.rtt.shape[1]), 256)
            self.rtt = torch.zeros((self.rows + 1, cols), dtype=torch.int32, device=like.device)
        return self.rtt

    def batch(self, data: dict, pending: Scheduled, check_inputs: bool) -> Batch:
        """The canary Batch of a step from its model kwargs ``data`` (device tensors) and what the
        host noted of it (``pending``); ``check_inputs``: with the expected tokens and positions.
        A decode-fast-path step (``data["block_table"]``) reads and writes the cache through its
        block table, not ``read_index`` / ``write_index``; a static-shape step (CUDA graphs,
        torch.compile) pads tokens past ``cu_seq_lens_q[n]`` (slot -1 here) and reads past
        ``cu_seq_lens_k[n]`` (left out of the map)."""
        import torch  # on first use, as above
        cu_q, cu_k = data["cu_seq_lens_q"], data["cu_seq_lens_k"]
        if isinstance(cu_k, dict):
            cu_k = cu_k["full_attention"]
        table = data.get("block_table")
        table = None if table is None else table[0]  # the full-attention group's [n, cols] page entries
        if self.stager is not None:
            ids = data["input_ids"][0]
            staged = self.as_torch(self.stager(cu_q=cu_q, cu_k=cu_k, read_index=data["read_index"][0],
                                               write_index=data["write_index"][0], input_ids=ids,
                                               positions=data["position_ids"][0], max_len=pending.max_len,
                                               block_table=table))
            if not check_inputs:
                return staged
            exp_ids, exp_pos = self.expected(staged.input_ids, pending)
            return Batch(**{**staged.__dict__, "expected_input_ids": exp_ids, "expected_positions": exp_pos})
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
            def twin(v):  # a view's owner is the stager's DeviceArray; the view is its leading elements
                if not isinstance(v, ArrayView):
                    return v
                return torch.from_dlpack(v.owner)[tuple(slice(0, n) for n in v.shape)]
            fields = {k: twin(v) for k, v in batch.__dict__.items()}
            kept = self.torch_batches[id(batch)] = (batch, Batch(**fields))
        return kept[1]

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
        if pending.unknown:
            return torch.where(exp[0] < 0, ids, exp[0]), exp[1]
        return exp[0], exp[1]
