"""The CPU reference backend: the executable spec of the verify, write and plan kernels.

Every function takes numpy arrays shaped and typed like the device buffers of the CUDA ABI and
mutates them in place exactly as the kernels mutate device memory (docs/format.md §5–§8): canary buffer
uint8 ``[num_slots, stride]`` (stride >= 32, a multiple of 8, fields little-endian int64), plan
arrays int64, flags and ``write_index`` int32 ``[1]``, counters int64 ``[1]``, ring int64
``[capacity, 8]``. Hashes are stored as int64 bit patterns. Nothing here raises on bad device
data (out-of-range slots become SLOT_OUT_OF_RANGE rows, as on the GPU); host-side checks that the
launcher performs (shapes, dtypes, source bounds) are assumed done. Rows are appended in entry
order (verify) and request-then-entry order (write); the GPU may order them differently.
This module imports only numpy and kvcanary; never CUDA.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvcanary.abi import (CHAIN_HEAD, FIELD_POSITION, FIELD_PREV_HASH, FIELD_REAL_KV_HASH, FIELD_TOKEN,
                          FIELDS_PER_SLOT, NO_EXPECTED_TOKEN, PADDING_SLOT, PREV_ON_PADDING, RING_COLS, SEED_INVALID,
                          SELF_TEST_POSITION, SELF_TEST_TOKEN, BatchField, FailReason)
from kvcanary.reference.hashing import (ANCHOR_HASH, RefSource, canary_words, fingerprint, mix3, mix3_np,
                                        slot_hash_words, to_i64)
from kvcanary.reference.ring import Verdicts, owners, ring_append

__all__ = ["RefSource", "Verdicts", "check_entries", "lost_writes", "owners", "ring_append", "self_test_rows", "verify",
           "write"]

_ANCHOR_I64 = to_i64(ANCHOR_HASH)
_CHAIN = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
_POSITION = int(FailReason.VERIFY_POSITION_MISMATCH)
_REAL_KV = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
_TOKEN = int(FailReason.VERIFY_TOKEN_MISMATCH)
_W_TOKEN = int(FailReason.WRITE_TOKEN_MISMATCH)
_W_POSITION = int(FailReason.WRITE_POSITION_MISMATCH)
_OOB = int(FailReason.SLOT_OUT_OF_RANGE)
_PADDING = int(FailReason.PADDING_SLOT_READ)
_LOST = int(FailReason.LOST_WRITE)


def _rows(tag, *cols) -> np.ndarray:
    n = len(cols[0])
    out = np.empty((n, RING_COLS), dtype=np.int64)
    out[:, 0] = int(tag)
    for j, c in enumerate(cols, start=1):
        out[:, j] = c
    return out


# ---- verify (docs/format.md §6) --------------------------------------------------------------------------------
def self_test_rows(*, self_test, self_test_every: int, run: int, num_slots: int, tag) -> np.ndarray:
    """The row run number ``run`` (1, 2, ...) of a verify launch appends for its self-test
    (docs/format.md §11): none unless ``self_test_every`` > 0 divides ``run``; else SELF_TEST plus
    the mismatch bits of the canary-only record ``self_test`` against SELF_TEST_TOKEN at
    SELF_TEST_POSITION, at slot ``num_slots`` (past the pool's), expected aux = ``run``."""
    if self_test is None or self_test_every <= 0 or run % self_test_every:
        return np.zeros((0, RING_COLS), np.int64)
    rec = np.asarray(self_test, np.int64)
    token, position, prev = int(rec[FIELD_TOKEN]), int(rec[FIELD_POSITION]), int(rec[FIELD_PREV_HASH])
    bits = int(FailReason.SELF_TEST)
    bits |= _POSITION if position != SELF_TEST_POSITION else 0
    bits |= _TOKEN if token != SELF_TEST_TOKEN else 0
    return _rows(tag, [num_slots], [SELF_TEST_POSITION], [token], [SELF_TEST_TOKEN], [prev], [run], [bits])


def verify(*, canary, slot, expected_token, expected_position, prev_slot, num_valid, enable, ring,
           write_index, kernel_run_counter, slot_run_counter, sources: Sequence[RefSource], tag,
           check_expected_token, claim=None, consumed=None, self_test=None, self_test_every: int = 0,
           entry_offsets=None, plan_requests: int = 0, verdicts: Verdicts | None = None) -> None:
    """One verify launch over a materialised plan: check active entries, a ring row per mismatch.

    Effects: ``kernel_run_counter += 1`` always; if ``enable[0] != 0``, ``slot_run_counter +=
    active`` (``active = clamp(num_valid[0], 0, len(slot))``, slot-0 entries included) and the rows
    of :func:`check_entries` for entries < active. Entries past ``active`` are never read;
    ``canary`` is never modified. With the plan builder's ``entry_offsets`` (``plan_requests`` + 1
    of them) each row is attributed to its entry's request (:func:`owners`, §5.7).
    """
    kernel_run_counter[0] += 1
    ring_append(ring, write_index, self_test_rows(self_test=self_test, self_test_every=self_test_every,
                                                  run=int(kernel_run_counter[0]), num_slots=canary_words(canary).shape[0],
                                                  tag=tag), claim, consumed, verdicts=verdicts)
    if int(enable[0]) == 0:
        return
    active = min(max(int(num_valid[0]), 0), len(slot))
    slot_run_counter[0] += active
    rows, e = check_entries(canary, slot[:active], prev_slot[:active], expected_token[:active],
                            expected_position[:active], sources, tag, check_expected_token, with_entries=True)
    ring_append(ring, write_index, rows, claim, consumed, owners(entry_offsets, plan_requests, e), verdicts)


def check_entries(canary, slot, prev_slot, expected_token, expected_position, sources: Sequence[RefSource],
                  tag, check_expected_token, fingerprinted=None, with_entries: bool = False):
    """The rows the checks of docs/format.md §6 step 3 give for plan entries, in entry order
    (``with_entries``: and the index of the entry of each row).

    An entry on slot 0 gives a PADDING_SLOT_READ row, one on a slot outside the buffer a
    SLOT_OUT_OF_RANGE row (slot, expected position, 0, -1, 0, 0). Predecessors: -1 is a chain
    head (expects sm(ANCHOR)); 0 is not checked; PREV_ON_PADDING (a required predecessor on the
    padding slot) is not checked and sets PADDING_SLOT_READ; any other value outside the buffer
    sets CHAIN | SLOT_OUT_OF_RANGE with expected chain 0; else the chain is slot_hash(prev).
    ``fingerprinted`` (bool per entry, None = all): the entries whose real KV is checked.
    """
    words = canary_words(canary)
    n, active = words.shape[0], len(slot)
    s, p = np.asarray(slot, np.int64), np.asarray(prev_slot, np.int64)
    epos, et = np.asarray(expected_position, np.int64), np.asarray(expected_token, np.int64)
    in_range = (s > 0) & (s < n)
    rec = np.take(words, np.where(in_range, s, 0), axis=0)[:, :FIELDS_PER_SLOT] if n else \
        np.zeros((active, FIELDS_PER_SLOT), np.int64)
    tok, pos = rec[:, FIELD_TOKEN], rec[:, FIELD_POSITION]
    prev, rkv = rec[:, FIELD_PREV_HASH], rec[:, FIELD_REAL_KV_HASH]
    p_in = (p > 0) & (p < n)
    ph = slot_hash_words(words, np.where(p_in, p, 0)).view(np.int64) if n else np.zeros(active, np.int64)
    p_bad = ~p_in & (p != 0) & (p != CHAIN_HEAD) & (p != PREV_ON_PADDING)
    unchecked = (p == 0) | (p == PREV_ON_PADDING)
    expected_chain = np.where(unchecked, prev, np.where(p == CHAIN_HEAD, _ANCHOR_I64, np.where(p_bad, 0, ph)))
    bits = np.where(prev != expected_chain, _CHAIN, 0)
    bits |= np.where(p_bad, _CHAIN | _OOB, 0)
    bits |= np.where(p == PREV_ON_PADDING, _PADDING, 0)
    bits |= np.where(pos != epos, _POSITION, 0)
    fp = np.zeros(active, dtype=np.int64)
    compared = np.ones(active, bool) if fingerprinted is None else np.asarray(fingerprinted, bool)
    idx = np.flatnonzero(in_range & compared)
    if sources:
        fp[idx] = fingerprint(s[idx], sources).view(np.int64)
    bits |= np.where((rkv != fp) & compared, _REAL_KV, 0)
    if check_expected_token:
        bits |= np.where((et != NO_EXPECTED_TOKEN) & (tok != et), _TOKEN, 0)
    e = np.flatnonzero(~in_range | (bits != 0))
    o = ~in_range[e]
    rows = _rows(tag, s[e], np.where(o, epos[e], pos[e]), np.where(o, 0, tok[e]),
                 np.where(o | (not check_expected_token), NO_EXPECTED_TOKEN, et[e]),
                 np.where(o, 0, prev[e]), np.where(o, 0, expected_chain[e]),
                 np.where(o, np.where(s[e] == 0, _PADDING, _OOB), bits[e]))
    return (rows, e) if with_entries else rows


# ---- write (docs/format.md §7) -----------------------------------------------------------------------------------
def write(*, canary, offsets, seed, num_valid_reqs, input_ids, positions, out_cache_loc,
          expected_input_ids=None, expected_positions=None, chain_position_assert=None, ring,
          write_index, kernel_run_counter, slot_run_counter, sources: Sequence[RefSource],
          tag, claim=None, consumed=None, verdicts: Verdicts | None = None) -> None:
    """One write launch: stamp (token, position, chain hash, fingerprint) into each written slot.

    Request r < clamp(num_valid_reqs[0], 0, len(seed)) owns flat entries [start, end) with
    ``start = clamp(offsets[r], 0, T)``, ``end = clamp(offsets[r+1], start, T)``. Its chain starts
    at ``slot_hash(seed[r])`` (a seed outside [-1, num_slots) gives a SLOT_OUT_OF_RANGE row and
    the anchor); a request the plan builder rejected (seed SEED_INVALID + BatchField) stamps
    nothing and gives no row (the builder reported it).
    Entries with slot < 0 are skipped; slot >= num_slots gives a SLOT_OUT_OF_RANGE row and is
    skipped. Seeds are read before any store. ``kernel_run_counter += 1``; ``slot_run_counter +=``
    stamped entries. Sources are read, never written. Every row is attributed to its request r
    (docs/format.md §5.7).
    """
    if (expected_input_ids is None) != (expected_positions is None):
        raise ValueError("kv-canary: expected_input_ids and expected_positions must be given "
                         "together, got only one; fix: pass both arrays or neither")
    kernel_run_counter[0] += 1
    words = canary_words(canary)
    n, T = words.shape[0], len(out_cache_loc)
    R = min(max(int(num_valid_reqs[0]), 0), len(seed))
    start = np.clip(offsets[:R], 0, T)
    rejected = (seed[:R] > SEED_INVALID) & (seed[:R] <= SEED_INVALID + max(BatchField))
    length = np.where(rejected, 0, np.minimum(np.maximum(offsets[1:R + 1], start), T) - start)
    req = np.repeat(np.arange(R), length)
    first = np.cumsum(length) - length
    flat = np.arange(len(req))
    i = start[req] + flat - first[req]
    s, tok, pos = out_cache_loc[i], input_ids[i], positions[i]
    ok = (s >= 0) & (s < n)

    sd = seed[:R]
    seed_ok = (sd >= 0) & (sd < n)
    assert_on = seed_ok & (chain_position_assert is not None and int(chain_position_assert[0]) != 0)
    h0 = np.full(R, ANCHOR_HASH, dtype=np.uint64)
    h0[seed_ok] = slot_hash_words(words, sd[seed_ok])
    pos0 = np.zeros(R, dtype=np.int64)
    pos0[seed_ok] = words[sd[seed_ok], FIELD_POSITION]

    # The chain, serial per request: run[base[r] + j] = running hash before stamped entry j of r.
    st = np.flatnonzero(ok)
    st_req = req[st]
    k = np.bincount(st_req, minlength=R)
    rank = np.arange(len(st)) - (np.cumsum(k) - k)[st_req]
    base = np.cumsum(k + 1) - (k + 1)
    run = np.empty(int((k + 1).sum()), dtype=np.uint64)
    run[base] = h0
    by_rank = np.argsort(rank, kind="stable")
    b_all, t_all, p_all = (base[st_req] + rank)[by_rank], tok[st][by_rank], pos[st][by_rank]
    lo = 0
    for c in np.bincount(rank).tolist():  # one step of every request's chain at a time
        b, t, p = b_all[lo:lo + c], t_all[lo:lo + c], p_all[lo:lo + c]
        lo += c
        if c > 8:
            run[b + 1] = mix3_np(run[b], t, p)
        else:  # few chains left (a long prefill): Python ints are faster than numpy calls
            for bb, tt, pp in zip(b.tolist(), t.tolist(), p.tolist()):
                run[bb + 1] = mix3(int(run[bb]), tt, pp)
    ok_before = np.cumsum(ok) - ok
    running = run[base[req] + ok_before - ok_before[first[req]]].view(np.int64)

    rows, keys = [], []
    bad_seed = np.flatnonzero(((sd >= n) | (sd < CHAIN_HEAD)) & ~rejected)
    zeros = np.zeros(len(bad_seed), dtype=np.int64)
    rows.append(_rows(tag, sd[bad_seed], zeros - 1, zeros, zeros - 1, zeros, zeros, zeros + _OOB))
    keys.append((bad_seed, zeros - 1, zeros))
    bad = np.flatnonzero(s >= n)
    zeros = np.zeros(len(bad), dtype=np.int64)
    rows.append(_rows(tag, s[bad], pos[bad], tok[bad], zeros - 1, running[bad], zeros, zeros + _OOB))
    keys.append((req[bad], bad, zeros + 1))
    if expected_input_ids is not None:
        x_tok, x_pos = expected_input_ids[i[st]], expected_positions[i[st]]
        bits = (np.where(tok[st] != x_tok, _W_TOKEN, 0) | np.where(pos[st] != x_pos, _W_POSITION, 0))
        m = np.flatnonzero(bits)
        e = st[m]
        rows.append(_rows(tag, s[e], pos[e], tok[e], x_tok[m], running[e], x_pos[m], bits[m]))
        keys.append((req[e], e, np.ones(len(e), dtype=np.int64)))
    prev_pos = np.where(rank == 0, pos0[st_req], np.roll(pos[st], 1))
    m = np.flatnonzero(assert_on[st_req] & (pos[st] != prev_pos + 1))
    e = st[m]
    ones = np.ones(len(e), dtype=np.int64)
    rows.append(_rows(tag, s[e], pos[e], tok[e], tok[e], running[e], prev_pos[m] + 1, ones * _W_POSITION))
    keys.append((req[e], e, ones * 2))
    fp = fingerprint(s[st], sources).view(np.int64)
    if sources:
        e, prev_tok, prev_pos = lost_writes(words, req[st], s[st], tok[st], pos[st], fp)
        e = st[e]
        ones = np.ones(len(e), dtype=np.int64)
        rows.append(_rows(tag, s[e], pos[e], tok[e], prev_tok, running[e], prev_pos, ones * _LOST))
        keys.append((req[e], e, ones * 3))
    order = np.lexsort(tuple(np.concatenate(c) for c in zip(*keys))[::-1])
    ring_append(ring, write_index, np.concatenate(rows)[order], claim, consumed,
                np.concatenate([k[0] for k in keys])[order], verdicts)

    # Stores, in flat order: the last write of a repeated slot wins.
    uniq, last_rev = np.unique(s[st][::-1], return_index=True)
    last = len(st) - 1 - last_rev
    e = st[last]
    rec = np.empty((len(e), FIELDS_PER_SLOT), dtype=np.int64)
    rec[:, FIELD_TOKEN], rec[:, FIELD_POSITION] = tok[e], pos[e]
    rec[:, FIELD_PREV_HASH], rec[:, FIELD_REAL_KV_HASH] = running[e], fp[last]
    words[uniq, :FIELDS_PER_SLOT] = rec
    slot_run_counter[0] += len(st)


def lost_writes(words, req, slot, token, position, fp):
    """The lost-write check of a fingerprinting write (docs/format.md §7.1) over its stamped entries
    (in flat order: request ``req``, ``slot`` in [0, num_slots), ``token``, ``position``, fingerprint
    ``fp`` of the slot's bytes now). Each entry on a slot other than the padding slot is compared
    with the record the slot holds just before it is stamped: the record an earlier entry of the
    same request stamped there, else the buffer's record before the launch (``words``, int64
    ``[num_slots, >= 4]``). A lost write: that record's REAL_KV_HASH equals ``fp`` while its TOKEN
    differs from ``token`` (the bytes did not change, the token did), both tokens known (>= 0: the
    vLLM connector stamps -1 for a token the scheduler did not know). Returns the indices of the
    entries with a lost write and, per entry, the previous record's TOKEN and POSITION."""
    prev_tok, prev_pos, prev_fp = (words[slot, f] for f in (FIELD_TOKEN, FIELD_POSITION, FIELD_REAL_KV_HASH))  # copies
    order = np.lexsort((np.arange(len(slot)), slot, req))  # by request, slot, then entry
    same = (req[order][1:] == req[order][:-1]) & (slot[order][1:] == slot[order][:-1])
    later, earlier = order[1:][same], order[:-1][same]  # entry `later`'s previous stamp is `earlier`
    prev_tok[later], prev_pos[later], prev_fp[later] = token[earlier], position[earlier], fp[earlier]
    known = (prev_tok >= 0) & (token >= 0)  # a negative token is one the engine did not know: it matches any
    e = np.flatnonzero((slot != PADDING_SLOT) & (prev_fp == fp) & (prev_tok != token) & known)
    return e, prev_tok[e], prev_pos[e]
