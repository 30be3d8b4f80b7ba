"""The CPU reference of the plan builder and the fused verify (docs/format.md §8): the executable spec of
kernels_src/plan.cu (kvc_prepare, kvc_expand) and of how kvc_fused_verify derives its entries.

Inputs are numpy arrays shaped and typed like the kernels' (batch int64 ``[bs]``, req_to_token
int32 ``[rows, max_len]``, plan arrays of StepPlan). Batch values are device data here: anything
out of range is handled as the kernels handle it (a BATCH_INDEX_OUT_OF_RANGE row through the
sink, the request rejected), never raised and never used to index. This module imports only
numpy and kvcanary; never CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvcanary.abi import (CHAIN_HEAD, MAX_REQUEST_TOKENS, NO_EXPECTED_TOKEN, NO_REQUEST, NO_SLOT, PADDING_SLOT,
                          PREV_ON_PADDING, RING_COLS, SEED_INVALID, SWA_UNMAPPED, BatchField, FailReason)
from kvcanary.reference.canary import RefSource, _rows, check_entries, owners

_BATCH = int(FailReason.BATCH_INDEX_OUT_OF_RANGE)
Report = Callable[[np.ndarray], None]  # appends ring rows (reference.ring_append bound to a sink)


@dataclass
class Requests:
    """The batch's requests checked against req_to_token's size, as ``kvc_request`` reads them."""

    row: np.ndarray     # request-pool row (meaningful where ok)
    ok: np.ndarray      # a real request whose values are all in range
    lo: np.ndarray      # first verified position
    n: np.ndarray       # verified positions [lo, lo + n)
    prefix: np.ndarray  # cached tokens (0 unless ok)
    tokens: np.ndarray  # new tokens the request owns in the flat arrays
    field: np.ndarray   # the first out-of-range value's BatchField (0: none)
    value: np.ndarray
    bound: np.ndarray


def requests(req_pool_indices, prefix_lens, extend_lens, rtt_shape, swa_window=0) -> Requests:
    row, pre, ext = (np.asarray(a, np.int64) for a in (req_pool_indices, prefix_lens, extend_lens))
    rows, max_len = (int(x) for x in rtt_shape)
    real = row != 0
    bad_row = real & ((row < 0) | (row >= rows))
    bad_pre = real & ~bad_row & ((pre < 0) | (pre > max_len))
    bad_ext = real & ~bad_row & ~bad_pre & (ext < 0)
    field = np.select([bad_row, bad_pre, bad_ext],
                      [int(BatchField.REQ_POOL_INDEX), int(BatchField.PREFIX_LEN), int(BatchField.EXTEND_LEN)], 0)
    value = np.select([bad_row, bad_pre, bad_ext], [row, pre, ext], 0)
    bound = np.select([bad_row, bad_pre], [rows, max_len], 0)
    ok = real & (field == 0)
    prefix = np.where(ok, pre, 0)
    lo = np.where(ok & (pre > swa_window), pre - swa_window, 0) if swa_window > 0 else np.zeros_like(row)
    tokens = np.where(real & (ext > 0), np.minimum(ext, MAX_REQUEST_TOKENS), 0)  # sums never wrap
    return Requests(row, ok, lo, prefix - lo, prefix, tokens, field, value, bound)


def batch_rows(tag, request, field, value, bound, slot=NO_SLOT) -> np.ndarray:
    """BATCH_INDEX_OUT_OF_RANGE rows (abi.BatchField names the columns)."""
    request = np.asarray(request, np.int64)
    z = np.zeros(len(request), np.int64)
    return _rows(tag, np.broadcast_to(slot, z.shape), request, np.broadcast_to(value, z.shape), np.broadcast_to(field, z.shape), z,
                 np.broadcast_to(bound, z.shape), z + _BATCH)


def map_slots(full, swa_map) -> np.ndarray:
    """The group's slots of full-pool slots: themselves, or their full->SWA map entries
    (SWA_UNMAPPED outside the map)."""
    full = np.asarray(full, np.int64)
    if swa_map is None:
        return full
    m = np.asarray(swa_map, np.int64)
    inside = (full >= 0) & (full < len(m))
    return np.where(inside, m[np.where(inside, full, 0)] if len(m) else SWA_UNMAPPED, SWA_UNMAPPED)


@dataclass
class Entries:
    slot: np.ndarray
    prev: np.ndarray
    expected_token: np.ndarray
    position: np.ndarray
    live: np.ndarray
    end: np.ndarray = None  # the owner's verified end, q.lo + q.n (the fingerprint budget's window)


def entries(q: Requests, entry_offsets, active: int, req_to_token, swa_map=None, expected_pool=None,
            expected_valid_lens=None, expected_token_offset=0) -> Entries:
    """Entries [0, active) as ``kvc_fused_entry`` derives them from the batch and the plan's
    entry offsets (owner: the last request whose offset is <= e). A required predecessor on
    slot 0 becomes PREV_ON_PADDING, a map value equal to that marker SWA_UNMAPPED; an entry that
    is not its request's in this batch is not live (slot SWA_UNMAPPED, nothing read)."""
    bs, e = len(q.row), np.arange(active, dtype=np.int64)
    off = np.asarray(entry_offsets, np.int64)
    if bs == 0:
        z = np.zeros(active, np.int64)
        return Entries(z + SWA_UNMAPPED, z + CHAIN_HEAD, z + NO_EXPECTED_TOKEN, z, z.astype(bool), z)
    r = owners(off, bs, e)
    k = e - off[r]
    live = q.ok[r] & (k >= 0) & (k < q.n[r])
    pos = q.lo[r] + np.where(live, k, 0)
    row = np.where(live, q.row[r], 0)
    rtt = np.asarray(req_to_token)
    slot = np.full(active, SWA_UNMAPPED, np.int64)
    li = np.flatnonzero(live)
    slot[li] = map_slots(rtt[row[li], pos[li]], swa_map)
    prev = np.full(active, CHAIN_HEAD, np.int64)
    m = np.flatnonzero(live & (pos > 0))
    prev[m] = map_slots(rtt[row[m], pos[m] - 1], swa_map)
    prev[m] = np.where(prev[m] == PREV_ON_PADDING, SWA_UNMAPPED, prev[m])
    prev[m] = np.where((k[m] > 0) & (prev[m] == PADDING_SLOT), PREV_ON_PADDING, prev[m])
    token = np.full(active, NO_EXPECTED_TOKEN, np.int64)
    if expected_pool is not None:
        pool = np.asarray(expected_pool)
        limit = np.full(bs, pool.shape[1], np.int64) if expected_valid_lens is None else \
            np.minimum(np.asarray(expected_valid_lens, np.int64), pool.shape[1])
        at = pos + int(expected_token_offset)
        m = np.flatnonzero(live & (at >= 0) & (at < limit[r]))
        token[m] = pool[row[m], at[m]]
    return Entries(slot, prev, token, pos, live, (q.lo + q.n)[r])


