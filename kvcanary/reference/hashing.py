"""The format-v1 hash functions (docs/format.md §3), on Python ints and on numpy arrays.

``sm`` is the splitmix64 finaliser and ``mix3(a, b, c) = sm(sm(sm(a) ^ b) ^ c)``; both work mod
2^64 and read signed (int64) inputs as their uint64 bit pattern. The numpy variants return uint64
arrays and never modify their inputs. Constants come from :mod:`kvcanary.abi`. On top of them, as
the CPU reference computes them: ``slot_hash`` of canary records and the real-KV ``fingerprint``
of slots over their :class:`RefSource` s.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from kvcanary.abi import (ANCHOR, FIELD_POSITION, FIELD_PREV_HASH, FIELD_TOKEN, SM_MUL1, SM_MUL2, SM_SHIFT1,
                          SM_SHIFT2, SM_SHIFT3)

MASK64 = (1 << 64) - 1
_GATHER_BYTES = 1 << 24  # bound on the temporary byte matrix of one fingerprint chunk


def to_u64(i: int) -> int:
    """The uint64 bit pattern of a Python int (int64 or already unsigned)."""
    return int(i) & MASK64


def to_i64(u: int) -> int:
    """The int64 value with the same bit pattern as ``u`` (as stored in canary and ring fields)."""
    u = int(u) & MASK64
    return u - (1 << 64) if u >> 63 else u


def sm(x: int) -> int:
    """splitmix64 finaliser of ``x`` (taken mod 2^64); returns a uint64 as a Python int."""
    x = int(x) & MASK64
    x ^= x >> SM_SHIFT1
    x = (x * SM_MUL1) & MASK64
    x ^= x >> SM_SHIFT2
    x = (x * SM_MUL2) & MASK64
    x ^= x >> SM_SHIFT3
    return x


def mix3(a: int, b: int, c: int) -> int:
    """``sm(sm(sm(a) ^ b) ^ c)``; the link of the hash chain (a = prev hash, b = token, c = position)."""
    return sm(sm(sm(a) ^ to_u64(b)) ^ to_u64(c))


ANCHOR_HASH = sm(ANCHOR)
"""The PREV_HASH a chain head carries, ``sm(ANCHOR)``, as a uint64 Python int."""

_S1, _S2, _S3 = np.uint64(SM_SHIFT1), np.uint64(SM_SHIFT2), np.uint64(SM_SHIFT3)
_M1, _M2 = np.uint64(SM_MUL1), np.uint64(SM_MUL2)


def as_u64(x) -> np.ndarray:
    """``x`` as a uint64 array with the same bit patterns (a view when ``x`` is int64/uint64)."""
    a = np.asarray(x)
    if a.dtype == np.uint64:
        return a
    if a.dtype == np.int64:
        return a.view(np.uint64)
    if a.dtype.kind in "iu":
        return a.astype(np.int64).view(np.uint64)
    raise TypeError(f"kv-canary: hash inputs must be integer arrays, got dtype {a.dtype}")


def _sm_inplace(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x ^= x >> _S1
        x *= _M1
        x ^= x >> _S2
        x *= _M2
        x ^= x >> _S3
    return x


def sm_np(x) -> np.ndarray:
    """Element-wise ``sm`` of an int64/uint64 array; returns a new uint64 array."""
    return _sm_inplace(np.array(as_u64(x), dtype=np.uint64, copy=True))


def mix3_np(a, b, c) -> np.ndarray:
    """Element-wise ``mix3`` of broadcastable int64/uint64 arrays; returns a new uint64 array."""
    h = _sm_inplace(sm_np(a) ^ as_u64(b))
    h ^= as_u64(c)
    return _sm_inplace(h)


# ---- slot hashes and fingerprints (the reference backend's) -------------------------------------
class RefSource(NamedTuple):
    """One real-KV source as the reference reads it (docs/format.md §4), hash mode already resolved.

    ``data`` is uint8 2-D with a contiguous inner dimension; rows may be strided (a view into a
    larger buffer, never copied). Slot s reads ``hash_bytes`` bytes of row ``s // page_size``
    starting at byte ``(s % page_size) * bytes_per_token``.
    """

    data: np.ndarray
    page_size: int
    bytes_per_token: int
    hash_bytes: int


def _source_hash(slots: np.ndarray, src: RefSource) -> np.ndarray:
    data, ps, bpt, hb = src.data, int(src.page_size), int(src.bytes_per_token), int(src.hash_bytes)
    if data.dtype != np.uint8 or data.ndim != 2 or (data.shape[1] > 1 and data.strides[1] != 1):
        raise ValueError(f"kv-canary: RefSource.data must be uint8 2-D with a contiguous inner "
                         f"dimension, got dtype {data.dtype}, shape {data.shape}, strides {data.strides}")
    if (ps - 1) * bpt + hb <= data.shape[1]:
        # [rows, page_size, hash_bytes] view: every byte it exposes lies inside its row.
        tokens = np.lib.stride_tricks.as_strided(
            data, shape=(data.shape[0], ps, hb), strides=(data.strides[0], bpt, 1), writeable=False)
        gather = lambda s: tokens[s // ps, s % ps]  # noqa: E731
    else:
        cols = np.arange(hb, dtype=np.int64)
        gather = lambda s: data[(s // ps)[:, None], ((s % ps) * bpt)[:, None] + cols]  # noqa: E731
    out = np.empty(len(slots), dtype=np.uint64)
    step = max(1, _GATHER_BYTES // max(hb, 1))
    for lo in range(0, len(slots), step):
        words = np.ascontiguousarray(gather(slots[lo:lo + step])).view("<u8")
        h = np.zeros(len(words), dtype=np.uint64)
        for w in range(words.shape[1]):
            h = sm_np(h ^ words[:, w])
        out[lo:lo + step] = h
    return out


def fingerprint(slots, sources: Sequence[RefSource]) -> np.ndarray:
    """Real-KV fingerprint (docs/format.md §3) of each slot in ``slots`` (int64, all >= 0) as uint64; 0 if no sources."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    total = np.zeros(len(slots), dtype=np.uint64)
    for src in sources:
        total = sm_np(total ^ _source_hash(slots, src))
    return total


def canary_words(canary: np.ndarray) -> np.ndarray:
    """int64 ``[num_slots, stride // 8]`` view of the canary buffer (no copy)."""
    return canary.view("<i8")


def slot_hash_words(words: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """:func:`slot_hash` of int64 ``slots`` over ``canary_words`` of a buffer."""
    rec = np.take(words, np.maximum(slots, 0), axis=0)
    h = mix3_np(rec[:, FIELD_PREV_HASH], rec[:, FIELD_TOKEN], rec[:, FIELD_POSITION])
    return np.where(slots < 0, np.uint64(ANCHOR_HASH), h)


def slot_hash(canary: np.ndarray, slots) -> np.ndarray:
    """``slot_hash`` (docs/format.md §3) per slot as uint64: sm(ANCHOR) for s < 0; s must be < num_slots."""
    return slot_hash_words(canary_words(canary), np.asarray(slots, dtype=np.int64).reshape(-1))
