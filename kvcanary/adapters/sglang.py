"""SGLang-style KV pools: MHA, MLA, hybrid SWA and pools with separate scale tensors.

Duck-typed on the attributes SGLang's pools carry; SGLang itself is never imported:

- MHA (``MHATokenToKVPool``): ``k_buffer[i]`` and ``v_buffer[i]``, ``[slots, heads, dim]`` per layer
  (a list of tensors or one stacked ``[layers, slots, heads, dim]`` tensor);
- MLA (``MLATokenToKVPool``): ``kv_buffer[i]``, ``[slots, 1, dim]`` (one half: K);
- quantised pools (FP4/FP8 with block scales): ``k_scale_buffer[i]``, ``v_scale_buffer[i]`` or
  ``kv_scale_buffer[i]`` beside the data, ``[slots, ...]``: each fingerprinted layer then
  contributes a data source and a scale source, so a corrupted scale is caught like a corrupted value;
- hybrid SWA (``SWAKVPool``): ``full_kv_pool`` and ``swa_kv_pool`` (each one of the above) and the
  int64 map ``full_to_swa_index_mapping`` from full-pool slots to SWA-pool slots.

Sources are zero-copy views of the live buffers (SPEC §4): slot ``s`` is row ``s`` of every layer.
"""

from __future__ import annotations

from ..errors import ValidationError
from ..manager import KvCanary, PoolGroup
from ..plan import Batch
from ..sources import source_from_slots
from .common import astype, check_sizes, device_ordinal, layer_list, select_layers, where

_SCALE_NAMES = {"K": ("k_scale_buffer", "kv_scale_buffer"), "V": ("v_scale_buffer",)}


def is_swa_pool(pool) -> bool:
    return hasattr(pool, "full_kv_pool") and hasattr(pool, "swa_kv_pool")


def _halves(pool) -> dict[str, list]:
    """{"K": per-layer buffers, "V": ...} of an MHA or MLA pool."""
    if getattr(pool, "k_buffer", None) is not None:
        return {"K": layer_list(pool.k_buffer, "pool.k_buffer"), "V": layer_list(pool.v_buffer, "pool.v_buffer")}
    if getattr(pool, "kv_buffer", None) is not None:
        return {"K": layer_list(pool.kv_buffer, "pool.kv_buffer")}
    raise ValidationError(f"kv-canary: an SGLang-style pool needs k_buffer/v_buffer (MHA) or kv_buffer (MLA), "
                          f"got {type(pool).__name__} without them; for a hybrid SWA pool pass the SWAKVPool "
                          f"(full_kv_pool + swa_kv_pool) to sglang_groups")


def _scales(pool, half: str, scales) -> list | None:
    if scales is False:
        return None
    for name in _SCALE_NAMES[half]:
        buf = getattr(pool, name, None)
        if buf is not None:
            return layer_list(buf, f"pool.{name}")
    if scales is True and half == "K":
        raise ValidationError(f"kv-canary: scales=True but {type(pool).__name__} has no k_scale_buffer or "
                              f"kv_scale_buffer; fix: scales='auto' or False")
    return None


def _source(tensor, what: str, read_bytes):
    try:
        return source_from_slots(tensor, read_bytes=read_bytes)
    except ValidationError as exc:
        raise ValidationError(f"{exc} [while building the real-KV source of {what}]") from exc


def sglang_sources(pool, *, layers=None, scales="auto", read_bytes: int | None = None):
    """``(k_sources, v_sources)`` of one MHA or MLA pool (MLA: ``v_sources`` is empty).

    ``layers``: None/"first" (default: layer 0), "all" (up to MAX_REAL_KV_SOURCES per half) or a list.
    ``scales``: "auto" adds the scale tensor of each chosen layer when the pool has one, True
    requires it, False ignores it. ``read_bytes`` caps the bytes fingerprinted in hash mode ALL
    (data sources only; scale sources are read whole)."""
    halves = _halves(pool)
    scale_of = {h: _scales(pool, h, scales) for h in halves}
    per_layer = 2 if any(s is not None for s in scale_of.values()) else 1
    n_layers = len(halves["K"])
    chosen = select_layers(n_layers, layers, sources_per_layer=per_layer, what="SGLang pool")
    out = {}
    for h, bufs in halves.items():
        srcs = []
        for i in chosen:
            srcs.append(_source(bufs[i], f"{h} layer {i}", read_bytes))
            if scale_of[h] is not None:
                srcs.append(_source(scale_of[h][i], f"{h} scales of layer {i}", None))
        out[h] = srcs
    return out["K"], out.get("V", [])


def _num_slots(pool) -> int:
    bufs = [b for half in _halves(pool).values() for b in half]
    return check_sizes([b.shape[0] for b in bufs], "SGLang pool")


