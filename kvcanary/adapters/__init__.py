"""Engine adapters: point kvcanary at the KV pool an engine already has.

Each adapter is duck-typed on the engine's objects and imports no engine package (and never torch
at import time): it builds the :class:`~kvcanary.manager.canary.PoolGroup` s and
:class:`~kvcanary.RealKvSource` s of a pool, a ready :class:`~kvcanary.manager.canary.KvCanary`, and the
per-step :class:`~kvcanary.Batch` from the engine's metadata, on the engine's device.

- :mod:`.sglang`: SGLang-style MHA / MLA / hybrid SWA pools, with scale tensors of quantised pools;
- :mod:`.vllm`: vLLM-style per-layer paged caches (layouts detected in :mod:`.vllm_layout`), the block
  table -> ``req_to_token`` expansion and V1's per-layer attention metadata;
- :mod:`.stager`: a step staged into persistent Batch buffers in one launch instead of framework ops
  (:mod:`.vllm_stager`, :mod:`.paged_stager` for transformers, :mod:`.sglang_stager`);
- :mod:`.transformers_paged`: Hugging Face ``transformers`` continuous batching (``generate_batch``);
- :mod:`.failures`: the fail-closed hook of any engine: a step's batch index -> the engine's request
  and the blocks to keep out of reuse.
- :mod:`.vllm_connector`: vLLM's KV-connector door (``--kv-transfer-config``), the canary with one flag;
  it imports vLLM and is imported only by vLLM (never from here); its bookkeeping is :mod:`.vllm_steps`.

Which layers are fingerprinted is chosen with ``layers=``: None/"first" (default, layer 0), "all"
(up to ``MAX_REAL_KV_SOURCES`` sources per pool half) or a list of layer indices.
"""

from .common import select_layers
from .failures import (FailedRequests, RequestFailure, sglang_request_ids, vllm_request_ids)
from .paged_stager import PagedBatchStager
from .sglang import (is_swa_pool, sglang_batch, sglang_canary, sglang_groups, sglang_pool_group, sglang_sources)
from .sglang_stager import SglangBatchStager
from .transformers_paged import StepInfo, TransformersCanary
from .vllm import (block_table_to_req_to_token, vllm_batch, vllm_batch_from_metadata, vllm_canary, vllm_layer_layout,
                   vllm_layer_sources, vllm_metadata, vllm_pool_group)
from .vllm_layout import KV_CACHE_LAYOUTS
from .vllm_stager import VllmBatchStager

__all__ = [
    "select_layers", "is_swa_pool", "sglang_batch", "sglang_canary", "sglang_groups", "sglang_pool_group",
    "sglang_sources", "StepInfo", "TransformersCanary", "block_table_to_req_to_token", "vllm_batch",
    "vllm_batch_from_metadata", "vllm_canary", "vllm_layer_layout", "vllm_layer_sources", "vllm_metadata",
    "vllm_pool_group", "KV_CACHE_LAYOUTS", "VllmBatchStager", "PagedBatchStager", "SglangBatchStager", "FailedRequests",
    "RequestFailure", "sglang_request_ids", "vllm_request_ids",
]
