"""SGLang-style KV pools: MHA, MLA, hybrid SWA and pools with separate scale tensors.

Duck-typed on the attributes SGLang's pools carry; SGLang itself is never imported:

- MHA (``MHATokenToKVPool``): ``k_buffer[i]`` and ``v_buffer[i]``, ``[slots, heads, dim]`` per layer
  (a list of tensors or one stacked ``[layers, slots, heads, dim]`` tensor);
- MLA (``MLATokenToKVPool``): ``kv_buffer[i]``, ``[slots, 1, dim]`` (one half: K);
- quantised pools (FP4/FP8 with block scales): ``k_scale_buffer[i]``, ``v_scale_buffer[i]`` or
  ``kv_scale_buffer[i]`` beside the data, ``[slots, ...]``: each fingerprinted layer then
  contributes a data source and a scale source, so a corrupted scale is caught like a corrupted value;
- hybrid SWA (``SWAKVPool``): ``full_kv_pool`` and ``swa_kv_pool`` (each one of the above) and the
  int64 map ``full_to_swa_index_mapping`` from full-pool slots to SWA-pool slots. The pool does not
  carry the window (no ``sliding_window_size``): pass ``window=``.

Sources are zero-copy views of the live buffers (docs/format.md §4): slot ``s`` is row ``s`` of every layer.
A tensor whose rows are not a multiple of 16 bytes (MLATokenToKVPoolFP4's 36-byte scale rows for a
576-wide cache) cannot be fingerprinted in place and is refused with the fix (``scales=False``).
:func:`sglang_batch` is in :mod:`.sglang_batch`.
"""

from __future__ import annotations

import math

from ..errors import ValidationError, ValidationTypeError
from ..interop.arrays import as_view
from ..manager.canary import KvCanary, PoolGroup
from ..ops.sources import source_from_slots
from ..validate import boolean, fail, integer, optional_integer
from .common import (astype, canary_kwargs, check_sizes, device_ordinal, layer_list, select_layers)
from .sglang_batch import sglang_batch  # noqa: F401  (re-exported)

_SCALE_NAMES = {"K": ("k_scale_buffer", "kv_scale_buffer"), "V": ("v_scale_buffer",)}


def is_swa_pool(pool) -> bool:
    return hasattr(pool, "full_kv_pool") and hasattr(pool, "swa_kv_pool")


def _halves(pool) -> dict[str, list]:
    """{"K": per-layer buffers, "V": ...} of an MHA or MLA pool."""
    if getattr(pool, "k_buffer", None) is not None:
        if getattr(pool, "v_buffer", None) is None:
            raise ValidationError(f"kv-canary: an MHA pool needs v_buffer beside k_buffer, got {type(pool).__name__} "
                                  f"with k_buffer only. Fix: pass the MHATokenToKVPool itself (MLA pools carry "
                                  f"kv_buffer instead)")
        return {"K": layer_list(pool.k_buffer, "pool.k_buffer"), "V": layer_list(pool.v_buffer, "pool.v_buffer")}
    if getattr(pool, "kv_buffer", None) is not None:
        return {"K": layer_list(pool.kv_buffer, "pool.kv_buffer")}
    raise ValidationError(f"kv-canary: an SGLang-style pool needs k_buffer/v_buffer (MHA) or kv_buffer (MLA), "
                          f"got {type(pool).__name__} without them. Fix: pass the model runner's "
                          f"token_to_kv_pool; for a hybrid SWA pool pass the SWAKVPool (full_kv_pool + "
                          f"swa_kv_pool) to sglang_groups")


def _check_scales(scales):
    if isinstance(scales, str) and scales.lower() == "auto":
        return "auto"
    if isinstance(scales, str):
        fail("scales", "'auto', True or False", scales, "pass scales='auto' (the default), True or False")
    if not isinstance(scales, bool):
        fail("scales", "'auto', True or False", scales, "pass scales='auto' (the default), True or False",
             kind=ValidationTypeError)
    return scales


def _scales(pool, half: str, scales) -> list | None:
    if scales is False:
        return None
    for name in _SCALE_NAMES[half]:
        buf = getattr(pool, name, None)
        if buf is not None:
            return layer_list(buf, f"pool.{name}")
    if scales is True and half == "K":
        raise ValidationError(f"kv-canary: scales=True needs a pool with k_scale_buffer or kv_scale_buffer, got "
                              f"{type(pool).__name__} without them; fix: scales='auto' or False")
    return None


def _source(tensor, what: str, read_bytes, fix: str):
    view = as_view(tensor, name=f"the {what}")  # metadata only: a kv-canary type error for a non-array
    row = math.prod(view.shape[1:]) * view.itemsize
    if row % 16:
        raise ValidationError(f"kv-canary: the {what} must hold a multiple of 16 bytes per token, got a tensor that "
                              f"holds {row} bytes per token (shape {view.shape}): kvcanary fingerprints "
                              f"16-byte words at 16-byte aligned rows, "
                              f"so these rows cannot be read in place; fix: {fix}")
    try:
        return source_from_slots(tensor, read_bytes=read_bytes)
    except (ValidationError, ValidationTypeError) as exc:
        raise type(exc)(f"kv-canary: the real-KV source of {what}: {str(exc).removeprefix('kv-canary: ')}") from exc