@dataclass
class VerifyPlanArrays:
    """A verify plan: int64 ``[capacity]`` entry arrays, int32 ``[1]`` num_valid and enable."""

    slot: np.ndarray
    expected_token: np.ndarray
    expected_position: np.ndarray
    prev_slot: np.ndarray
    num_valid: np.ndarray
    enable: np.ndarray

    @classmethod
    def zeros(cls, capacity: int) -> VerifyPlanArrays:
        z = lambda: np.zeros(capacity, dtype=np.int64)  # noqa: E731
        return cls(z(), z(), z(), z(), np.zeros(1, np.int32), np.zeros(1, np.int32))


@dataclass
class WritePlanArrays:
    """A write plan: int64 offsets ``[req_capacity + 1]``, seed ``[req_capacity]``, int32 num_valid_reqs ``[1]``."""

    offsets: np.ndarray
    seed: np.ndarray
    num_valid_reqs: np.ndarray

    @classmethod
    def zeros(cls, req_capacity: int) -> WritePlanArrays:
        return cls(np.zeros(req_capacity + 1, np.int64), np.zeros(req_capacity, np.int64),
                   np.zeros(1, np.int32))


def build_plan(*, verify_capacity: int, write_req_capacity: int, **batch) -> tuple[VerifyPlanArrays, WritePlanArrays]:
    """New zero-initialised plans of the given capacities, filled by :func:`fill_plan` from ``batch``
    (its keyword arguments)."""
    verify, write = VerifyPlanArrays.zeros(verify_capacity), WritePlanArrays.zeros(write_req_capacity)
    fill_plan(verify=verify, write=write, **batch)
    return verify, write


