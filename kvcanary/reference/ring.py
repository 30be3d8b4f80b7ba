"""The CPU reference of the violation ring (docs/format.md §5): how ``kvc_record`` appends a row,
and the request verdicts a row is attributed to (§5.7). Part of the executable spec of the
kernels with :mod:`kvcanary.reference.canary` and :mod:`kvcanary.reference.plan`; imports only numpy and
kvcanary, never CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcanary.abi import COL_FAIL_REASON_BITS, NO_REQUEST, RING_COLS


def _wrap_i32(x):
    return (np.asarray(x, dtype=np.int64) + (1 << 31)) % (1 << 32) - (1 << 31)


@dataclass
class Verdicts:
    """The request verdicts of a sink (docs/format.md §5.7): int64 ``words`` (one per batch index),
    the int64 ``[1]`` count of words that became nonzero (``failed``) and the int64 ``[capacity]``
    request of each stored ring row (``ring_requests``); any may be None (not kept)."""

    words: np.ndarray | None = None
    failed: np.ndarray | None = None
    ring_requests: np.ndarray | None = None

    def reset(self) -> None:
        """A step's first plan build: every word and the count back to 0."""
        if self.words is not None:
            self.words[:] = 0
        if self.failed is not None:
            self.failed[0] = 0


def ring_append(ring: np.ndarray, write_index: np.ndarray, rows, claim=None, consumed=None, requests=None,
                verdicts: Verdicts | None = None) -> None:
    """Append rows in order (docs/format.md §5), as ``kvc_record`` does.

    Format v1 (``claim`` None): for each row ``i = write_index[0]; write_index[0] += 1`` (int32
    wraparound), stored only if ``0 <= i < len(ring)`` (fill once). With an int64 ``[1]`` claim
    counter (``write_index`` is then its low half and is not touched separately): row i is stored
    at ``i % len(ring)`` iff ``0 <= i - consumed[0] < len(ring)`` (``consumed`` None: 0).
    Rows that are not stored are counted, never stored over unread rows.
    ``requests``: the batch index each row is attributed to (NO_REQUEST: none; None: no row is);
    with ``verdicts`` (§5.7) a row ORs its bits into its request's word (stored or not) and a
    stored row's request is kept beside it.
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, RING_COLS)
    if len(rows) == 0:
        return
    req = np.full(len(rows), NO_REQUEST, np.int64) if requests is None else np.asarray(requests, np.int64)
    cap = len(ring)
    if claim is not None:
        start = int(claim[0])
        idx = start + np.arange(len(rows), dtype=np.int64)
        seen = 0 if consumed is None else int(consumed[0])
        keep = (idx - seen >= 0) & (idx - seen < cap)
        at = idx[keep] % cap
        claim[0] = start + len(rows)
    else:
        start = int(write_index[0])
        idx = _wrap_i32(start + np.arange(len(rows), dtype=np.int64))
        keep = (idx >= 0) & (idx < cap)
        at = idx[keep]
        write_index[0] = int(_wrap_i32(start + len(rows)))
    ring[at] = rows[keep]
    if verdicts is not None:
        _attribute(verdicts, at, req[keep], req, rows[:, COL_FAIL_REASON_BITS])


def _attribute(v: Verdicts, at, kept_requests, requests, bits) -> None:
    """Rows' requests beside the stored rows, and their bits into the request verdict words."""
    if v.ring_requests is not None:
        v.ring_requests[at] = kept_requests
    words = v.words
    if words is None:
        return
    mine = np.flatnonzero((requests >= 0) & (requests < len(words)))
    for r in np.unique(requests[mine]).tolist():
        before = int(words[r])
        words[r] = before | int(np.bitwise_or.reduce(bits[mine][requests[mine] == r]))
        if before == 0 and words[r] != 0 and v.failed is not None:
            v.failed[0] += 1


def owners(entry_offsets, requests: int, entries) -> np.ndarray:
    """The request each entry's row is attributed to (docs/format.md §5.7): the last r < ``requests``
    with ``entry_offsets[r] <= e`` (0 when none), as ``kvc_owner_of`` finds it; NO_REQUEST for every
    entry without offsets."""
    e = np.asarray(entries, np.int64)
    if entry_offsets is None or requests <= 0:
        return np.full(len(e), NO_REQUEST, np.int64)
    off = np.asarray(entry_offsets, np.int64)[:requests]
    return np.clip(np.searchsorted(off, e, side="right") - 1, 0, requests - 1).astype(np.int64)
