"""Hugging Face ``transformers`` continuous batching (``generate_batch``, paged KV cache) with the canary on.

:class:`TransformersCanary` attaches a :class:`~kvcanary.KvCanary` to a model that generates with
``attn_implementation="paged|sdpa"`` (or ``paged|eager``), without editing transformers. It patches
instances only, at runtime:

- ``model.init_continuous_batching``: the returned manager gets a wrapped ``_create_batch_processor``
  and a config with CUDA graphs, torch.compile, async batching and the flash decode fast path off
  (each step's canary bookkeeping runs in Python; those modes would replay the step without it);
- the new batch processor: block 0 is taken out of the block manager's free list (kvcanary never
  verifies slot 0, its padding slot); ``inputs_and_outputs.prepare_batch_tensors`` is wrapped to
  note each scheduled request's past and query lengths and expected tokens (prompt + generated
  tokens, from the request state); ``model_runner.compute_batch`` is wrapped to run the HEAD stage
  before the forward and the TAIL stage after it, on the compute stream.

The canary reads what the attention reads: request lengths come from ``cu_seq_lens_q/k``, slots
from ``read_index`` (expanded on the device into a ``req_to_token`` map) and ``write_index``, tokens
and positions from the model inputs. Only the expected tokens come from the host.
Supported: models whose layers all use full attention (one cache group), one generation at a time.
Forks (``num_return_sequences > 1``) and CPU offloading copy KV blocks without their canary records.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field

from ..errors import ValidationError
from ..manager import KvCanary, PoolGroup
from ..plan import Batch
from ..sources import source_from_slots
from .common import select_layers


@dataclass
class StepInfo:
    """One engine step as the hooks see it: ``requests`` is ``[(request_id, past_len, query_len)]``
    in batch order, ``states`` the matching RequestState objects, ``batch_data`` the model kwargs
    (device tensors), ``cache`` the PagedAttentionCache, ``batch`` the canary's Batch (set before
    the forward)."""

    step: int
    requests: list
    states: list
    batch_data: dict
    cache: object
    batch: Batch | None = None


@dataclass
class _Pending:
    requests: list = field(default_factory=list)
    states: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    max_len: int = 0


def _tokens(state, start: int, count: int) -> list[int]:
    """Tokens at positions [start, start + count) of prompt + generated tokens, without concatenating."""
    first = state.initial_tokens
    end = start + count
    if end <= len(first):
        return list(first[start:end])
    head = list(first[start:]) if start < len(first) else []
    return head + list(state.generated_tokens[max(0, start - len(first)):end - len(first)])


class TransformersCanary:
    """Canary for ``model.generate_batch``/``init_continuous_batching`` of a transformers model.

    ``layers`` picks the layers whose K and V bytes are fingerprinted (None/"first", "all", list).
    ``check_inputs`` compares the model's input tokens and positions with the request state (a
    wrong input token is a WRITE_TOKEN row). ``before_step(info)`` / ``after_step(info)`` are
    optional callbacks around each forward (observability, fault injection in tests). Other
    keyword arguments go to :class:`KvCanary` (``verify_capacity``, ``ring_capacity``, ...).
    Counters: :attr:`steps`, :attr:`requests` (ids seen), :attr:`detections` (violation records,
    each with the step it happened in), :meth:`summary`.
    """

    def __init__(self, model, *, layers=None, hash_mode: str = "partial", mode: str = "log",
                 check_inputs: bool = True, before_step=None, after_step=None, **kvcanary_kwargs):
        self.model, self.layers, self.hash_mode, self.mode = model, layers, hash_mode, mode
        self.check_inputs, self.before_step, self.after_step = check_inputs, before_step, after_step
        self.kvcanary_kwargs = kvcanary_kwargs
        self.canary: KvCanary | None = None
        self.cache = None
        self.steps = 0
        self.requests: set = set()
        self.detections: list[dict] = []
        self.step_log: list[dict] = []
        self._patched: list = []          # (object, attribute name) of every instance patch
        self._finished: list[dict] = []   # final stats of canaries of earlier sessions
        self._pending = _Pending()
        self._rtt = None

    # ---- attach / detach ---------------------------------------------------------------------------
    def __enter__(self) -> "TransformersCanary":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _patch(self, obj, name: str, fn) -> None:
        setattr(obj, name, fn)
        self._patched.append((obj, name))

    def attach(self) -> "TransformersCanary":
        if self._patched:
            return self
        original = self.model.init_continuous_batching

        def init_continuous_batching(*args, **kwargs):
            manager = original(*args, **kwargs)
            self._hook_manager(manager)
            return manager
        self._patch(self.model, "init_continuous_batching", init_continuous_batching)
        return self

    def detach(self) -> None:
        """Flush the canary and remove every patch (the model behaves as before)."""
        self.finish()
        for obj, name in reversed(self._patched):
            try:
                delattr(obj, name)
            except AttributeError:
                pass
        self._patched.clear()

    def _hook_manager(self, manager) -> None:
        cfg = manager.continuous_batching_config
        off = [name for name, on in (("CUDA graphs", any(cfg.cuda_graph_booleans)),
                                     ("async batching", cfg.use_async_batching),
                                     ("the flash decode fast path", cfg.max_blocks_per_request),
                                     ("torch.compile", cfg.varlen_compile_config or cfg.decode_compile_config))
               if on]
        if off:
            warnings.warn(f"kv-canary: turning off {', '.join(off)} for continuous batching: the canary "
                          f"checks every step from Python", RuntimeWarning, stacklevel=3)
        cfg.use_cuda_graph, cfg.use_async_batching, cfg.max_blocks_per_request = (False, False), False, 0
        cfg.varlen_compile_config = cfg.decode_compile_config = None
        if "_create_batch_processor" in vars(manager):
            return
        original = manager._create_batch_processor

        def create_batch_processor():
            processor = original()
            if getattr(processor, "_kvcanary", None) is not self:
                self._attach_processor(processor)
            return processor
        self._patch(manager, "_create_batch_processor", create_batch_processor)

    def _attach_processor(self, processor) -> None:
        cache = processor.cache
        if cache.num_groups != 1 or cache.num_sliding_attention_groups:
            raise ValidationError("kv-canary: TransformersCanary supports models whose layers all use full "
                                  f"attention (one cache group), got {cache.num_groups} groups")
        self.finish()
        self._reserve_padding_block(cache)
        layer_slot = cache.layer_index_to_group_indices
        chosen = select_layers(len(layer_slot), self.layers, what="model")
        k = [source_from_slots(cache.key_cache[layer_slot[i][1]]) for i in chosen]
        v = [source_from_slots(cache.value_cache[layer_slot[i][1]]) for i in chosen]
        dev = cache.key_cache[0].device
        device = None if dev.type == "cpu" else (dev.index if dev.index is not None else 0)
        io = processor.inputs_and_outputs
        self.canary = KvCanary(PoolGroup(int(cache.key_cache[0].shape[0]), k, v), device=device,
                               hash_mode=self.hash_mode, mode=self.mode, max_batch=io.max_requests_per_batch,
                               export=self._record, **self.kvcanary_kwargs)
        self.cache, self._rtt = cache, None
        processor._kvcanary = self
        prepare, compute = io.prepare_batch_tensors, processor.model_runner.compute_batch

        def prepare_batch_tensors(requests_in_batch, *args, **kwargs):
            prepare(requests_in_batch, *args, **kwargs)
            self._note_requests(requests_in_batch)

        def compute_batch(model, batch_data):
            self._step(compute, model, batch_data, io.compute_stream)
        self._patch(io, "prepare_batch_tensors", prepare_batch_tensors)
        self._patch(processor.model_runner, "compute_batch", compute_batch)

    @staticmethod
    def _reserve_padding_block(cache) -> None:
        free = cache._block_manager._uninit_block_ids
        if 0 in free:
            free.remove(0)
        else:
            warnings.warn("kv-canary: block 0 is already in use, so its first slot (the canary's padding "
                          "slot) is never verified; attach before the first generation", RuntimeWarning)

    # ---- per step ----------------------------------------------------------------------------------
    def _note_requests(self, requests_in_batch) -> None:
        p = _Pending()
        for future in requests_in_batch:
            state, q = future.state, future.query_length
            past = state.position_offset - q
            p.requests.append((state.request_id, past, q))
            p.states.append(state)
            p.ids.extend(_tokens(state, past, q))
            p.positions.extend(range(past, past + q))
            p.max_len = max(p.max_len, past + q)
        self._pending = p

    def _step(self, compute, model, batch_data, stream) -> None:
        import torch
        pending = self._pending
        info = StepInfo(self.steps, pending.requests, pending.states, batch_data, self.cache)
        if self.before_step is not None:
            self.before_step(info)
        scope = (lambda: torch.cuda.stream(stream)) if stream is not None else nullcontext
        if stream is not None:  # the inputs were filled on the current stream: order the step after them
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with scope():
            info.batch = self._batch(batch_data, pending)
            self.canary.before_forward(info.batch, stream=stream)
        compute(model, batch_data)
        with scope():
            self.canary.after_forward(info.batch, stream=stream)
        if self.after_step is not None:
            self.after_step(info)
        self.requests.update(r for r, _, _ in pending.requests)
        self.step_log.append({"step": self.steps, "requests": len(pending.requests),
                              "new_tokens": len(pending.ids),
                              "cached_tokens": sum(past for _, past, _ in pending.requests)})
        self.steps += 1

    def _req_to_token(self, rows: int, length: int, like):
        """The persistent int32 [rows, >= length] map, grown (doubling) on the host's say-so only."""
        import torch
        if self._rtt is None or self._rtt.shape[1] < length:
            cols = max(length, 2 * (0 if self._rtt is None else self._rtt.shape[1]), 256)
            self._rtt = torch.zeros((rows, cols), dtype=torch.int32, device=like.device)
        return self._rtt

    def _batch(self, data: dict, pending: _Pending) -> Batch:
        import torch
        cu_q, cu_k = data["cu_seq_lens_q"], data["cu_seq_lens_k"]
        if isinstance(cu_k, dict):
            cu_k = cu_k["full_attention"]
        cu_q, cu_k = cu_q.to(torch.int64), cu_k.to(torch.int64)
        n = int(cu_q.shape[0]) - 1
        extend = cu_q[1:] - cu_q[:-1]
        prefix = cu_k[1:] - cu_k[:-1] - extend
        read, write = data["read_index"][0], data["write_index"][0]
        rtt = self._req_to_token(self.canary.plans["FULL"].max_batch + 1, pending.max_len, cu_q)
        if read.numel() and n > 0:  # request r's read slots, positions 0.., go to row r + 1
            j = torch.arange(read.numel(), device=read.device)
            r = torch.searchsorted(cu_k[1:].contiguous(), j, right=True).clamp_(max=n - 1)
            col = (j - cu_k[r]).clamp_(0, rtt.shape[1] - 1)  # bad lengths: wrong slots, never a device fault
            rtt[r + 1, col] = read.to(torch.int32)
        ids = data["input_ids"][0].to(torch.int64)
        pos = data["position_ids"][0].to(torch.int64)
        exp_ids = exp_pos = None
        if self.check_inputs:
            t = int(ids.shape[0])
            exp = torch.zeros((2, t), dtype=torch.int64)
            m = min(t, len(pending.ids))
            exp[0, :m] = torch.tensor(pending.ids[:m], dtype=torch.int64)
            exp[1, :m] = torch.tensor(pending.positions[:m], dtype=torch.int64)
            exp = exp.to(ids.device)
            exp_ids, exp_pos = exp[0], exp[1]
        return Batch(torch.arange(1, n + 1, device=cu_q.device), prefix, extend, rtt, input_ids=ids,
                     positions=pos, out_cache_loc=write, expected_input_ids=exp_ids,
                     expected_positions=exp_pos)

    # ---- reporting ---------------------------------------------------------------------------------
    def _record(self, record: dict) -> None:
        if record.get("type") == "violation":
            self.detections.append(record)

    def finish(self) -> None:
        """Wait for the canary's outstanding reports (synchronises), keep its final numbers and let
        it go (with it the references that keep this session's KV cache alive)."""
        if self.canary is not None:
            self.canary.flush()
            self._finished.append(self.canary.stats())
            self.canary = None

    def summary(self) -> dict:
        """Requests, steps, verified slots, protected tokens and detections so far (flushes)."""
        stats = list(self._finished)
        if self.canary is not None:
            self.canary.flush()
            stats.append(self.canary.stats())
        total = lambda key: sum(s[key] for s in stats)  # noqa: E731
        return {"requests": len(self.requests), "steps": self.steps, "verified_slots": total("verified_slots"),
                "protected_tokens": total("protected_tokens"), "detections": len(self.detections),
                "skipped_verifies": total("skipped_verifies"),
                "prefix_shared_tokens": getattr(self.cache, "_total_prefix_length", 0)}
