"""vLLM-style paged KV caches, block tables and attention metadata.

Per-layer caches, duck-typed (vLLM is never imported); :mod:`.vllm_layout` detects each layer's
layout from its shape AND strides: vLLM main's packed ``[num_blocks, heads, block_size, 2 *
head_size]`` views in any ``KVCacheLayout`` (pass ``layout=cache_config.kv_cache_layout``), the
older split ``[2, num_blocks, block_size, heads, dim]`` / ``[num_blocks, 2, ...]`` caches and flat
MLA ``[num_blocks, block_size, dim]`` ones. A shape the strides cannot place, or a 4-D cache that
fits more than one layout, is a ``kv-canary:`` error naming the candidates.

Slot ``s`` is token ``s % block_size`` of block ``s // block_size`` (vLLM's slot mapping), so the
canary has ``num_blocks * block_size`` slots and slot 0 is in vLLM's reserved null block.

vLLM has a block table instead of ``req_to_token``: :func:`block_table_to_req_to_token` expands it
on the arrays' own device (torch ops for torch tensors, CuPy for CuPy arrays, numpy on the host),
with no host round trip, and :func:`vllm_batch` turns vLLM's attention metadata into a
:class:`~kvcanary.Batch` (``slot_mapping`` becomes ``out_cache_loc``). In vLLM V1
``forward_context.attn_metadata`` is a dict keyed by layer name (a list of such dicts with
micro-batching): :func:`vllm_metadata` picks one layer's entry, :func:`vllm_batch_from_metadata`
reads it.
"""

from __future__ import annotations

from ..arrays import as_view
from ..errors import ValidationError
from ..manager import KvCanary, PoolGroup
from ..plan import Batch
from ..sources import resolved
from .common import arange, astype, check_sizes, device_ordinal, require_attr, select_layers, where, zeros
from .vllm_layout import detect


def vllm_layer_layout(cache, *, layout=None, kv_dim="auto", head_size=None, head_size_v=None):
    """The detected :class:`~.vllm_layout.LayerLayout` of one layer's cache. ``kv_dim=None`` (the old
    spelling for a cache without a K/V dimension) means ``layout="flat"``."""
    if kv_dim is None and layout is None:
        layout, kv_dim = "flat", "auto"
    v = resolved(as_view(cache, name="vLLM cache"))
    return detect(v, layout=layout, kv_dim=kv_dim, head_size=head_size, head_size_v=head_size_v)


def vllm_layer_sources(cache, *, layout=None, kv_dim="auto", head_size=None, head_size_v=None,
                       read_bytes: int | None = None):
    """``(k_source, v_source)`` of one layer's cache; ``v_source`` is None for a cache with one half
    (flat, or packed MLA with ``head_size_v=0``). ``read_bytes`` caps the bytes hash mode ALL reads."""
    srcs = vllm_layer_layout(cache, layout=layout, kv_dim=kv_dim, head_size=head_size,
                             head_size_v=head_size_v).sources(read_bytes)
    return srcs[0], (srcs[1] if len(srcs) > 1 else None)


def _layers(kv_caches) -> list:
    if isinstance(kv_caches, dict):
        return list(kv_caches.values())
    if isinstance(kv_caches, (list, tuple)):
        return list(kv_caches)
    return [kv_caches]


def vllm_pool_group(kv_caches, *, layers=None, layout=None, kv_dim="auto", head_size=None, head_size_v=None,
                    read_bytes: int | None = None, fingerprint: bool = True) -> PoolGroup:
    """A :class:`PoolGroup` over per-layer caches (a list, a dict name -> tensor in layer order, or
    one tensor). ``layers``: None/"first", "all" or a list of layer indices. ``fingerprint=False``
    builds no real-KV sources (identity checks only), for caches whose tokens cannot be read as
    16-byte words (e.g. fp8_ds_mla's 584 B per token)."""
    caches = _layers(kv_caches)
    chosen = select_layers(len(caches), layers, what="vLLM cache list")
    found = [vllm_layer_layout(caches[i], layout=layout, kv_dim=kv_dim, head_size=head_size,
                               head_size_v=head_size_v) for i in chosen]
    slots = check_sizes([f.num_slots for f in found], "vLLM cache list")
    if len({len(f.halves) for f in found}) != 1:
        raise ValidationError(f"kv-canary: mix of caches with one and two halves ({[f.name for f in found]}); "
                              f"fix: pass the layers of one KV cache group")
    if not fingerprint:
        return PoolGroup(slots, (), (), halves=("K",))
    pairs = [f.sources(read_bytes) for f in found]
    k_src = [p[0] for p in pairs]
    v_src = [p[1] for p in pairs if len(p) > 1]
    return PoolGroup(slots, k_src, v_src, halves=("K", "V") if v_src else ("K",))


