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

import sys

import numpy as np

from ..errors import ValidationError, ValidationTypeError
from ..interop.arrays import as_view
from ..manager.canary import KvCanary, PoolGroup
from ..ops.batch import Batch
from ..ops.sources import resolved
from ..validate import boolean, fail, integer, is_int, optional_integer
from .common import (arange, astype, canary_kwargs, check_sizes, device_ordinal, framework, is_plain_int_tensor,
                     kept_tensors, require_attr, select_layers, where, zeros)
from .vllm_layout import detect


class _Shape:
    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = shape


def _int_array(name: str, value, ndim: int, dtype=None):
    """The view of an integer array argument (metadata only: no element is read); a plain strided
    torch tensor that passes every check of :func:`as_view` here is read without building a view."""
    if is_plain_int_tensor(value, ndim, None if dtype is None else np.dtype(dtype).name):
        return _Shape(tuple(value.shape))
    v = as_view(value, name=name)
    want = "an integer dtype" if dtype is None else f"dtype {np.dtype(dtype).name}"
    if v.dtype.kind not in "iu" or (dtype is not None and v.dtype != np.dtype(dtype)):
        raise ValidationTypeError(f"kv-canary: {name} must have {want}, got {v.dtype_name}. Fix: pass the "
                                  f"engine's own {name}" + ("" if dtype is None else f", allocated as {want}"))
    if v.ndim != ndim:
        raise ValidationError(f"kv-canary: {name} must be {ndim}-D, got shape {v.shape}. Fix: pass the "
                              f"metadata's {name} itself")
    return v


def vllm_layer_layout(cache, *, layout=None, kv_dim="auto", head_size=None, head_size_v=None):
    """The detected :class:`~.vllm_layout.LayerLayout` of one layer's cache. ``kv_dim=None`` (the old
    spelling for a cache without a K/V dimension) means ``layout="flat"``."""
    if kv_dim is None and layout is None:
        layout, kv_dim = "flat", "auto"
    if kv_dim is not None and kv_dim != "auto" and not is_int(kv_dim):
        fail("kv_dim", "'auto', 0 or 1", kv_dim, "kv_dim=0 for [2, blocks, ...], kv_dim=1 for [blocks, 2, ...]",
             kind=ValidationTypeError)
    optional_integer("head_size", head_size, lo=1, fix="pass the K head size in elements")
    optional_integer("head_size_v", head_size_v, lo=0, fix="pass the V head size in elements (0 for MLA)")
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
    boolean("fingerprint", fingerprint)
    caches = _layers(kv_caches)
    chosen = select_layers(len(caches), layers, what="vLLM cache list")
    found = [vllm_layer_layout(caches[i], layout=layout, kv_dim=kv_dim, head_size=head_size,
                               head_size_v=head_size_v) for i in chosen]
    slots = check_sizes([f.num_slots for f in found], "vLLM cache list")
    if len({len(f.halves) for f in found}) != 1:
        raise ValidationError(f"kv-canary: the layers must all have one half or all two, got a mix of "
                              f"{[f.name for f in found]}; fix: pass the layers of one KV cache group")
    if not fingerprint:
        return PoolGroup(slots, (), (), halves=("K",))
    pairs = [f.sources(read_bytes) for f in found]
    k_src = [p[0] for p in pairs]
    v_src = [p[1] for p in pairs if len(p) > 1]
    return PoolGroup(slots, k_src, v_src, halves=("K", "V") if v_src else ("K",))


