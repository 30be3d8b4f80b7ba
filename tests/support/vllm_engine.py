"""A small vLLM engine for the connector tests: vLLM's own ``Scheduler`` (built from a local tiny
model config, no hub), the connector loaded from ``--kv-transfer-config`` through vLLM's
``KVConnectorFactory`` in both roles, vLLM's worker-side glue (``ActiveKVConnector``: ``pre_forward``
/ ``finish_forward`` / ``post_forward`` around the forward, as the GPU model runner calls them), KV
caches viewed by vLLM's ``create_kv_cache_views``, and a stand-in forward:

- it writes each scheduled token's K and V, in every layer and head, into its slot: bytes that are a
  function of (token, position, layer, head, half), as a model's are of its input;
- it samples each request's next token from the K bytes of layer 0 over the request's whole
  context, read through its block table: a request that reads corrupted KV gets other tokens.

On a CUDA ``device`` the stand-in forward is one CUDA graph replayed every step (its inputs copied
into static buffers first), and the canary runs on the same stream around it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

MODULE = "kvcanary.adapters.vllm_connector"
LAYERS, HEADS, HEAD_SIZE, VOCAB = 2, 2, 16, 997


def tiny_model(root: Path, layers: int = LAYERS) -> str:
    """A local Llama-shaped config (no weights are ever loaded)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": HEADS, "num_hidden_layers": layers, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "torch_dtype": "float32", "rms_norm_eps": 1e-5}))
    return str(root)


