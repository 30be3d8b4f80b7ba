"""The format-v1 hash functions (docs/format.md §3), on Python ints and on numpy arrays.

``sm`` is the splitmix64 finaliser and ``mix3(a, b, c) = sm(sm(sm(a) ^ b) ^ c)``; both work mod
2^64 and read signed (int64) inputs as their uint64 bit pattern. The numpy variants return uint64
arrays and never modify their inputs. Constants come from :mod:`kvcanary.abi`.
"""

from __future__ import annotations

import numpy as np

from kvcanary.abi import ANCHOR, SM_MUL1, SM_MUL2, SM_SHIFT1, SM_SHIFT2, SM_SHIFT3

MASK64 = (1 << 64) - 1


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
