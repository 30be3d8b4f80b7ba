"""vLLM-style paged KV caches and block tables.

Per-layer caches, duck-typed (vLLM is never imported):

- ``[2, num_blocks, block_size, heads, dim]`` (FlashAttention backend, ``kv_dim=0``) and
  ``[num_blocks, 2, block_size, heads, dim]`` (FlashInfer, ``kv_dim=1``): a K and a V source;
- the same with the HND physical layout (strides of ``[.., heads, block_size, dim]``): the sources
  cover head 0 of each token, the only bytes of a token that are contiguous;
- flattened ``[num_blocks, block_size, ...]`` caches (MLA ``[blocks, block_size, head_size]``, or one
  half): one source.

Slot ``s`` is token ``s % block_size`` of block ``s // block_size`` (vLLM's slot mapping), so the
canary has ``num_blocks * block_size`` slots and slot 0 is in vLLM's reserved null block.

vLLM has a block table instead of ``req_to_token``: :func:`block_table_to_req_to_token` expands it
on the arrays' own device (torch ops for torch tensors, CuPy for CuPy arrays, numpy on the host),
with no host round trip, and :func:`vllm_batch` turns vLLM's attention metadata into a
:class:`~kvcanary.Batch` (``slot_mapping`` becomes ``out_cache_loc``).
"""

from __future__ import annotations

import numpy as np

from ..arrays import as_view, from_pointer
from ..errors import ValidationError
from ..manager import KvCanary, PoolGroup
from ..plan import Batch
from ..sources import RealKvSource, resolved, sources_from_pages
from .common import arange, astype, check_sizes, device_ordinal, select_layers, where, zeros


def _drop_dim(v, dim: int, index: int):
    """The view ``v`` with dimension ``dim`` fixed at ``index`` (no copy)."""
    shape = v.shape[:dim] + v.shape[dim + 1:]
    strides = v.strides[:dim] + v.strides[dim + 1:]
    return from_pointer(v.ptr + index * v.strides[dim], shape, v.dtype, device=v.device, strides=strides,
                        readonly=v.readonly, owner=v)


def _paged_source(v, read_bytes, what: str) -> RealKvSource:
    """Source of a ``[blocks, block_size, ...]`` view: NHD (contiguous after dim 0) or, for 4-D, HND."""
    item = v.dtype.itemsize
    if len(v.shape) == 4:
        blocks, bs, heads, dim = v.shape
        hnd = (v.strides[3] == item and v.strides[1] == dim * item and v.strides[2] == bs * dim * item
               and heads > 1)
        if hnd:  # head 0 of every token: bytes [0, bs * dim * item) of each block
            rows = from_pointer(v.ptr, (blocks, bs * dim * item), np.uint8, device=v.device,
                                strides=(v.strides[0], 1), readonly=v.readonly, owner=v)
            return RealKvSource(rows, bs, dim * item, read_bytes)
    try:
        return sources_from_pages(v, read_bytes=read_bytes)
    except ValidationError as exc:
        raise ValidationError(f"{exc} [{what}: expected [num_blocks, block_size, ...] in NHD or HND layout, "
                              f"got shape {v.shape}, strides {v.strides} bytes]") from exc


def _kv_dim(shape, kv_dim):
    if kv_dim != "auto":
        return kv_dim
    if len(shape) != 5:
        return None
    first, second = shape[0] == 2, shape[1] == 2
    if first != second:
        return 0 if first else 1
    raise ValidationError(f"kv-canary: cannot tell the K/V dimension of a cache of shape {tuple(shape)}; fix: "
                          f"pass kv_dim=0 for [2, blocks, block_size, heads, dim] or kv_dim=1 for "
                          f"[blocks, 2, block_size, heads, dim]")


def vllm_layer_sources(cache, *, kv_dim="auto", read_bytes: int | None = None):
    """``(k_source, v_source)`` of one layer's cache; ``v_source`` is None for a flattened cache
    without a K/V dimension (``kv_dim=None``, the default for fewer than 5 dims)."""
    v = resolved(as_view(cache, name="vLLM cache"))
    dim = _kv_dim(v.shape, kv_dim)
    if dim is None:
        return _paged_source(v, read_bytes, "vLLM cache"), None
    if dim not in (0, 1) or v.shape[dim] != 2 or len(v.shape) < 4:
        raise ValidationError(f"kv-canary: kv_dim={dim} must name a dimension of extent 2 (0 or 1) of a cache "
                              f"of at least 4 dims, got shape {v.shape}")
    k, val = (_paged_source(_drop_dim(v, dim, h), read_bytes, f"vLLM cache half {h}") for h in (0, 1))
    return k, val


def _layers(kv_caches) -> list:
    if isinstance(kv_caches, dict):
        return list(kv_caches.values())
    if isinstance(kv_caches, (list, tuple)):
        return list(kv_caches)
    return [kv_caches]


def vllm_pool_group(kv_caches, *, layers=None, kv_dim="auto", read_bytes: int | None = None) -> PoolGroup:
    """A :class:`PoolGroup` over per-layer caches (a list, a dict name -> tensor in layer order,
    or one tensor). ``layers``: None/"first", "all" or a list of layer indices."""
    caches = _layers(kv_caches)
    chosen = select_layers(len(caches), layers, what="vLLM cache list")
    pairs = [vllm_layer_sources(caches[i], kv_dim=kv_dim, read_bytes=read_bytes) for i in chosen]
    slots = check_sizes([k.view.shape[0] * k.page_size for k, _ in pairs], "vLLM cache list")
    k_src = [k for k, _ in pairs]
    v_src = [v for _, v in pairs if v is not None]
    if v_src and len(v_src) != len(k_src):
        raise ValidationError("kv-canary: mix of caches with and without a K/V dimension; fix: pass one kind")
    return PoolGroup(slots, k_src, v_src, halves=("K", "V") if v_src else ("K",))


def vllm_canary(kv_caches, *, layers=None, kv_dim="auto", read_bytes: int | None = None, device="auto",
                **kwargs) -> KvCanary:
    """A :class:`KvCanary` over vLLM-style caches; keyword arguments go to :class:`KvCanary`."""
    group = vllm_pool_group(kv_caches, layers=layers, kv_dim=kv_dim, read_bytes=read_bytes)
    if device == "auto":
        device = device_ordinal(group.k_sources[0].tensor)
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
    n = int(block_table.shape[0]) if num_reqs is None else int(num_reqs)
    qsl = astype(query_start_loc[:n + 1], "int64")
    extend = qsl[1:] - qsl[:-1]
    seq = astype(seq_lens[:n], "int64")
    rtt = block_table_to_req_to_token(block_table[:n], seq, block_size, max_len=max_len, out=req_to_token)
    t = int(input_ids.shape[0]) if num_tokens is None else int(num_tokens)
    return Batch(arange(seq, 1, n + 1), seq - extend, extend, rtt,
                 input_ids=astype(input_ids[:t], "int64"), positions=astype(positions[:t], "int64"),
                 out_cache_loc=astype(slot_mapping[:t], "int64"), expected_input_ids=expected_input_ids,
                 expected_positions=expected_positions)
