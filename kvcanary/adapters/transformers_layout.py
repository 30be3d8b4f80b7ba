"""Where Hugging Face ``transformers`` continuous batching keeps its paged KV cache, and how the canary
addresses it: the supported version range, the real-KV sources of each layer and the map from the
engine's cache indices to canary slots.

Layout read (transformers 5.18 to 5.25; 5.18 introduced it): ``PagedAttentionCache.cache_allocators``
holds one full-attention allocator (key ``"full_attention"``) over one flat byte buffer. A *block* of
the allocator is ``pages_per_block`` pages, one per layer, of ``tokens_per_page`` tokens, and spans
``block_physical_stride = rows_per_token * page_size * layers`` rows:

- ``FullAttentionCacheAllocator``: ``cache_tensor`` is ``[tokens, 2, kv_heads, head_dim]``; a page is
  ``page_size`` K rows followed by as many V rows (``rows_per_token = 2``). Layer ``i``'s K of a
  physical index ``p`` is row ``p + 2 i page_size``, its V row ``p + (2 i + 1) page_size``.
- ``MLACacheAllocator`` (transformers 5.25, chosen when ``config.kv_lora_rank`` is set: DeepSeek-V3/R1,
  Kimi-K2 shapes): ``cache_tensor`` is ``[tokens, kv_lora_rank + qk_rope_head_dim]``, one row per token
  holding ``[kv_latent | rotated_key]`` (``rows_per_token = 1``); layer ``i``'s row of ``p`` is row
  ``p + i page_size``. The canary then has one half (K: the row, fingerprinted from its start, the
  latent; ``hash_mode="all"`` covers the rotated key too).

The model's ``read_index`` / ``write_index`` hold *physical indices* ``p = block * block_physical_stride
+ offset`` (``offset < page_size``). Canary slot of ``p``: ``(p // block_physical_stride) * page_size +
p % block_physical_stride`` — block-major, every token of every block (trash blocks included) has its
own slot, so the canary takes nothing from the engine's block pool. Slot 0 is token 0 of block 0,
which lies in the first of the two trash sectors the cache pool never hands out (padding tokens read
there): the canary's padding slot is the engine's. An index with ``offset >= page_size`` (no token of
this layer stores there) or a negative one maps to ``num_slots``, outside the canary buffer, so a
corrupted index is a SLOT_OUT_OF_RANGE row, never a silently different slot.
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import ValidationError
from ..interop.arrays import as_view, from_pointer
from ..ops.sources import RealKvSource, resolved
from .common import require_attr, select_layers

#: transformers releases the adapter supports (the ``kvcanary[transformers]`` extra pins the same).
SUPPORTED_TRANSFORMERS = ">=5.18,<5.26"
CHECKED_TRANSFORMERS = ("5.18.0", "5.24.0", "5.25.0")
_LOWEST, _BEYOND = (5, 18), (5, 26)
_FIX = "fix: pip install 'kvcanary[transformers]' (transformers" + SUPPORTED_TRANSFORMERS + ")"


def check_transformers_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` when it is in :data:`SUPPORTED_TRANSFORMERS`, else a
    :class:`ValidationError` naming the range. Pre-releases count as their release (5.25.0.dev0 is 5.25)."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    got = (int(m.group(1)), int(m.group(2))) if m else None
    if got is None or not _LOWEST <= got < _BEYOND:
        raise ValidationError(f"kv-canary: TransformersCanary supports transformers {SUPPORTED_TRANSFORMERS} "
                              f"(checked against {', '.join(CHECKED_TRANSFORMERS)}), got transformers "
                              f"{version}; its continuous-batching cache layout differs; {_FIX}")
    return got


def _need(obj, name: str, what: str):
    return require_attr(obj, name, what, f"use transformers {SUPPORTED_TRANSFORMERS}; {_FIX}")


class PagedLayout:
    """The canary's view of one ``PagedAttentionCache`` (full-attention layers only, MLA included).

    ``num_slots`` canary slots, ``page_size`` tokens per page, ``stride`` rows per block, ``halves``
    ("K", "V"), or ("K",) for MLA's one row per token; :meth:`sources` gives the zero-copy sources of
    chosen layers, :meth:`to_slots` maps physical cache indices (a torch tensor) to canary slots on
    their device."""

    def __init__(self, cache):
        allocators = _need(cache, "cache_allocators", "the PagedAttentionCache")
        kinds = list(allocators) if isinstance(allocators, dict) else allocators
        if not isinstance(allocators, dict) or kinds != ["full_attention"]:
            raise ValidationError(f"kv-canary: TransformersCanary supports models whose layers all use full "
                                  f"attention (cache_allocators == ['full_attention']), got {kinds}; fix: use a "
                                  f"model without sliding-window layers")
        alloc = allocators["full_attention"]
        what = "the full-attention cache allocator"
        self.page_size = int(_need(alloc, "tokens_per_page", what))
        self.stride = int(_need(alloc, "block_physical_stride", what))
        self.layer_indices = list(_need(alloc, "layer_indices", what))
        self.rows_per_token = int(_need(alloc, "rows_per_token", what))
        tensor = _need(alloc, "cache_tensor", what)
        pool = _need(cache, "pool", "the PagedAttentionCache")
        reserved = int(_need(pool, "num_reserved_sectors", "the cache pool"))
        layers, rpt = len(self.layer_indices), self.rows_per_token
        shape = {2: "[tokens, 2, heads, dim]", 1: "[tokens, kv_lora_rank + qk_rope_head_dim] (MLA)"}
        if rpt not in shape or tensor.ndim != (4 if rpt == 2 else 2) or self.stride != rpt * self.page_size * layers:
            raise ValidationError(f"kv-canary: expected a full-attention allocator with rows_per_token=2 and a 4-D "
                                  f"cache_tensor {shape[2]}, or an MLA one with rows_per_token=1 and a 2-D "
                                  f"cache_tensor {shape[1]}, and block_physical_stride = rows_per_token * "
                                  f"tokens_per_page * layers, got rows_per_token={rpt}, stride={self.stride}, "
                                  f"page_size={self.page_size}, layers={layers}, cache_tensor {tuple(tensor.shape)}; "
                                  f"{_FIX}")
        if reserved < 1:
            raise ValidationError(f"kv-canary: expected the cache pool to reserve its first sector (the padding "
                                  f"reads' trash, canary slot 0), got num_reserved_sectors={reserved}; {_FIX}")
        self.view = resolved(as_view(tensor, name="transformers cache_tensor"))
        if not self.view.is_c_contiguous():
            raise ValidationError(f"kv-canary: expected a contiguous cache_tensor, got strides "
                                  f"{self.view.strides}; {_FIX}")
        self.halves = ("K", "V") if rpt == 2 else ("K",)
        row = int(tensor.shape[2]) * int(tensor.shape[3]) if rpt == 2 else int(tensor.shape[1])  # K or V; MLA's row
        self.token_bytes = row * self.view.itemsize
        rows = rpt * int(tensor.shape[0])
        self.num_blocks = rows // self.stride
        self.num_slots = self.num_blocks * self.page_size

    def sources(self, layers) -> tuple[list[RealKvSource], list[RealKvSource]]:
        """K and V sources of the chosen layers (``layers`` indexes the allocator's layers, which for
        a full-attention model are the model's); MLA: K only (its rows), V empty. Source of layer i,
        half h: rows are blocks (row stride ``stride * token_bytes``), starting at the layer's page
        ``rows_per_token * i + h`` of block 0."""
        chosen = select_layers(len(self.layer_indices), layers, what="model")
        v, tb, rpt = self.view, self.token_bytes, self.rows_per_token
        out = ([], [])
        for i in chosen:
            for half in range(len(self.halves)):
                start = v.ptr + (rpt * i + half) * self.page_size * tb
                rows = from_pointer(start, (self.num_blocks, self.page_size * tb), np.uint8, device=v.device,
                                    strides=(self.stride * tb, 1), readonly=v.readonly, owner=v)
                out[half].append(RealKvSource(rows, self.page_size, tb))
        return out

    def to_slots(self, index):
        """Canary slots (int64) of the physical cache indices ``index`` (a torch tensor), elementwise on
        its device; indices that name no token map to ``num_slots`` (out of range)."""
        import torch  # on first use: torch stays optional (import kvcanary.adapters never imports it)
        p = index.to(torch.int64)
        offset = torch.remainder(p, self.stride)
        slots = torch.div(p, self.stride, rounding_mode="floor") * self.page_size + offset
        bad = (p < 0) | (offset >= self.page_size) | (slots >= self.num_slots)
        return torch.where(bad, torch.full_like(slots, self.num_slots), slots)