def vllm_canary(kv_caches, *, layers=None, layout=None, kv_dim="auto", head_size=None, head_size_v=None,
                read_bytes: int | None = None, fingerprint: bool = True, device="auto", **kwargs) -> KvCanary:
    """A :class:`KvCanary` over vLLM-style caches; keyword arguments go to :class:`KvCanary`."""
    group = vllm_pool_group(kv_caches, layers=layers, layout=layout, kv_dim=kv_dim, head_size=head_size,
                            head_size_v=head_size_v, read_bytes=read_bytes, fingerprint=fingerprint)
    if device == "auto":
        first = _layers(kv_caches)[select_layers(len(_layers(kv_caches)), layers)[0]]
        device = device_ordinal(first)
    return KvCanary(group, device=device, **kwargs)


def block_table_to_req_to_token(block_table, seq_lens, block_size: int, *, max_len: int | None = None, out=None):
    """int32 ``[bs + 1, max_len]`` slot map from a block table (int ``[bs, max_blocks]``) and
    ``seq_lens`` (int ``[bs]``): row ``r + 1`` holds request r's slots ``block * block_size + offset``
    for positions ``< seq_lens[r]`` and 0 past them; row 0 is the padding row (all 0).

    Runs on the block table's own device with its framework (torch, CuPy or numpy), never reading
    back to the host. ``max_len`` defaults to ``max_blocks * block_size`` (may not exceed it). ``out``
    (int32, ``[>= bs + 1, max_len]``, same device) is filled in place and returned, so a captured
    CUDA graph keeps one address; otherwise a new array is returned."""
    n, max_blocks = (int(d) for d in block_table.shape)
    cap = max_blocks * int(block_size)
    length = cap if max_len is None else int(max_len)
    if block_size < 1 or not 0 < length <= cap:
        raise ValidationError(f"kv-canary: need block_size >= 1 and 0 < max_len <= max_blocks * block_size "
                              f"({max_blocks} * {block_size}), got block_size={block_size}, max_len={max_len}")
    pos = arange(block_table, 0, length)
    blocks = astype(block_table[:, pos // block_size], "int64")
    slots = blocks * block_size + pos % block_size
    live = pos[None, :] < astype(seq_lens[:n], "int64")[:, None]
    slots = astype(where(live, slots, 0), "int32")
    if out is None:
        out = zeros(block_table, (n + 1, length), "int32")
    elif out.shape[0] < n + 1 or out.shape[1] != length:
        raise ValidationError(f"kv-canary: out must have shape (>= {n + 1}, {length}), got {tuple(out.shape)}")
    out[0] = 0
    out[1:n + 1] = slots
    return out


def vllm_batch(*, block_table, seq_lens, query_start_loc, slot_mapping, input_ids, positions, block_size: int,
               num_reqs: int | None = None, num_tokens: int | None = None, max_len: int | None = None,
               req_to_token=None, expected_input_ids=None, expected_positions=None) -> Batch:
    """A :class:`Batch` from vLLM-style attention metadata, computed on the arrays' device.

    ``seq_lens`` are total lengths after this step (cached + scheduled), ``query_start_loc``
    (``[num_reqs + 1]``) delimits each request's new tokens, ``slot_mapping`` is their slots (-1 =
    padding, skipped). Request r gets request-pool row r + 1 (row 0 is padding). ``num_reqs`` and
    ``num_tokens`` trim padded metadata; ``req_to_token`` is an optional preallocated output for
    :func:`block_table_to_req_to_token`."""
    rows = min(int(block_table.shape[0]), int(query_start_loc.shape[0]) - 1)
    n = rows if num_reqs is None else int(num_reqs)
    qsl = astype(query_start_loc[:n + 1], "int64")
    extend = qsl[1:] - qsl[:-1]
    seq = astype(seq_lens[:n], "int64")
    rtt = block_table_to_req_to_token(block_table[:n], seq, block_size, max_len=max_len, out=req_to_token)
    t = int(input_ids.shape[0]) if num_tokens is None else int(num_tokens)
    return Batch(arange(seq, 1, n + 1), seq - extend, extend, rtt,
                 input_ids=astype(input_ids[:t], "int64"), positions=astype(positions[:t], "int64"),
                 out_cache_loc=astype(slot_mapping[:t], "int64"), expected_input_ids=expected_input_ids,
                 expected_positions=expected_positions)


_METADATA_FIELDS = ("block_table", "seq_lens", "query_start_loc", "slot_mapping")


def vllm_metadata(attn_metadata, layer_name: str | None = None):
    """One layer's attention metadata from what ``forward_context.attn_metadata`` holds: a dict
    keyed by layer name (vLLM V1: every layer of a KV cache group shares one object) or one metadata
    object. ``layer_name`` picks the layer (required when the dict holds several groups' objects).
    A list (micro-batching: one dict per micro-batch) is refused: each micro-batch is its own step."""
    if isinstance(attn_metadata, (list, tuple)):
        raise ValidationError(f"kv-canary: expected one step's attention metadata, got a list of "
                              f"{len(attn_metadata)} (vLLM micro-batching); fix: build one Batch per micro-batch "
                              f"from attn_metadata[i] with that micro-batch's tokens")
    if isinstance(attn_metadata, dict):
        if not attn_metadata:
            raise ValidationError("kv-canary: attn_metadata is an empty dict (no attention this step, e.g. a "
                                  "profiling run); fix: skip the canary for this step")
        if layer_name is not None:
            if layer_name not in attn_metadata:
                raise ValidationError(f"kv-canary: attn_metadata has no layer {layer_name!r}; expected one of "
                                      f"{list(attn_metadata)[:8]}...; fix: pass a layer name of the shadowed group")
            return attn_metadata[layer_name]
        distinct = {id(m): m for m in attn_metadata.values()}
        if len(distinct) > 1:
            raise ValidationError(f"kv-canary: attn_metadata holds {len(distinct)} different metadata objects "
                                  f"(several KV cache groups); fix: pass layer_name= a layer of the group the "
                                  f"canary shadows, e.g. {next(iter(attn_metadata))!r}")
        return next(iter(distinct.values()))
    return attn_metadata


def vllm_batch_from_metadata(attn_metadata, *, input_ids, positions, block_size: int, layer_name: str | None = None,
                             num_reqs: int | None = None, **kwargs) -> Batch:
    """:func:`vllm_batch` from one step's attention metadata (see :func:`vllm_metadata`): reads
    ``block_table``, ``seq_lens``, ``query_start_loc``, ``slot_mapping`` and ``num_actual_tokens``
    (each missing one is a ``kv-canary:`` error naming it). Other keyword arguments go to
    :func:`vllm_batch` (``max_len``, ``req_to_token``, ``expected_input_ids``, ...)."""
    md = vllm_metadata(attn_metadata, layer_name)
    fix = "pass the metadata of a full-attention layer (e.g. FlashAttentionMetadata), or call vllm_batch"
    fields = {name: require_attr(md, name, "the attention metadata", fix) for name in _METADATA_FIELDS}
    tokens = getattr(md, "num_actual_tokens", None)
    return vllm_batch(**fields, input_ids=input_ids, positions=positions, block_size=block_size, num_reqs=num_reqs,
                      num_tokens=None if tokens is None else int(tokens), **kwargs)