def sglang_sources(pool, *, layers=None, scales="auto", read_bytes: int | None = None):
    """``(k_sources, v_sources)`` of one MHA or MLA pool (MLA: ``v_sources`` is empty).

    ``layers``: None/"first" (default: layer 0), "all" (up to MAX_REAL_KV_SOURCES per half) or a list.
    ``scales``: "auto" adds the scale tensor of each chosen layer when the pool has one, True
    requires it, False ignores it. ``read_bytes`` caps the bytes fingerprinted in hash mode ALL
    (data sources only; scale sources are read whole)."""
    scales = _check_scales(scales)
    optional_integer("read_bytes", read_bytes, lo=16, fix="pass a multiple of 16, or None for every byte")
    halves = _halves(pool)
    scale_of = {h: _scales(pool, h, scales) for h in halves}
    per_layer = 2 if any(s is not None for s in scale_of.values()) else 1
    n_layers = len(halves["K"])
    chosen = select_layers(n_layers, layers, sources_per_layer=per_layer, what="SGLang pool")
    out = {}
    for h, bufs in halves.items():
        srcs = []
        for i in chosen:
            srcs.append(_source(bufs[i], f"{h} layer {i}", read_bytes,
                                "fingerprint=False (identity checks only: token, position and hash chain)"))
            if scale_of[h] is not None:
                srcs.append(_source(scale_of[h][i], f"{h} scales of layer {i}", None,
                                    "scales=False (the data is still fingerprinted; identity checks cover every "
                                    "slot)"))
        out[h] = srcs
    return out["K"], out.get("V", [])


def _num_slots(pool) -> int:
    bufs = [b for half in _halves(pool).values() for b in half]
    return check_sizes([b.shape[0] for b in bufs], "SGLang pool")


def sglang_pool_group(pool, *, layers=None, scales="auto", read_bytes: int | None = None,
                      fingerprint: bool = True) -> PoolGroup:
    """A :class:`PoolGroup` for one MHA or MLA pool; its slots are the buffers' rows (slot 0 is
    SGLang's padding slot, which kvcanary never verifies). ``fingerprint=False``: no real-KV
    sources (identity checks only)."""
    if not boolean("fingerprint", fingerprint):
        return PoolGroup(_num_slots(pool), (), (), halves=("K",))
    k, v = sglang_sources(pool, layers=layers, scales=scales, read_bytes=read_bytes)
    halves = ("K", "V") if v else ("K",)
    return PoolGroup(_num_slots(pool), k, v, halves=halves)


def sglang_groups(pool, *, layers=None, swa_layers=None, window: int | None = None, scales="auto",
                  read_bytes: int | None = None, fingerprint: bool = True) -> tuple[PoolGroup, PoolGroup | None]:
    """``(full, swa)`` groups of any SGLang-style pool; ``swa`` is None unless the pool is a hybrid
    SWA pool, which also needs the sliding ``window`` (tokens; SGLang keeps it on the model config)
    and a registered ``full_to_swa_index_mapping``. ``swa_layers`` picks SWA-pool layers like
    ``layers`` picks full-pool layers."""
    opts = dict(scales=scales, read_bytes=read_bytes, fingerprint=fingerprint)
    if not is_swa_pool(pool):
        return sglang_pool_group(pool, layers=layers, **opts), None
    window = window if window is not None else getattr(pool, "sliding_window_size", None)
    if window is not None:
        integer("window", window, fix="pass window=model_runner.sliding_window_size (the sliding window in tokens)")
    if window is None or int(window) < 1:
        raise ValidationError(f"kv-canary: a hybrid SWA pool needs window= (the sliding window in tokens), got "
                              f"{window!r}: SGLang's SWAKVPool does not carry it; fix: pass "
                              f"window=model_runner.sliding_window_size (or the model config's sliding_window)")
    mapping = getattr(pool, "full_to_swa_index_mapping", None)
    if mapping is None:
        raise ValidationError("kv-canary: the SWA pool must have its full_to_swa_index_mapping, got None (not "
                              "registered yet); fix: build the canary after the SWA allocator registered its mapping "
                              "(register_mapping)")
    full = sglang_pool_group(pool.full_kv_pool, layers=layers, **opts)
    swa = sglang_pool_group(pool.swa_kv_pool, layers=swa_layers, **opts)
    swa.window, swa.full_to_swa = int(window), astype(mapping, "int64")
    return full, swa


def sglang_canary(pool, *, layers=None, swa_layers=None, window: int | None = None, scales="auto",
                  read_bytes: int | None = None, fingerprint: bool = True, device="auto", **kwargs) -> KvCanary:
    """A :class:`KvCanary` shadowing ``pool`` on the pool's device (host pools run the CPU
    reference). Other keyword arguments go to :class:`KvCanary` (hash_mode, mode, max_batch, ...)."""
    canary_kwargs(kwargs, "sglang_canary")
    full, swa = sglang_groups(pool, layers=layers, swa_layers=swa_layers, window=window, scales=scales,
                              read_bytes=read_bytes, fingerprint=fingerprint)
    if device == "auto":
        first = pool.full_kv_pool if is_swa_pool(pool) else pool
        device = device_ordinal(next(iter(_halves(first).values()))[0])
    return KvCanary(full, swa, device=device, **kwargs)