def fill_plan(*, verify, write, req_pool_indices, prefix_lens, extend_lens, req_to_token, swa_window=0,
              swa_map=None, expected_pool=None, expected_valid_lens=None, expected_token_offset=0,
              entry_offsets=None, out_cache_loc=None, report: Report | None = None, tag=0) -> None:
    """Fill existing plan arrays from the engine's batch, as kvc_prepare (+ kvc_expand) do.

    Per request (``requests``): a rejected one (field != 0) gives a BATCH row, no entries and seed
    SEED_INVALID + field, but keeps its extend_lens tokens in the write offsets; a padding row (0)
    before a real one gives a PADDING_ORDER row; padding owns no tokens. Entries are positions
    [lo, prefix) of the valid requests in batch order; seeds the mapped slot before the prefix
    (valid requests with new tokens; a map value equal to a rejection marker becomes SWA_UNMAPPED)
    or -1. With ``out_cache_loc``: a TOKENS_SHORT row when the ranges need more than T tokens, a
    TOKENS_UNOWNED row for the first token past them on a real slot (> 0). Capacity overflow:
    ``num_valid = capacity``, ``enable = 0`` and no entry is written; otherwise entries [0, total)
    are written. ``entry_offsets`` (int64
    ``[req_capacity + 1]``) receives the per-request entry offsets, the total past the batch. Raises ValueError (before writing
    anything) if the batch exceeds the write plan's request capacity.
    """
    rtt = np.asarray(req_to_token)
    q = requests(req_pool_indices, prefix_lens, extend_lens, rtt.shape, swa_window)
    bs = len(q.row)
    if bs > len(write.seed):
        raise ValueError(f"kv-canary: batch size {bs} exceeds the write plan's request capacity "
                         f"{len(write.seed)}; fix: create the plan with write_req_capacity >= {bs}")
    rows = [batch_rows(tag, np.flatnonzero(q.field), q.field[q.field != 0], q.value[q.field != 0],
                       q.bound[q.field != 0])]
    pad_first = np.flatnonzero((q.row[:-1] == 0) & (q.row[1:] != 0))
    rows.append(batch_rows(tag, pad_first, int(BatchField.PADDING_ORDER), 0, q.row[pad_first + 1]))
    seed = np.full(bs, CHAIN_HEAD, np.int64)
    has = np.flatnonzero(q.ok & (q.prefix > 0) & (q.tokens > 0))
    seed[has] = map_slots(rtt[q.row[has], q.prefix[has] - 1], swa_map)
    marker = (seed > SEED_INVALID) & (seed <= SEED_INVALID + max(BatchField))
    seed = np.where(marker, SWA_UNMAPPED, seed)
    seed = np.where(q.field != 0, SEED_INVALID + q.field, seed)
    total_tokens = int(q.tokens.sum())
    if out_cache_loc is not None:
        loc = np.asarray(out_cache_loc, np.int64)
        if total_tokens > len(loc):
            rows.append(batch_rows(tag, [NO_REQUEST], int(BatchField.TOKENS_SHORT), total_tokens, len(loc)))
        tail = np.flatnonzero(loc[total_tokens:] > 0)
        if len(tail):
            i = total_tokens + int(tail[0])
            rows.append(batch_rows(tag, [NO_REQUEST], int(BatchField.TOKENS_UNOWNED), i, total_tokens, slot=int(loc[i])))
    if report is not None:
        report(np.concatenate(rows))
    counts = q.n
    total = int(counts.sum())
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if entry_offsets is not None:  # past the batch: the total (non-decreasing for a larger batch later)
        entry_offsets[:bs + 1] = offsets
        entry_offsets[bs + 1:len(write.seed) + 1] = total
    capacity = len(verify.slot)
    if total > capacity:
        verify.num_valid[0], verify.enable[0] = capacity, 0
    else:
        x = entries(q, offsets, total, rtt, swa_map, expected_pool, expected_valid_lens, expected_token_offset)
        verify.slot[:total], verify.prev_slot[:total] = x.slot, x.prev
        verify.expected_token[:total], verify.expected_position[:total] = x.expected_token, x.position
        verify.num_valid[0], verify.enable[0] = total, 1
    write.offsets[0] = 0
    write.offsets[1:bs + 1] = np.cumsum(q.tokens)
    write.seed[:bs] = seed
    write.num_valid_reqs[0] = bs