@dataclass
class Engine:
    """The engine of one test (see the module docstring)."""

    model_dir: str
    extra: dict = field(default_factory=dict)
    policy: str = "fail"
    block_size: int = 16
    num_blocks: int = 64
    max_num_seqs: int = 8
    max_tokens: int = 32
    device: int | None = None
    graphs: bool = False
    connector: str | None = "KvCanaryConnector"  # None: vLLM without any connector (the baseline)
    layout: str = "LBNHC"
    layers: int = LAYERS
    max_model_len: int = 256
    async_scheduling: bool = False  # vLLM's default: schedule step k + 1 before step k's output is processed

    def __post_init__(self):
        kv = {"kv_connector": self.connector, "kv_connector_module_path": MODULE, "kv_role": "kv_producer",
              "kv_connector_extra_config": self.extra, "kv_load_failure_policy": self.policy}
        if self.connector == "MultiConnector":
            kv = {"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_load_failure_policy": self.policy,
                  "kv_connector_extra_config": {"connectors": [
                      {"kv_connector": "KvCanaryConnector", "kv_connector_module_path": MODULE,
                       "kv_role": "kv_producer", "kv_connector_extra_config": self.extra}]}}
        cache = CacheConfig(block_size=self.block_size, enable_prefix_caching=True)
        cache.num_gpu_blocks = self.num_blocks
        self.config = VllmConfig(
            model_config=ModelConfig(model=self.model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=self.max_model_len),
            scheduler_config=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_tokens,
                                             max_model_len=self.max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
                                             async_scheduling=self.async_scheduling),
            cache_config=cache, kv_transfer_config=None if self.connector is None else KVTransferConfig(**kv),
            device_config=DeviceConfig("cpu" if self.device is None else "cuda"))
        spec = FullAttentionSpec(block_size=self.block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                                 dtype=torch.float32)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]
        page = spec.page_size_bytes
        layout = KVCacheLayout[self.layout]
        compact = layout.is_layer_compact  # the strides vLLM's allocator resolves for one group's tensor
        tensor = KVCacheTensor(size=page * self.num_blocks * self.layers, layers=names,
                               layer_stride=page * self.num_blocks if compact else page,
                               block_stride=page if compact else page * self.layers)
        self.kv_cache_config = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[tensor],
                                             kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                                             kv_cache_layout=self.layout)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(self.block_size, sha256)
        cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = cls(self.config, self.kv_cache_config, StructuredOutputManager(self.config),
                             block_size=self.block_size)
        dev = "cpu" if self.device is None else f"cuda:{self.device}"
        g = torch.Generator().manual_seed(7)
        self.raw = torch.randint(-128, 128, (tensor.size,), dtype=torch.int8, generator=g).to(dev)  # never zeros
        self.caches = self._views(tensor, names, spec)
        self.worker = self.glue = None
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        if self.connector is not None:
            self.worker = KVConnectorFactory.create_connector(config=self.config, role=KVConnectorRole.WORKER,
                                                              kv_cache_config=self.kv_cache_config)
            kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
            self.glue = ActiveKVConnector(self.config, dict(zip(names, self.caches)))  # register_kv_caches
        self.preempted = 0
        self.last: dict[str, int] = {}  # request id -> the token its last forward sampled
        self.new_computed: dict[str, int] = {}  # request id -> computed tokens when (last) scheduled as new
        self.outputs: dict[str, list] = {}
        self.finished: dict[str, str] = {}
        self.invalid: list[set] = []
        self.step_count = 0
        self.u8 = [c.view(torch.uint8) for c in self.caches]  # [blocks, heads, block_size, 2 * 64 bytes]
        if self.device is not None:
            self._graph_buffers()

    def _views(self, tensor, names, spec):
        """The per-layer caches as vLLM's GPU model runner views them: one int8 buffer, the resolved layout."""
        return create_kv_cache_views(self.raw, spec, self.num_blocks, KVCacheLayout[self.layout], tensor)

    @property
    def canary_connector(self):
        """The worker's KvCanaryConnector (the child, under MultiConnector)."""
        w = self.worker
        return w._connectors[0] if hasattr(w, "_connectors") else w

    # ---- requests ---------------------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        req = Request(request_id=rid, prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                      pooling_params=None, block_hasher=self.hasher)
        self.scheduler.add_request(req)
        self.outputs[rid] = []

    def run(self, steps: int = 200, fault=None) -> None:
        """Step until no request is left (or ``steps``); ``fault(engine, step)`` runs before each forward.
        Under async scheduling, as vLLM's engine core does: schedule and execute step k, then process
        step k - 1's output."""
        pending = None
        for _ in range(steps):
            if not self.scheduler.has_unfinished_requests():
                break
            done = self.execute(fault)
            if self.async_scheduling:
                done, pending = pending, done
            if done is not None:
                self.update(*done)
        if pending is not None:
            self.update(*pending)

    def step(self, fault=None):
        out, mro = self.execute(fault)
        self.update(out, mro)
        return out

    def execute(self, fault=None):
        """Schedule one step and run it through the worker glue: (scheduler output, runner output)."""
        out = self.scheduler.schedule()
        self.preempted += len(out.preempted_req_ids or ())
        self.new_computed.update({r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs})
        if fault is not None:
            fault(self, self.step_count)
        if self.glue is not None:
            self.glue.pre_forward(out)
        sampled = self.forward(out) if out.total_num_scheduled_tokens else {}
        conn = None
        if self.glue is not None:
            self.glue.finish_forward()
            conn = self.glue.post_forward(out.finished_req_ids)
            self.invalid.append(set(conn.invalid_block_ids))
        ids = list(out.num_scheduled_tokens)
        self.step_count += 1
        return out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[sampled.get(r, []) for r in ids],
                                      kv_connector_output=conn)

    def update(self, out, mro) -> None:
        for outs in self.scheduler.update_from_output(out, mro).values():
            for o in outs.outputs:
                self.outputs[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)

    # ---- the stand-in forward -------------------------------------------------------------------------
    def blocks(self, rid: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def forward(self, out) -> dict:
        """Write the scheduled tokens' K/V, then sample each request that completes its context."""
        reqs = self.scheduler.requests
        slots, toks, poss, sample = [], [], [], {}
        for rid, n in out.num_scheduled_tokens.items():
            req, blocks = reqs[rid], self.blocks(rid)
            nc = req.num_computed_tokens - n  # the scheduler has advanced it already
            known = req.all_token_ids
            for p in range(nc, nc + n):
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
                # async scheduling: the newest token is the last one sampled, which the host has not seen yet
                toks.append(known[p] if p < len(known) else self.last[rid])
                poss.append(p)
            if not req.is_prefill_chunk:
                sample[rid] = (blocks, nc + n)
        dev = self.u8[0].device
        kv = token_kv(torch.tensor(toks, device=dev), torch.tensor(poss, device=dev), self.layers)
        if self.device is None:
            self._write(torch.tensor(slots), kv)
        else:
            self._replay(torch.tensor(slots, device=dev), kv)
        tokens = dict(zip(sample, self.sample(list(sample.values()))))
        self.last.update(tokens)
        return {rid: [t] for rid, t in tokens.items()}

    def _write(self, slots, kv) -> None:
        b, o = slots // self.block_size, slots % self.block_size
        for layer, cache in enumerate(self.u8):
            cache[b, :, o] = kv[:, layer]

    def sample(self, requests: list) -> list[int]:
        """Each request's next token from the K bytes (head 0, first 16) of layer 0 over its positions
        [0, n), read through its blocks (``requests``: [(blocks, n)]); one read-back for all."""
        if not requests:
            return []
        bsz, dev = self.block_size, self.u8[0].device
        within = np.arange(bsz)
        slots = np.concatenate([(np.asarray(blocks[:-(-n // bsz)])[:, None] * bsz + within).reshape(-1)[:n]
                                for blocks, n in requests])
        seg = np.repeat(np.arange(len(requests)), [n for _, n in requests])
        s = torch.from_numpy(slots).to(dev)
        k = self.u8[0][s // bsz, 0, s % bsz, :16].to(torch.int64) * torch.arange(1, 17, device=dev)
        sums = torch.zeros(len(requests), dtype=torch.int64, device=dev).index_add_(0, torch.from_numpy(seg).to(dev),
                                                                                   k.sum(1))
        ns = torch.tensor([n for _, n in requests], device=dev)
        return ((sums * 7919 + ns) % VOCAB).tolist()

    def _graph_buffers(self) -> None:
        dev = f"cuda:{self.device}"
        cap = self.max_tokens
        self.g_slots = torch.zeros(cap, dtype=torch.int64, device=dev)
        self.g_kv = torch.zeros((cap, self.layers, HEADS, 4 * 2 * HEAD_SIZE), dtype=torch.uint8, device=dev)
        self.graph = None
        if self.graphs:
            self.g_slots.fill_(-1)
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                self._graph_body()  # warm-up
            torch.cuda.current_stream(self.device).wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._graph_body()

    def _graph_body(self) -> None:
        """Padding slots (-1) write to the null block 0, as vLLM's padded graphs do."""
        slots = self.g_slots.clamp(min=0)
        b, o = slots // self.block_size, slots % self.block_size
        for layer, cache in enumerate(self.u8):
            cache[b, :, o] = self.g_kv[:, layer]

    def _replay(self, slots, kv) -> None:
        n = slots.shape[0]
        self.g_slots.fill_(-1)
        self.g_slots[:n].copy_(slots)
        self.g_kv[:n].copy_(kv)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._graph_body()

    # ---- faults -----------------------------------------------------------------------------------------
    def flip(self, block: int, offset: int = 0, layer: int = 0, byte: int = 0) -> None:
        """Flip one bit of K (head 0) of token ``offset`` of ``block`` in ``layer``."""
        self.u8[layer][block, 0, offset, byte] ^= 0x40

    def cached_blocks(self) -> set[int]:
        """The blocks vLLM's prefix cache holds (by content hash)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return {b.block_id for b in pool.blocks if b.block_hash is not None}


def token_kv(tokens, positions, layers: int = LAYERS):
    """K and V bytes per (token, position, layer, head): [T, layers, heads, 2 * 64] uint8 (torch, on the
    tokens' device)."""
    dev = tokens.device
    t = tokens.to(torch.int64)[:, None, None, None]
    p = positions.to(torch.int64)[:, None, None, None]
    layer = torch.arange(layers, device=dev)[None, :, None, None]
    head = torch.arange(HEADS, device=dev)[None, None, :, None]
    c = torch.arange(4 * 2 * HEAD_SIZE, device=dev)[None, None, None, :]
    return ((t * 131 + p * 29 + layer * 53 + head * 17 + c * 7 + (t * p) % 97) % 251).to(torch.uint8)