def sglang_pool_group(pool, *, layers=None, scales="auto", read_bytes: int | None = None) -> PoolGroup:
    """A :class:`PoolGroup` for one MHA or MLA pool; its slots are the buffers' rows (slot 0 is
    SGLang's padding slot, which kvcanary never verifies)."""
    k, v = sglang_sources(pool, layers=layers, scales=scales, read_bytes=read_bytes)
    halves = ("K", "V") if v else ("K",)
    return PoolGroup(_num_slots(pool), k, v, halves=halves)


def sglang_groups(pool, *, layers=None, swa_layers=None, window: int | None = None, scales="auto",
                  read_bytes: int | None = None) -> tuple[PoolGroup, PoolGroup | None]:
    """``(full, swa)`` groups of any SGLang-style pool; ``swa`` is None unless the pool is a hybrid
    SWA pool, which also needs the sliding ``window`` (tokens; SGLang keeps it on the model config)
    and a registered ``full_to_swa_index_mapping``. ``swa_layers`` picks SWA-pool layers like
    ``layers`` picks full-pool layers."""
    if not is_swa_pool(pool):
        return sglang_pool_group(pool, layers=layers, scales=scales, read_bytes=read_bytes), None
    window = window if window is not None else getattr(pool, "sliding_window_size", None)
    if window is None or int(window) < 1:
        raise ValidationError(f"kv-canary: a hybrid SWA pool needs window= (the sliding window in tokens, "
                              f"e.g. model_config.sliding_window), got {window!r}")
    mapping = getattr(pool, "full_to_swa_index_mapping", None)
    if mapping is None:
        raise ValidationError("kv-canary: the SWA pool has no full_to_swa_index_mapping yet; fix: build the "
                              "canary after the SWA allocator registered its mapping (register_mapping)")
    full = sglang_pool_group(pool.full_kv_pool, layers=layers, scales=scales, read_bytes=read_bytes)
    swa = sglang_pool_group(pool.swa_kv_pool, layers=swa_layers, scales=scales, read_bytes=read_bytes)
    swa.window, swa.full_to_swa = int(window), astype(mapping, "int64")
    return full, swa


def sglang_canary(pool, *, layers=None, swa_layers=None, window: int | None = None, scales="auto",
                  read_bytes: int | None = None, device="auto", **kwargs) -> KvCanary:
    """A :class:`KvCanary` shadowing ``pool`` on the pool's device (host pools run the CPU
    reference). Other keyword arguments go to :class:`KvCanary` (hash_mode, mode, max_batch, ...)."""
    full, swa = sglang_groups(pool, layers=layers, swa_layers=swa_layers, window=window, scales=scales,
                              read_bytes=read_bytes)
    if device == "auto":
        device = device_ordinal(full.k_sources[0].tensor)
    return KvCanary(full, swa, device=device, **kwargs)


def sglang_batch(forward_batch, req_to_token, *, full_to_swa=None, expected_input_ids=None,
                 expected_positions=None) -> Batch:
    """A :class:`Batch` from an SGLang-style ``ForwardBatch`` (duck-typed: ``req_pool_indices``,
    ``seq_lens``, ``extend_prefix_lens``/``extend_seq_lens`` in extend mode, ``input_ids``,
    ``positions``, ``out_cache_loc``) and ``req_to_token`` (a ``ReqToTokenPool`` or its int32 array).

    Decode batches (no ``extend_seq_lens``) get one new token per request. With ``full_to_swa``
    the SWA slots of the new tokens are gathered from it on the device. Only dtype casts and
    elementwise arithmetic run, on the arrays' device; nothing is read back to the host."""
    fb = forward_batch
    rtt = getattr(req_to_token, "req_to_token", req_to_token)
    seq = astype(fb.seq_lens, "int64")
    ext = getattr(fb, "extend_seq_lens", None)
    if ext is None:
        extend, prefix = seq * 0 + 1, seq - 1
    else:
        extend = astype(ext, "int64")
        pre = getattr(fb, "extend_prefix_lens", None)
        prefix = seq - extend if pre is None else astype(pre, "int64")
    loc = astype(fb.out_cache_loc, "int64")
    swa_loc = None
    if full_to_swa is not None:  # -1 (skip) stays -1 whatever the map's last entry holds
        swa_loc = where(loc < 0, loc, astype(full_to_swa, "int64")[loc])
    return Batch(astype(fb.req_pool_indices, "int64"), prefix, extend, astype(rtt, "int32"),
                 input_ids=astype(fb.input_ids, "int64"), positions=astype(fb.positions, "int64"),
                 out_cache_loc=loc, swa_out_cache_loc=swa_loc, expected_input_ids=expected_input_ids,
                 expected_positions=expected_positions)
