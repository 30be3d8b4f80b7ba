"""Which bytes of one vLLM layer cache hold which token: each layout detected from shape AND strides.

Layouts (per layer, as the model runner hands them out):

- **packed** (vLLM main: K|V packed per head, PR #44455; layers are strided views into one shared
  buffer with a ``KVCacheLayout``, PR #51718): ``[num_blocks, heads, block_size, C]`` with
  ``C = head_size + head_size_v`` elements (K then V; MLA: ``head_size_v = 0``). The physical order
  of the block / head / token dims is one of the ``KVCacheLayout`` members (:data:`KV_CACHE_LAYOUTS`).
- **split** (vLLM <= 0.11-style): ``[2, num_blocks, block_size, heads, dim]`` (FlashAttention,
  ``kv_dim=0``) or ``[num_blocks, 2, block_size, heads, dim]`` (FlashInfer, ``kv_dim=1``), NHD or
  HND strides.
- **flat**: ``[num_blocks, block_size, dim]`` (MLA) or ``[num_blocks, block_size, heads, dim]``
  (one half), NHD or HND strides.

A 4-D cache can be packed or flat; when its strides fit both, the interpretation is refused with a
``kv-canary:`` error naming the candidates (pass ``layout=``). Slot ``s`` is token ``s % block_size``
of block ``s // block_size``. A half is fingerprinted where its bytes of one token are contiguous:
all heads when they are (NHD split / flat), else head 0 (HND; packed, where K and V alternate per head).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ValidationError, ValidationTypeError
from ..interop.arrays import from_pointer
from ..ops.sources import RealKvSource

#: vLLM's ``KVCacheLayout`` members -> physical order (outer to inner) of a layer view's
#: [B, H, N] dims (0 = blocks, 1 = heads, 2 = tokens; C is innermost in every member).
KV_CACHE_LAYOUTS = {"LBHNC": (0, 1, 2), "LBNHC": (0, 2, 1), "LHBNC": (1, 0, 2), "BLHNC": (0, 1, 2),
                    "BLNHC": (0, 2, 1), "BHLNC": (0, 1, 2)}
_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}   # vLLM's own compatibility aliases
_KINDS = ("packed", "split", "flat")
FINGERPRINT_FIX = ("fix: fingerprint=False (identity checks only: token, position and hash chain of "
                   "every slot), or fingerprint other layers")


@dataclass(frozen=True)
class Half:
    """Bytes of one half (K or V) of every slot: row ``b`` (stride ``row_stride``) holds block b, its
    token t at ``t * token_stride``; ``max_read`` contiguous bytes per token belong to this half."""

    ptr: int
    row_stride: int
    token_stride: int
    max_read: int


@dataclass(frozen=True)
class LayerLayout:
    kind: str                 # "packed", "split" or "flat"
    name: str                 # e.g. "packed LBNHC", "split kv_dim=0 HND"
    num_blocks: int
    block_size: int
    halves: tuple             # (K,) or (K, V) Half
    device: int | None
    owner: object

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def sources(self, read_bytes: int | None = None) -> list[RealKvSource]:
        return [self._source(h, i, read_bytes) for i, h in enumerate(self.halves)]

    def _source(self, h: Half, i: int, read_bytes) -> RealKvSource:
        what = f"{'KV'[i]} half of a vLLM {self.name} cache"
        if h.token_stride % 16 or h.row_stride % 16 or h.ptr % 16:
            raise ValidationError(
                f"kv-canary: the {what} must place tokens a multiple of 16 bytes apart, got tokens "
                f"{h.token_stride} bytes apart (rows {h.row_stride} bytes, "
                f"base 0x{h.ptr:x}); kvcanary fingerprints 16-byte words at 16-byte aligned addresses, so token "
                f"strides that are not a multiple of 16 (e.g. fp8_ds_mla's 584 B) cannot be read in place; "
                f"{FINGERPRINT_FIX}")
        limit = h.max_read if read_bytes is None else min(int(read_bytes), h.max_read)
        limit -= limit % 16
        if limit <= 0:
            raise ValidationError(f"kv-canary: the {what} must have at least the 16 contiguous bytes per token a "
                                  f"fingerprint reads, got {h.max_read}; {FINGERPRINT_FIX}")
        rows = from_pointer(h.ptr, (self.num_blocks, self.block_size * h.token_stride), np.uint8,
                            device=self.device, strides=(h.row_stride, 1), readonly=False, owner=self.owner)
        return RealKvSource(rows, self.block_size, h.token_stride, limit)


def resolve_layout_name(layout) -> str | None:
    """None for auto-detection, else "packed" / "split" / "flat" or a KVCacheLayout member name
    (an enum member, its name, or vLLM's aliases NHD / HND, e.g. ``cache_config.kv_cache_layout``)."""
    if layout is None or layout == "auto":
        return None
    name = getattr(layout, "name", layout)
    if not isinstance(name, str):
        raise ValidationTypeError(f"kv-canary: layout must be None, 'auto', 'packed', 'split', 'flat' or a vLLM "
                                  f"KVCacheLayout (member or name), got {layout!r}. Fix: pass "
                                  f"layout=vllm_config.cache_config.kv_cache_layout")
    upper = name.upper()
    name = _ALIASES.get(upper, upper) if upper in _ALIASES or upper in KV_CACHE_LAYOUTS else name.lower()
    if name not in KV_CACHE_LAYOUTS and name not in _KINDS:
        raise ValidationError(f"kv-canary: unknown layout {layout!r}; expected one of {list(_KINDS)} or a "
                              f"KVCacheLayout name {list(KV_CACHE_LAYOUTS)} (aliases NHD, HND), got {layout!r}; fix: "
                              f"pass layout=vllm_config.cache_config.kv_cache_layout")
    return name


def _fits(order, shape, strides, inner: int) -> bool:
    """Dims in ``order`` (outer to inner) are laid out without overlap above ``inner`` bytes."""
    need = inner
    for d in reversed(order):
        if shape[d] == 1:
            continue
        if strides[d] < need:
            return False
        need = strides[d] * shape[d]
    return True


def _packed(v, name, head_size, head_size_v):
    b, h, n, c = v.shape
    it = v.itemsize
    if v.strides[3] != it:
        return None
    if head_size is None and head_size_v is None:  # K|V of equal width
        if c % 2:
            return None
        hs = hsv = c // 2
    else:
        hs = c - int(head_size_v) if head_size is None else int(head_size)
        hsv = c - hs if head_size_v is None else int(head_size_v)
    if hs <= 0 or hsv < 0 or hs + hsv != c:
        return None
    fits = [m for m, order in KV_CACHE_LAYOUTS.items() if _fits(order, v.shape[:3], v.strides[:3], c * it)]
    if name is not None:
        fits = [m for m in fits if m == name]
    if not fits:
        return None
    halves = (Half(v.ptr, v.strides[0], v.strides[2], hs * it),)
    if hsv:
        halves += (Half(v.ptr + hs * it, v.strides[0], v.strides[2], hsv * it),)
    return LayerLayout("packed", f"packed {'/'.join(fits)}", b, n, halves, v.device, v)


def _flat_half(v, ptr, shape, strides):
    """[blocks, block_size, (heads,) dim] -> Half (NHD: all heads; HND: head 0), or None."""
    it = v.itemsize
    if strides[-1] != it:
        return None
    if len(shape) == 3:
        ok = _fits((0, 1), shape, strides, shape[2] * it)
        return Half(ptr, strides[0], strides[1], shape[2] * it) if ok else None
    b, n, h, d = shape
    if (h == 1 or strides[2] == d * it) and _fits((0, 1), shape, strides, h * d * it):   # NHD
        return Half(ptr, strides[0], strides[1], (h if strides[2] == d * it else 1) * d * it)
    if strides[1] == d * it and _fits((0, 2, 1), shape, strides, d * it):              # HND: head 0
        return Half(ptr, strides[0], strides[1], d * it)
    return None


def _flat(v):
    if len(v.shape) not in (3, 4):
        return None
    half = _flat_half(v, v.ptr, v.shape, v.strides)
    if half is None:
        return None
    hnd = len(v.shape) == 4 and v.shape[2] > 1 and v.strides[1] == v.shape[3] * v.itemsize
    return LayerLayout("flat", f"flat {'HND' if hnd else 'NHD'}", v.shape[0], v.shape[1], (half,), v.device, v)


def _split(v, kv_dim):
    if len(v.shape) != 5:
        return None
    if kv_dim == "auto":
        first, second = v.shape[0] == 2, v.shape[1] == 2
        if first == second:
            raise ValidationError(f"kv-canary: cannot tell the K/V dimension of a cache, got shape {tuple(v.shape)}; "
                                  f"fix: pass kv_dim=0 for [2, blocks, block_size, heads, dim] or kv_dim=1 for "
                                  f"[blocks, 2, block_size, heads, dim]")
        kv_dim = 0 if first else 1
    if kv_dim not in (0, 1) or v.shape[kv_dim] != 2:
        raise ValidationError(f"kv-canary: kv_dim={kv_dim} must name a dimension of extent 2 (0 or 1) of a 5-D "
                              f"cache, got shape {tuple(v.shape)}. Fix: kv_dim=0 for [2, blocks, ...], kv_dim=1 for "
                              f"[blocks, 2, ...], or kv_dim='auto'")
    shape = v.shape[:kv_dim] + v.shape[kv_dim + 1:]
    strides = v.strides[:kv_dim] + v.strides[kv_dim + 1:]
    halves = tuple(_flat_half(v, v.ptr + k * v.strides[kv_dim], shape, strides) for k in (0, 1))
    if None in halves:
        return None
    hnd = shape[2] > 1 and strides[1] == shape[3] * v.itemsize
    return LayerLayout("split", f"split kv_dim={kv_dim} {'HND' if hnd else 'NHD'}", shape[0], shape[1], halves,
                       v.device, v)


def detect(v, *, layout=None, kv_dim="auto", head_size=None, head_size_v=None) -> LayerLayout:
    """The :class:`LayerLayout` of a resolved array view ``v`` (see the module docstring)."""
    name = resolve_layout_name(layout)
    got = f"shape {tuple(v.shape)}, strides {tuple(v.strides)} bytes, dtype {v.dtype_name}"
    tries = {"packed": lambda: _packed(v, name if name in KV_CACHE_LAYOUTS else None, head_size, head_size_v)
             if len(v.shape) == 4 else None,
             "split": lambda: _split(v, kv_dim), "flat": lambda: _flat(v)}
    wanted = ["packed"] if name in KV_CACHE_LAYOUTS else [name] if name else list(tries)
    found = [r for r in (tries[k]() for k in wanted) if r is not None]
    if len(found) == 1:
        return found[0]
    if not found:
        other = _packed(v, None, head_size, head_size_v) if len(v.shape) == 4 and name else None
        hint = f" (its strides fit {other.name})" if other is not None else ""
        raise ValidationError(
            f"kv-canary: a vLLM layer cache must be packed [num_blocks, heads, block_size, head_size + head_size_v] "
            f"in a KVCacheLayout {list(KV_CACHE_LAYOUTS)}, split [2, num_blocks, block_size, heads, dim] / "
            f"[num_blocks, 2, ...] or flat [num_blocks, block_size, (heads,) dim], with a contiguous last dim; "
            f"{'as ' + repr(layout) + ' ' if name else ''}got {got}{hint}; fix: pass the runner's own per-layer cache "
            f"tensor and layout=vllm_config.cache_config.kv_cache_layout (head_size_v=0 for MLA)")
    raise ValidationError(
        f"kv-canary: ambiguous vLLM layer cache layout (got {got}): it could be {' or '.join(r.name for r in found)} "
        f"([num_blocks, heads, block_size, 2 * head_size] or [num_blocks, block_size, heads, head_size]); fix: pass "
        f"layout=vllm_config.cache_config.kv_cache_layout for vLLM's packed caches (head_size_v=0 for MLA), or "
        f"layout='flat'")