def fused_verify_rows(*, canary, q: Requests, entry_offsets, num_valid, enable, capacity: int, req_to_token,
                      sources: Sequence[RefSource], tag, check_expected_token, swa_map=None, expected_pool=None,
                      expected_valid_lens=None, expected_token_offset=0, fingerprint_every: int = 1,
                      fingerprint_phase: int = 0, with_requests: bool = False) -> tuple:
    """What one kvc_fused_verify launch finds, as (rows, active entries counted, entries skipped);
    active is -1 when the plan is disabled (no rows then). Rows: a BATCH ENTRY_COUNT row per
    request whose plan entry count differs from this batch's, then the checks of every live entry
    (reference.check_entries), the real KV of those :func:`fingerprinted` picks. ``with_requests``:
    a fourth item, the batch index each row is attributed to (docs/format.md §5.7)."""
    if int(enable[0]) == 0:
        empty = np.zeros((0, RING_COLS), np.int64), -1, 0
        return (*empty, np.zeros(0, np.int64)) if with_requests else empty
    active = min(max(int(num_valid[0]), 0), capacity)
    bs = len(q.row)
    off = np.asarray(entry_offsets, np.int64)
    planned = off[1:bs + 1] - off[:bs]
    bad = np.flatnonzero(planned != q.n)
    rows = [batch_rows(tag, bad, int(BatchField.ENTRY_COUNT), planned[bad], q.n[bad])]
    x = entries(q, off, active, req_to_token, swa_map, expected_pool, expected_valid_lens, expected_token_offset)
    live = np.flatnonzero(x.live)
    fp = fingerprinted(x.position[live], x.end[live], fingerprint_every, fingerprint_phase)
    checked, e = check_entries(canary, x.slot[live], x.prev[live], x.expected_token[live], x.position[live],
                               sources, tag, check_expected_token, fingerprinted=fp, with_entries=True)
    rows.append(checked)
    out = np.concatenate(rows), active, active - len(live)
    if not with_requests:
        return out
    return (*out, np.concatenate([bad, owners(off, bs, live[e])]).astype(np.int64))


def fingerprinted(position, end, every: int, phase_counter: int) -> np.ndarray | None:
    """The fingerprint budget (docs/format.md §6.1): which entries (at ``position``, of a request
    whose verified positions end at ``end``) have their real KV checked: all when ``every`` <= 1
    (None), else those whose position is ``phase_counter % every`` mod ``every`` and each request's
    last ``every`` positions."""
    if every <= 1:
        return None
    pos = np.asarray(position, np.int64)
    return (pos % every == int(phase_counter) % every) | (pos + every >= np.asarray(end, np.int64))