def vllm_canary(kv_caches, *, layers=None, layout=None, kv_dim="auto", head_size=None, head_size_v=None,
                read_bytes: int | None = None, fingerprint: bool = True, device="auto", **kwargs) -> KvCanary:
    """A :class:`KvCanary` over vLLM-style caches; keyword arguments go to :class:`KvCanary`."""
    canary_kwargs(kwargs, "vllm_canary")
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
    block_size = integer("block_size", block_size, lo=1, fix="pass the cache's tokens per block, e.g. 16")
    bt = _int_array("block_table", block_table, 2)
    n, max_blocks = bt.shape
    seq = _int_array("seq_lens", seq_lens, 1)
    if seq.shape[0] < n:
        raise ValidationError(f"kv-canary: seq_lens must have one length per block-table row (>= {n}), got "
                              f"{seq.shape[0]}. Fix: pass the seq_lens of the same step")
    cap = max_blocks * block_size
    length = cap if max_len is None else integer("max_len", max_len, lo=1, hi=max(cap, 1),
                                                 fix=f"pass at most max_blocks * block_size = {cap}, or None")
    if length < 1:
        raise ValidationError(f"kv-canary: block_table must have at least one block per row, got shape {bt.shape}. "
                              f"Fix: pass the metadata's block table")
    if out is not None:
        o = _int_array("out", out, 2, dtype=np.int32)
        if o.shape[0] < n + 1 or o.shape[1] != length:
            raise ValidationError(f"kv-canary: out must have shape (>= {n + 1}, {length}), got {o.shape}. Fix: "
                                  f"allocate it as int32 [max_batch + 1, max_len]")
    if framework(block_table) == "torch":
        return _torch_req_to_token(block_table, seq_lens, n, length, block_size, out)
    pos = arange(block_table, 0, length)
    blocks = astype(block_table[:, pos // block_size], "int64")
    slots = blocks * block_size + pos % block_size
    live = pos[None, :] < astype(seq_lens[:n], "int64")[:, None]
    slots = astype(where(live, slots, 0), "int32")
    if out is None:
        out = zeros(block_table, (n + 1, length), "int32")
    out[0] = 0
    out[1:n + 1] = slots
    return out


def _torch_req_to_token(block_table, seq_lens, n: int, length: int, block_size: int, out):
    """:func:`block_table_to_req_to_token` for torch in 6 kernels instead of 12 (each costs host
    time), same values: the per-column block index and offset are constants of (device, length,
    block size), kept outside graph capture; int64 arithmetic, 0 past each length, one cast."""
    torch = sys.modules["torch"]
    col_block, col_offset, pos_row = _columns(torch, block_table.device, length, block_size)
    slots = torch.add(col_offset, block_table[:, col_block], alpha=block_size)  # int64, as blocks * bs + offset
    slots = slots * (pos_row < _first(seq_lens, n).unsqueeze(1))  # 0 past each request's length
    if out is None:
        out = torch.zeros((n + 1, length), dtype=torch.int32, device=block_table.device)
    out[0].zero_()
    out[1:n + 1] = slots  # the copy casts to int32 as .to(torch.int32) does
    return out


def _columns(torch, device, length: int, block_size: int):
    """(pos // block_size, pos % block_size, pos as a [1, length] row) int64 for pos in [0, length)
    on ``device``."""
    def make():
        pos = torch.arange(0, length, dtype=torch.int64, device=device)
        return pos // block_size, pos % block_size, pos.unsqueeze(0)
    return kept_tensors(device, ("columns", length, block_size), make)


def _pool_rows(like, n: int):
    """Request-pool rows 1..n (int64) on the device of ``like``; kept for torch (one launch less per
    step; the Batch's req_pool_indices, which kvcanary only reads)."""
    if framework(like) != "torch":
        return arange(like, 1, n + 1)
    torch = sys.modules["torch"]
    return kept_tensors(like.device, ("rows", n), lambda: torch.arange(1, n + 1, dtype=torch.int64, device=like.device))


def _first(x, n: int):
    """``x[:n]``, or ``x`` itself when it has n rows (a slice is a view op: host time on every step)."""
    return x if x.shape[0] == n else x[:n]


def step_requests(table_rows: int, query_starts: int, num_reqs) -> int:
    """The requests of a step whose metadata holds ``table_rows`` block-table rows and
    ``query_starts`` query offsets: ``num_reqs`` (checked against them), else as many as both hold."""
    if query_starts < 1:
        raise ValidationError("kv-canary: query_start_loc must hold num_reqs + 1 offsets (at least the leading 0), got "
                              "an empty array. Fix: pass the metadata's query_start_loc")
    rows = min(table_rows, query_starts - 1)
    return rows if num_reqs is None else integer("num_reqs", num_reqs, lo=0, hi=rows,
                                                 fix=f"pass at most the {rows} requests the metadata holds")


def vllm_batch(*, block_table, seq_lens, query_start_loc, slot_mapping, input_ids, positions, block_size: int,
               num_reqs: int | None = None, num_tokens: int | None = None, max_len: int | None = None,
               req_to_token=None, expected_input_ids=None, expected_positions=None) -> Batch:
    """A :class:`Batch` from vLLM-style attention metadata, computed on the arrays' device.

    ``seq_lens`` are total lengths after this step (cached + scheduled), ``query_start_loc``
    (``[num_reqs + 1]``) delimits each request's new tokens, ``slot_mapping`` is their slots (-1 =
    padding, skipped). Request r gets request-pool row r + 1 (row 0 is padding). ``num_reqs`` and
    ``num_tokens`` trim padded metadata; ``req_to_token`` is an optional preallocated output for
    :func:`block_table_to_req_to_token`."""
    block_size = integer("block_size", block_size, lo=1, fix="pass the cache's tokens per block, e.g. 16")
    qsl_view, bt_view = _int_array("query_start_loc", query_start_loc, 1), _int_array("block_table", block_table, 2)
    tokens = min(_int_array(k, v, 1).shape[0] for k, v in (("slot_mapping", slot_mapping), ("input_ids", input_ids),
                                                          ("positions", positions)))
    n = step_requests(bt_view.shape[0], qsl_view.shape[0], num_reqs)
    optional_integer("num_tokens", num_tokens, lo=0, hi=tokens, fix=f"pass at most the {tokens} tokens given")
    qsl = astype(_first(query_start_loc, n + 1), "int64")
    extend = qsl[1:] - qsl[:-1]
    seq = astype(_first(seq_lens, n), "int64")
    rtt = block_table_to_req_to_token(_first(block_table, n), seq, block_size, max_len=max_len, out=req_to_token)
    t = int(input_ids.shape[0]) if num_tokens is None else int(num_tokens)
    return Batch(_pool_rows(seq, n), seq - extend, extend, rtt,
                 input_ids=astype(_first(input_ids, t), "int64"), positions=astype(_first(positions, t), "int64"),
                 out_cache_loc=astype(_first(slot_mapping, t), "int64"), expected_input_ids=expected_input_ids,
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
            raise ValidationError("kv-canary: attn_metadata must hold a layer's metadata, got an empty dict (no "
                                  "attention this step, e.g. a profiling run); fix: skip the canary for this step")
        if layer_name is not None:
            if not isinstance(layer_name, str):
                raise ValidationTypeError(f"kv-canary: layer_name must be a layer name (str), got "
                                          f"{type(layer_name).__name__}. Fix: pass e.g. {next(iter(attn_metadata))!r}")
            if layer_name not in attn_metadata:
                raise ValidationError(f"kv-canary: attn_metadata has no layer {layer_name!r}; expected one of "
                                      f"{list(attn_metadata)[:8]}..., got {layer_name!r}; fix: pass a layer name of "
                                      f"the shadowed group")
            return attn_metadata[layer_name]
        distinct = {id(m): m for m in attn_metadata.values()}
        if len(distinct) > 1:
            raise ValidationError(f"kv-canary: expected one KV cache group's metadata, got {len(distinct)} different "
                                  f"metadata objects (several KV cache groups); fix: pass layer_name= a layer of the group the "
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
