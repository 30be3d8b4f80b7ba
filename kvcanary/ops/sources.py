"""Real-KV sources (docs/format.md §4): which bytes of the live KV pool a fingerprint covers.

Validation here never touches the driver. :class:`RealKvSource` checks its numbers when built;
:func:`marshal_sources` checks the array layout for a launch (or the CPU reference) and produces
the ABI descriptors. The layout helpers build correct sources from common pool layouts without
copying, so the canary always reads the live pool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from .. import abi
from ..errors import ValidationError, ValidationTypeError
from ..interop.arrays import ArrayView, as_view, from_pointer
from ..interop.dlpack import ndarray_at
from ..validate import INT32_MAX, fail, integer, optional_integer
from ..validate import hash_mode as parse_hash_mode


def resolved(view: ArrayView) -> ArrayView:
    """``view`` with an unknown CUDA ordinal (-1, e.g. a bare CAI producer) asked of the driver."""
    if view.device != -1:
        return view
    from ..runtime.driver import (
        pointer_device,  # imported here: validation never imports the driver at module level
    )
    return replace(view, device=pointer_device(view.ptr))


_FIX_2D = "reshape to [num_slots, bytes_per_slot], e.g. t.view(t.shape[0], -1)"


@dataclass(frozen=True)
class RealKvSource:
    """Bytes of the KV pool fingerprinted per slot.

    Slot s reads ``eff`` bytes at row ``s // page_size``, byte ``(s % page_size) * num_bytes_per_token``
    of ``tensor`` viewed as uint8 ``[rows, row_bytes]`` (``eff`` = 16 in PARTIAL, ``read_bytes`` in
    ALL). ``tensor`` is any device array (torch, CuPy, JAX, DLPack or CAI producer, a kvcanary
    array) or a host array for the CPU backend. ``read_bytes`` defaults to ``num_bytes_per_token``.
    """

    tensor: Any
    page_size: int
    num_bytes_per_token: int
    read_bytes: int | None = None

    def __post_init__(self):
        integer("RealKvSource.page_size", self.page_size, lo=1, hi=INT32_MAX,
                fix="pass the tokens per row of the tensor (1 for a [slots, ...] pool)")
        n = integer("RealKvSource.num_bytes_per_token", self.num_bytes_per_token,
                    fix="pass the bytes one token occupies in a row, a multiple of 16")
        if n <= 0 or n % abi.REAL_KV_ALIGN or n > INT32_MAX:
            fail("RealKvSource.num_bytes_per_token", "a positive multiple of 16", n,
                 "kvcanary reads 16-byte words: pass the token's bytes in a row (pad the token to 16 bytes, or "
                 "fingerprint another tensor)")
        if self.read_bytes is None:
            object.__setattr__(self, "read_bytes", n)
        rb = integer("RealKvSource.read_bytes", self.read_bytes, fix="pass a multiple of 16, or None for all bytes")
        if rb <= 0 or rb % abi.REAL_KV_ALIGN or rb > n:
            fail("RealKvSource.read_bytes", f"a positive multiple of 16 in (0, num_bytes_per_token={n}]", rb,
                 f"pass e.g. read_bytes={min(n, 16)}, or None for all {n} bytes")
        view = resolved(as_view(self.tensor, name="RealKvSource.tensor"))
        if len(view.shape) < 2:
            raise ValidationError(f"kv-canary: RealKvSource.tensor must be at least 2-D, got shape "
                                  f"{view.shape}. Fix: {_FIX_2D}")
        if view.strides[0] % abi.REAL_KV_ALIGN:
            raise ValidationError(
                f"kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, got "
                f"{view.strides[0]} bytes (shape={view.shape}, strides={view.strides}, "
                f"dtype={view.dtype_name}). Fix: pad each row to a multiple of 16 bytes")
        object.__setattr__(self, "_view", view)

    @property
    def view(self) -> ArrayView:
        return self._view  # type: ignore[attr-defined]


@dataclass(frozen=True)
class MarshalledSource:
    """A validated source: its uint8 [rows, row_bytes] view and ABI numbers."""

    view: ArrayView
    page_size: int
    bytes_per_token: int
    hash_bytes: int

    @property
    def rows(self) -> int:
        return self.view.shape[0]


def hash_bytes_for(source: RealKvSource, mode: abi.HashMode) -> int:
    return abi.PARTIAL_HASH_BYTES if mode == abi.HashMode.PARTIAL else int(source.read_bytes)


def source_list(sources, name: str = "real_kv_sources") -> tuple[RealKvSource, ...]:
    """``sources`` (a list or tuple of :class:`RealKvSource`) as a tuple; anything else is a
    ValidationTypeError (an array, one bare source or None is not a list of sources)."""
    wrap = "wrap each array: RealKvSource(tensor, page_size, num_bytes_per_token) or kvcanary.source_from_slots(pool)"
    if not isinstance(sources, (list, tuple)):
        fail(name, "a list or tuple of kvcanary.RealKvSource", sources,
             f"pass [source, ...] (() for none); {wrap}", kind=ValidationTypeError)
    for i, src in enumerate(sources):
        if not isinstance(src, RealKvSource):
            fail(f"{name}[{i}]", "a kvcanary.RealKvSource", src, wrap, kind=ValidationTypeError)
    return tuple(sources)


def marshal_sources(sources: Sequence[RealKvSource], mode: abi.HashMode, num_slots: int) -> tuple[MarshalledSource, ...]:
    """Validate sources for a launch; mode NONE fingerprints nothing (no sources are read)."""
    sources, mode = source_list(sources), parse_hash_mode(mode, "hash mode")
    if len(sources) > abi.MAX_REAL_KV_SOURCES:
        raise ValidationError(f"kv-canary: at most {abi.MAX_REAL_KV_SOURCES} RealKvSource entries "
                              f"supported by the CUDA ABI, got {len(sources)}. Fix: fingerprint fewer "
                              f"layers (e.g. the first layer only) or split them across contexts")
    out = []
    for i, src in enumerate(sources):
        v = src.view
        if len(v.shape) != 2:
            raise ValidationError(f"kv-canary: real_kv_sources[{i}].tensor (viewed as uint8) must be "
                                  f"2-D, got {len(v.shape)}-D. Fix: {_FIX_2D} (or build it with "
                                  f"kvcanary.sources_from_pages / sources_from_layers)")
        if v.strides[1] != v.dtype.itemsize:
            raise ValidationError(f"kv-canary: real_kv_sources[{i}].tensor must have a contiguous "
                                  f"inner dimension, got strides {v.strides} bytes for shape {v.shape} "
                                  f"and itemsize {v.dtype.itemsize}; fix: t.contiguous() on the pool, "
                                  f"or pass the pool in its storage layout")
        if v.ptr % abi.REAL_KV_ALIGN:
            raise ValidationError(f"kv-canary: real_kv_sources[{i}].tensor base address must be "
                                  f"16-byte aligned for 16-byte loads, got 0x{v.ptr:x}; fix: slice the "
                                  f"pool at a 16-byte boundary or pass the whole allocation")
        row_bytes = v.shape[1] * v.dtype.itemsize
        need = src.page_size * src.num_bytes_per_token
        if need > row_bytes:
            raise ValidationError(f"kv-canary: real_kv_sources[{i}] needs page_size * num_bytes_per_token "
                                  f"= {src.page_size} * {src.num_bytes_per_token} = {need} bytes per row, "
                                  f"got rows of {row_bytes} bytes (shape={v.shape}, dtype={v.dtype_name}); "
                                  f"fix: page_size or num_bytes_per_token")
        if mode != abi.HashMode.NONE and v.shape[0] * src.page_size < num_slots:
            raise ValidationError(f"kv-canary: real_kv_sources[{i}] covers {v.shape[0] * src.page_size} "
                                  f"slots ({v.shape[0]} rows x page_size {src.page_size}) but the canary "
                                  f"buffer has {num_slots}: expected at least {num_slots}, got "
                                  f"{v.shape[0] * src.page_size}; fix: pass the whole pool, or size the canary "
                                  f"buffer to the pool")
        u8 = from_pointer(v.ptr, (v.shape[0], row_bytes), np.uint8, device=v.device,
                          strides=(v.strides[0], 1), readonly=True, owner=v)
        out.append(MarshalledSource(u8, int(src.page_size), int(src.num_bytes_per_token),
                                    hash_bytes_for(src, mode)))
    return tuple(out) if mode != abi.HashMode.NONE else ()


# ---- layout helpers ------------------------------------------------------------------------------
def rows_view(pool, name: str) -> ArrayView:
    """An allocated pool ``[rows, ...]`` (any array :func:`~kvcanary.interop.arrays.as_view` takes) as uint8
    ``[rows, row_bytes]``, without copying: row = dims 1.. collapsed, which requires them to be
    contiguous; the row stride is the array's real ``strides[0]`` (a per-layer slice of a larger
    buffer keeps its stride). A single row gets stride row_bytes. Any other layout is a
    ``kv-canary:`` error that says what is wrong with it."""
    v = resolved(as_view(pool, name=name))
    if v.ndim >= 2 and not v.numel:
        raise ValidationError(f"kv-canary: {name} must hold at least one row of bytes, got shape {v.shape}. Fix: pass "
                              f"the allocated pool")
    if v.ndim < 2:
        raise ValidationError(f"kv-canary: {name}: expected an array of at least 2 dimensions to view as uint8 "
                              f"[rows, row_bytes], got {v.ndim}-D shape {v.shape}. Fix: {_FIX_2D}")
    row_bytes = v.itemsize
    for i in range(v.ndim - 1, 0, -1):
        n, s = v.shape[i], v.strides[i]
        if n != 1 and s != row_bytes:
            what = ("a contiguous last dimension (stride == itemsize)" if i == v.ndim - 1
                    else "dims 1.. that collapse into one contiguous row")
            raise ValidationError(f"kv-canary: {name}: expected {what} to view as uint8 [rows, row_bytes], i.e. "
                                  f"dim {i} stride {row_bytes} bytes, got {s} bytes ({v.describe()}). Fix: pass the "
                                  f"buffer in its storage layout, not a transposed or permuted view (a .contiguous() "
                                  f"copy would be a stale snapshot), then {_FIX_2D}")
        row_bytes *= n
    rows = v.shape[0]
    row_stride = v.strides[0] if rows > 1 else row_bytes
    if row_stride < 0:
        raise ValidationError(f"kv-canary: {name}: expected a non-negative row stride, got {row_stride} bytes "
                              f"({v.describe()}). Fix: pass the buffer itself, not a reversed view")
    shape, strides = (rows, row_bytes), (row_stride, 1)
    host = None if v.host is None else ndarray_at(v.ptr, shape, strides, np.uint8, readonly=v.readonly, owner=v)
    return ArrayView(v.ptr, shape, strides, np.dtype(np.uint8), "uint8", v.device, v.readonly, v, v.stream, host)


def sources_from_pages(pool, *, page_size: int | None = None, read_bytes: int | None = None) -> RealKvSource:
    """A paged pool ``[pages, page_size, ...]`` (any dtype): one row per page. ``page_size``
    (default ``pool.shape[1]``) tokens share a row, each ``row bytes / page_size`` bytes."""
    optional_integer("page_size", page_size, lo=1, hi=INT32_MAX, fix="pass the tokens per page, or leave it out")
    v = as_view(pool, name="pool")
    if len(v.shape) < 2:
        raise ValidationError(f"kv-canary: pool must be [pages, page_size, ...], got shape {v.shape}. Fix: pass "
                              f"the paged pool itself (e.g. [num_blocks, block_size, heads, dim])")
    rows = rows_view(pool, "pool")
    page = v.shape[1] if page_size is None else int(page_size)
    if page < 1 or rows.shape[1] % page or (rows.shape[1] // page) % abi.REAL_KV_ALIGN:
        fail("page_size", f"a divisor of the page's {rows.shape[1]} bytes into tokens of a multiple of 16 bytes",
             page, f"pass the pool's tokens per page (its shape[1] = {v.shape[1]})")
    return RealKvSource(rows, page, rows.shape[1] // page, read_bytes)


def source_from_slots(pool, *, read_bytes: int | None = None) -> RealKvSource:
    """One layer's per-token pool: ``[slots, bytes]`` or ``[slots, heads, dim]`` (SGLang MHA; MLA
    ``[slots, 1, dim]``). A 4-D array is refused: a ``[layers, slots, heads, dim]`` stack would read
    as ``layers`` slots (use :func:`sources_from_layers` for it)."""
    shape = as_view(pool, name="pool").shape
    if len(shape) > 3:
        raise ValidationError(f"kv-canary: source_from_slots(pool) takes one layer's pool, [slots, bytes] or [slots, "
                              f"heads, dim], got a {len(shape)}-D array of shape {shape} (a [layers, slots, heads, "
                              f"dim] stack would be read as {shape[0]} slots). Fix: pass pool[layer], or "
                              f"kvcanary.sources_from_layers(pool) for a source per layer")
    rows = rows_view(pool, "pool")
    if rows.shape[1] % abi.REAL_KV_ALIGN or not rows.shape[1]:
        raise ValidationError(f"kv-canary: pool must hold a positive multiple of {abi.REAL_KV_ALIGN} bytes per slot, "
                              f"got {rows.shape[1]} bytes per slot (shape {shape}). Fix: pad the token to "
                              f"{abi.REAL_KV_ALIGN} bytes, or fingerprint another tensor (identity checks need none)")
    return RealKvSource(rows, 1, rows.shape[1], read_bytes)


def sources_from_vllm(cache, *, read_bytes: int | None = None) -> tuple[RealKvSource, RealKvSource]:
    """A split cache ``[2, blocks, block_size, heads, dim]`` whose dims after the first are
    contiguous: (K half, V half), each as :func:`sources_from_pages` builds it (``read_bytes`` exact,
    as :class:`RealKvSource` takes it). For vLLM's own per-layer caches (packed ``KVCacheLayout``
    views, HND strides, MLA) use :func:`kvcanary.adapters.vllm_layer_sources`, which detects the
    layout and caps ``read_bytes`` per layer."""
    v = as_view(cache, name="cache")
    if len(v.shape) < 4 or v.shape[0] != 2:
        raise ValidationError(f"kv-canary: a vLLM-style cache must be [2, num_blocks, block_size, "
                              f"heads, dim], got shape {v.shape}. Fix: pass one layer's cache, or use "
                              f"kvcanary.adapters.vllm_layer_sources for other layouts")
    halves = []
    for h in range(2):
        half = from_pointer(v.ptr + h * v.strides[0], v.shape[1:], v.dtype, device=v.device,
                            strides=v.strides[1:], readonly=v.readonly, owner=v)
        halves.append(sources_from_pages(half, read_bytes=read_bytes))
    return halves[0], halves[1]


def sources_from_layers(layers: Sequence, *, read_bytes: int | None = None, page_size: int | None = None) -> list[RealKvSource]:
    """One source per layer of a per-layer list: ``[slots, ...]`` tensors, or ``[pages, page_size, ...]``
    when ``page_size`` is given. A stacked ``[layers, ...]`` array works as a list of its layers."""
    if isinstance(layers, (str, bytes, dict)) or not (isinstance(layers, (list, tuple)) or hasattr(layers, "shape")):
        fail("layers", "a list or tuple of per-layer arrays (or one stacked [layers, ...] array)", layers,
             "pass e.g. [k_layer0, k_layer1, ...]", kind=ValidationTypeError)
    if not isinstance(layers, (list, tuple)):
        layers = [layers[i] for i in range(int(layers.shape[0]))]
    if page_size is None:
        return [source_from_slots(t, read_bytes=read_bytes) for t in layers]
    return [sources_from_pages(t, page_size=page_size, read_bytes=read_bytes) for t in layers]
