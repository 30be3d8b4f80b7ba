"""Hugging Face ``transformers`` continuous batching (``generate_batch``, paged KV cache) with the canary on.

:class:`TransformersCanary` attaches a :class:`~kvcanary.KvCanary` to a model that generates with
``generate_batch`` / ``init_continuous_batching`` (transformers
:data:`~.transformers_layout.SUPPORTED_TRANSFORMERS`; any other release raises a ``kv-canary:``
error naming the range), patching instances only, at runtime:

- ``model.init_continuous_batching``: the manager gets a wrapped ``_create_batch_processor``; its
  configuration is never changed (CPU offloading, which moves blocks without their records, is refused);
- the batch processor: ``prepare_batch_tensors`` notes each scheduled request's lengths and expected
  tokens; on a CUDA cache with the step staged on the device (the default) the model runner's
  ``_forward_process_and_sample`` (what the engine runs eagerly or captures into its CUDA graphs)
  stages the step and runs HEAD before the forward and TAIL after it, so a replayed graph runs the
  canary's launches with the forward's (the expected tokens' copy from a pinned buffer of the step's
  IO pair too), and a replayed step costs the host the notes and the pump's snapshot (``compute_batch``:
  :meth:`TransformersCanary._step`); with
  torch.compile, or the Batch built by torch ops, ``compute_batch`` runs HEAD before the forward (or
  the graph replay) and TAIL after it, on the engine's compute stream. ``warmup``'s made-up requests
  are not checked (its captures take the canary's launches); in ``mode="fail_request"``, the step's
  update fails the requests the canary failed (:mod:`.transformers_fail`).

CUDA graphs, async batching, the decode fast path, torch.compile and their padding stay on. Canary
slots are the cache's own token positions (:class:`~.transformers_layout.PagedLayout`): the block
pool, the schedule and the tokens are those of a run without the canary; the canary reads what the
attention reads (:mod:`.transformers_batch`), only the expected tokens come from the host.
Supported: models whose layers all use full attention, MLA models (``config.kv_lora_rank`` set:
transformers 5.25's ``MLACacheAllocator``, one cache row per token, one canary half) included; forks
(``num_return_sequences > 1``) copy blocks without their records and are refused.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import nullcontext
from time import perf_counter

from ..errors import ValidationError, ValidationTypeError
from ..manager.canary import KvCanary, PoolGroup
from ..reporting.outputs import MODES
from ..validate import boolean, callable_or_none, choice, fail, hash_mode as parse_hash_mode
from .common import canary_kwargs, check_layers
from .transformers_batch import Scheduled, StepBatches, StepInfo, tokens
from .transformers_fail import RequestFailer, check_engine, forget_prefix_cache
from .transformers_layout import PagedLayout, check_transformers_version


log = logging.getLogger("kvcanary")
STEP_LOG = 4096  # steps TransformersCanary.step_log keeps (a server runs for ever)


def _cache_device(cache) -> int | None:
    """The CUDA ordinal of the cache's tensor, None on the host (the canary then runs there)."""
    dev = cache.cache_tensor.device
    return None if dev.type == "cpu" else (dev.index if dev.index is not None else 0)


def _forward_of(runner):
    """The model runner's forward function the canary can run in (its ``_forward_process_and_sample``,
    which the engine runs eagerly or captures into its graphs), None where torch.compile wraps it."""
    forward = getattr(runner, "_forward_process_and_sample", None)
    compiled = any(getattr(runner, name, None) is not None for name in ("_compiled_varlen", "_compiled_decode"))
    return forward if callable(forward) and not compiled else None


def _map_columns(model, cache) -> int:
    """Columns of the staged ``req_to_token`` map, allocated up front (a step captured into a CUDA
    graph cannot allocate): the longest request the cache can hold, at most the model's
    ``max_position_embeddings`` (a longer request grows the map: :meth:`TransformersCanary._grow_map`)."""
    most = int(getattr(cache, "max_tokens_read", 0) or 0)
    positions = int(getattr(getattr(model, "config", None), "max_position_embeddings", 0) or 0)
    return max(1, min(most, positions) if most and positions else most or positions or 4096)


def _installed_transformers() -> str:
    try:  # on first use: transformers is optional (the kvcanary[transformers] extra)
        import transformers
    except ImportError as exc:
        raise ValidationError(f"kv-canary: TransformersCanary needs transformers installed, got {type(exc).__name__}: "
                              f"{exc}. Fix: pip install 'kvcanary[transformers]'") from None
    return transformers.__version__


class TransformersCanary:
    """Canary for ``model.generate_batch``/``init_continuous_batching`` of a transformers model.

    ``layers``: the layers whose K and V bytes are fingerprinted (None/"first", "all", list).
    ``mode``: "log" (default), "raise", or "fail_request": end only the request that read corrupted
    KV (status FAILED, a :class:`~kvcanary.CorruptedKvError`) and keep its blocks out of prefix
    reuse (:attr:`failed_requests`; docs/engines/transformers.md, "What a detection does"). ``check_inputs``:
    compare the input tokens and positions with the request state (WRITE_TOKEN rows).
    ``before_step(info)`` / ``after_step(info)``: callbacks around each forward. ``stage_on_device``
    (default True): stage a CUDA cache's step in one launch (:class:`~.paged_stager.PagedBatchStager`)
    instead of about 30 torch ops. Other keyword arguments go to :class:`KvCanary`. Counters:
    :attr:`steps`, :attr:`requests`, :attr:`detections` (violation records with their step),
    :attr:`host_seconds` (host time by part), :meth:`summary`.
    """

    def __init__(self, model, *, layers=None, hash_mode: str = "partial", mode: str = "log",
                 check_inputs: bool = True, before_step=None, after_step=None, stage_on_device: bool = True,
                 **kvcanary_kwargs):
        self.transformers_version = check_transformers_version(_installed_transformers())
        if not callable(getattr(model, "init_continuous_batching", None)):
            fail("TransformersCanary(model)", "a transformers model with init_continuous_batching", model,
                 "pass the PreTrainedModel you call generate_batch on", kind=ValidationTypeError)
        parse_hash_mode(hash_mode)
        choice("mode", mode, MODES)
        check_layers(layers)
        boolean("check_inputs", check_inputs)
        boolean("stage_on_device", stage_on_device)
        callable_or_none("before_step", before_step)
        callable_or_none("after_step", after_step)
        canary_kwargs(kvcanary_kwargs, "TransformersCanary", ("device", "hash_mode", "mode", "max_batch", "export"))
        self.model, self.layers, self.hash_mode, self.mode = model, layers, hash_mode, mode
        self.check_inputs, self.before_step, self.after_step = check_inputs, before_step, after_step
        self.stage_on_device, self.kvcanary_kwargs = stage_on_device, kvcanary_kwargs
        self.canary: KvCanary | None = None
        self.cache = self.layout = None
        self.steps, self.prefix_shared_tokens = 0, 0  # the latter: cached tokens of requests admitted with past > 0
        self.requests = 0  # requests seen (each marked on its RequestState: nothing kept per request here)
        self._seen = object()  # the mark
        self.detections: list[dict] = []
        self.step_log: deque = deque(maxlen=STEP_LOG)  # the newest steps' sizes
        self._patched: list = []          # (object, attribute name) of every instance patch
        self._finished: dict = {}         # the latest stats of each session's canary (by its number)
        self._sessions = self._session = 0  # canaries built so far; the current one's number
        self._pending = Scheduled()
        self._batches: StepBatches | None = None
        self._failer: RequestFailer | None = None  # mode="fail_request": the session's request failer
        self._processor = None            # the batch processor hooked last
        self._in_forward = False          # the canary runs in the runner's forward function (_step)
        self._stream = None               # the engine's compute stream (a handle)
        self._eager = None                # (Batch, canary step) of a step whose forward ran the canary now
        self._sync_inputs = False         # sync batching: the compute stream waits for the current one
        # host seconds: a session's set-up; per step the notes, the Batch, HEAD, TAIL (callbacks excluded); flush
        self.host_seconds = dict.fromkeys(("attach", "notes", "batch", "head", "tail", "finish"), 0.0)

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
        """Flush the canary and remove every patch (the model behaves as before: the engine's CUDA
        graphs that captured the canary's launches are dropped, and captured again without them)."""
        self.finish()
        if self._in_forward and self._processor is not None:
            self._reset_graphs()
        self._processor = None
        for obj, name in reversed(self._patched):
            try:
                delattr(obj, name)
            except AttributeError:
                pass
        self._patched.clear()

    def _hook_manager(self, manager) -> None:
        forks = int(getattr(manager, "num_return_sequences", 1) or 1)
        if forks > 1:
            raise ValidationError(f"kv-canary: TransformersCanary supports one sequence per request, got "
                                  f"num_return_sequences={forks} (forks copy KV blocks without their canary "
                                  f"records); fix: generate with num_return_sequences=1")
        offload = manager.continuous_batching_config.cpu_offload_space
        if offload is None or offload > 0:
            raise ValidationError(f"kv-canary: TransformersCanary cannot follow KV blocks that CPU offloading moves "
                                  f"(their canary records stay at the old blocks, so a restored request would be "
                                  f"reported as corrupted), got cpu_offload_space={offload!r}; fix: "
                                  f"ContinuousBatchingConfig(cpu_offload_space=0.0), the default (a request that "
                                  f"does not fit is then recomputed instead of restored)")
        if "_create_batch_processor" in vars(manager):
            return
        original = manager._create_batch_processor

        def create_batch_processor():
            processor = original()
            # a persistent manager reuses its processor: after a detach (patches gone) hook it again
            if getattr(processor, "_kvcanary", None) is not self or self.canary is None:
                self._attach_processor(processor)
            return processor
        self._patch(manager, "_create_batch_processor", create_batch_processor)

    def _attach_processor(self, processor) -> None:
        self.finish()
        t0 = perf_counter()
        cache = processor.cache
        io, runner = processor.inputs_and_outputs, processor.model_runner
        kept = getattr(processor, "_kvcanary_kept", None)
        if self.mode == "fail_request":
            check_engine(processor)
        if kept is not None and kept[0] is self and kept[3] is cache:
            # a persistent manager's processor, attached again: its cache (prefix blocks included) lives
            # on, so its canary records do too (a new canary would report every block stamped before)
            _, self.canary, self._batches, self.cache, self.layout, self._session, self._failer = kept
        else:
            # a new canary holds no records: cached prefix blocks of this cache (a persistent manager's,
            # stamped under another canary or under none) would read as corrupted; they are recomputed
            dropped = forget_prefix_cache(cache)
            if dropped:
                log.info("kv-canary: %d cached prefix blocks of a reused cache dropped from prefix reuse (a new "
                         "canary has no records for them); their prompts are recomputed", dropped)
            layout = PagedLayout(cache)
            k, v = layout.sources(self.layers)
            device = _cache_device(cache)
            self.canary = KvCanary(PoolGroup(layout.num_slots, k, v, halves=layout.halves), device=device,
                                   hash_mode=self.hash_mode, mode=self.mode,
                                   max_batch=processor.cb_config.max_requests_per_batch, **self.kvcanary_kwargs)
            self.canary.add_listener(self._record, stats=False)  # violations only: no per-step stats records
            self.cache, self.layout = cache, layout
            staged = device is not None and self.stage_on_device
            self._batches = StepBatches(layout, self.canary.plans["FULL"].max_batch + 1, device if staged else None,
                                        int(getattr(cache, "max_batch_tokens", 256)),
                                        _map_columns(self.model, cache) if staged else 0,
                                        fixed=staged and io.compute_stream is not None
                                        and _forward_of(runner) is not None)
            self._sessions += 1
            self._session = self._sessions
            self._failer = RequestFailer(layout.page_size, device) if self.mode == "fail_request" else None
        processor._kvcanary = self
        processor._kvcanary_kept = (self, self.canary, self._batches, self.cache, self.layout, self._session,
                                    self._failer)
        prepare, compute, warmup = io.prepare_batch_tensors, runner.compute_batch, runner.warmup
        # Async batching (two IO pairs): a decoding request's newest token is the previous batch's output,
        # which the forward carries over into input_ids on the device (its first op, in the graph).
        carry = hasattr(io, "io_pairs")
        warming = [False]
        stream = io.compute_stream
        self._stream = None if stream is None else int(stream.cuda_stream)
        # In the forward: a staged step on CUDA whose forward function is the runner's own (torch.compile
        # wraps the original method, which the canary cannot enter): graphs then capture the canary too.
        self._in_forward = (self._batches.stager is not None and self._stream is not None
                            and _forward_of(runner) is not None)
        self._processor, self._sync_inputs = processor, not carry
        if self._in_forward:
            if self.check_inputs:
                self._batches.pin_expected(2 if carry else 1)
            self._reset_graphs()  # graphs captured before (without this canary) would skip it

        def prepare_batch_tensors(requests_in_batch, *args, **kwargs):
            prepare(requests_in_batch, *args, **kwargs)
            if not warming[0]:
                self._note_requests(requests_in_batch)

        def compute_batch(model, batch_data):
            if warming[0]:  # the engine's warm-up: made-up requests in the cache's blocks, freed after
                return compute(model, batch_data)
            if self._in_forward:
                return self._step(compute, model, batch_data, io)
            self._step_around(compute, model, batch_data, io, carry)

        def warm_up(*args, **kwargs):
            warming[0] = True
            try:
                return warmup(*args, **kwargs)
            finally:
                warming[0] = False
        self._patch(io, "prepare_batch_tensors", prepare_batch_tensors)
        self._patch(runner, "compute_batch", compute_batch)
        self._patch(runner, "warmup", warm_up)
        if self._in_forward:
            self._patch(runner, "_forward_process_and_sample",
                        self._forward_with_canary(runner._forward_process_and_sample, carry, warming))
        if self._failer is not None:  # the engine's update fails the requests the canary failed
            self._failer.hook(processor, lambda: self.canary, self._patch)
        self.host_seconds["attach"] += perf_counter() - t0

    @property
    def failed_requests(self) -> list[dict]:
        """mode="fail_request": the requests ended for corrupted KV (:attr:`.RequestFailer.failed`)."""
        return [] if self._failer is None else list(self._failer.failed)

    # ---- per step ----------------------------------------------------------------------------------
    def _note_requests(self, requests_in_batch) -> None:
        """After ``prepare_batch_tensors`` (which advanced each ``position_offset`` by the query): each
        request's (id, cached length, query length) and the step's expected tokens and positions, in one
        pass (a decoding request's token is its newest one, -1 while only the device has it)."""
        t0 = perf_counter()
        p = Scheduled()
        requests, states, ids, positions, seen = p.requests, p.states, p.ids, p.positions, self._seen
        longest = cached = 0
        for future in requests_in_batch:
            state = future.state
            q, end = future.query_length, state.position_offset
            past, rid = end - q, state.request_id
            if getattr(state, "_kvcanary_seen", None) is not seen:  # a request's first step with this canary
                state._kvcanary_seen = seen
                self.requests += 1
                self.prefix_shared_tokens += past  # admitted with a prefix already in the cache (0 if none)
            requests.append((rid, past, q))
            states.append(state)
            if q == 1:
                positions.append(past)
                prompt = state.initial_tokens
                if past < len(prompt):
                    ids.append(prompt[past])
                else:
                    made, g = state.generated_tokens, past - len(prompt)
                    ids.append(made[g] if g < len(made) else -1)
            else:
                positions.extend(range(past, end))
                ids.extend(tokens(state, past, q))
            cached += past
            if end > longest:
                longest = end
        p.max_len, p.cached = longest, cached
        self._pending = p
        self.host_seconds["notes"] += perf_counter() - t0

    def _forward_with_canary(self, forward, carry: bool, warming: list):
        """The runner's forward function with the canary around it: the step staged and HEAD before,
        TAIL after, on the compute stream. Run eagerly, the launches run now (``self._eager`` says so);
        while the stream is being captured into the engine's CUDA graph (a new shape, or the warm-up's
        captures) they are captured with the forward and run at each replay. The warm-up's eager runs
        (made-up requests) run without the canary."""
        import torch  # on first use: torch stays optional (import kvcanary.adapters never imports it)
        capturing = torch.cuda.is_current_stream_capturing

        def forward_process_and_sample(model, batch_data, carry_over_ids, prev_output_ids, output_ids):
            captured = capturing()
            if warming[0] and not captured:
                return forward(model, batch_data, carry_over_ids, prev_output_ids, output_ids)
            canary, s, t0 = self.canary, self._stream, perf_counter()
            carried = (carry_over_ids, prev_output_ids[0]) if carry else None
            if self.check_inputs:  # from the step's IO pair's pinned buffer (a memcpy node in a capture)
                self._batches.copy_expected(batch_data["input_ids"].shape[1], self._pair(), s)
            batch = self._batches.batch(batch_data, self._pending, self.check_inputs, carried, stream=s,
                                        stage_expected=False)
            t1 = perf_counter()
            canary.before_forward(batch, stream=s)
            t2 = perf_counter()
            forward(model, batch_data, carry_over_ids, prev_output_ids, output_ids)
            t3 = perf_counter()
            step = canary.step
            canary.after_forward(batch, stream=s)
            if not captured:  # the step ran now (else each replay of the graph runs it)
                self._eager = (batch, step)
                hs = self.host_seconds
                hs["batch"], hs["head"] = hs["batch"] + t1 - t0, hs["head"] + t2 - t1
                hs["tail"] += perf_counter() - t3
        return forward_process_and_sample

    def _step(self, compute, model, batch_data, io) -> None:
        """One engine step with the canary in the forward (:meth:`_forward_with_canary`): the expected
        tokens copied first, then the engine's eager forward or graph replay; after a replay, the
        canary's launches ran inside the graph, and the pump's snapshot follows it."""
        pending, s, canary = self._pending, self._stream, self.canary
        info = None
        if self.before_step is not None or self.after_step is not None:
            info = StepInfo(self.steps, pending.requests, pending.states, batch_data, self.cache)
            if self.before_step is not None:
                self.before_step(info)
        t0 = perf_counter()
        if self._sync_inputs:  # sync batching: the inputs were filled on the current stream
            import torch
            io.compute_stream.wait_stream(torch.cuda.current_stream(io.compute_stream.device))
        batches = self._batches
        if pending.max_len > batches.stager.columns:
            self._grow_map(pending.max_len)
        if self.check_inputs:  # into the pair's pinned buffer, which the forward (or its graph) copies
            batches.write_expected(pending, batch_data["input_ids"].shape[1], self._pair())
        self._eager = None
        t1 = perf_counter()
        compute(model, batch_data)
        t2 = perf_counter()
        eager = self._eager
        if eager is None:  # a replayed graph ran the step's launches: count them, snapshot after them
            step = canary.step
            canary.replayed(s)
        else:
            step = eager[1]
        if self._failer is not None:  # no event: the engine's update waits for the step's outputs (a compute
            # stream synchronise, or async batching's d2h event), which follow the step's snapshot on that stream
            self._failer.noted(step, [r[0] for r in pending.requests], None)
        hs = self.host_seconds
        hs["batch"] += t1 - t0
        hs["tail"] += perf_counter() - t2
        if self.after_step is not None:  # callbacks see the Batch as torch tensors (the staged one's twin)
            batch = eager[0] if eager is not None else batches.shaped(batch_data, self.check_inputs, s)
            info.batch = None if batch is None else batches.as_torch(batch)
            self.after_step(info)
        self.step_log.append({"step": self.steps, "requests": len(pending.requests), "new_tokens": len(pending.ids),
                              "cached_tokens": pending.cached})
        self.steps += 1

    def _pair(self) -> int:
        """The engine's current IO pair (async batching; 0 otherwise): its graphs and buffers."""
        return self._processor.inputs_and_outputs.current_pair if not self._sync_inputs else 0

    def _device_ios(self) -> list:
        io = self._processor.inputs_and_outputs
        return [pair.device_io for pair in io.io_pairs] if hasattr(io, "io_pairs") else [io]

    def _reset_graphs(self) -> None:
        """Drop the engine's captured CUDA graphs (each captured with the canary's launches of a map
        that is about to change, or without this canary): the engine captures each shape again."""
        ios = [d for d in self._device_ios() if getattr(getattr(d, "graphs", None), "_storage", None)]
        if not ios:
            return
        self._processor.inputs_and_outputs.compute_stream.synchronize()  # no graph is running
        for d in ios:
            d.graphs = type(d.graphs)()  # the old buffer resets its graphs as it goes

    def _grow_map(self, max_len: int) -> None:
        """A request longer than the map: a larger map, and the graphs that captured the old one go."""
        self._reset_graphs()
        self._batches.stager.grow(max_len)

    def _step_around(self, compute, model, batch_data, io, carry) -> None:
        """One engine step with the canary around ``compute_batch`` (torch.compile, the torch-ops
        Batch or a host cache): HEAD before the forward or graph replay, TAIL after it."""
        import torch  # on first use: torch stays optional (import kvcanary.adapters never imports it)
        pending = self._pending
        info = StepInfo(self.steps, pending.requests, pending.states, batch_data, self.cache)
        if self.before_step is not None:
            self.before_step(info)
        t0 = perf_counter()
        stream = io.compute_stream
        scope = (lambda: torch.cuda.stream(stream)) if stream is not None else nullcontext
        if stream is not None and not carry:  # sync: the inputs were filled on the current stream
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with scope():
            carried = None
            if carry:  # the tokens the forward's first op carries over from the previous batch's output
                carry_ids, prev_output_ids, _ = io.get_cb_kwargs()
                carried = (carry_ids, prev_output_ids[0])
            batch = self._batches.batch(batch_data, pending, self.check_inputs, carried)
            t1 = perf_counter()
            self.canary.before_forward(batch, stream=stream)
        t2 = perf_counter()
        compute(model, batch_data)
        t3 = perf_counter()
        step = self.canary.step
        with scope():
            self.canary.after_forward(batch, stream=stream)
        if self._failer is not None:
            self._failer.noted(step, [rid for rid, _, _ in pending.requests], stream)
        hs = self.host_seconds
        hs["batch"], hs["head"] = hs["batch"] + t1 - t0, hs["head"] + t2 - t1
        hs["tail"] += perf_counter() - t3
        if self.after_step is not None:  # callbacks see the Batch as torch tensors (a staged one's twin)
            info.batch = batch if self._batches.stager is None else self._batches.as_torch(batch)
            self.after_step(info)
        self.step_log.append({"step": self.steps, "requests": len(pending.requests), "new_tokens": len(pending.ids),
                              "cached_tokens": pending.cached})
        self.steps += 1

    # ---- reporting ---------------------------------------------------------------------------------
    def _record(self, record: dict) -> None:
        if record.get("type") == "violation":
            self.detections.append(record)

    def finish(self) -> None:
        """Wait for the canary's outstanding reports (synchronises), keep its final numbers and let
        it go (with it the references that keep this session's KV cache alive; a persistent
        manager's processor keeps it, with its cache, for the next attach)."""
        if self.canary is not None:
            t0 = perf_counter()
            self.canary.flush()
            self._finished[self._session] = self.canary.stats()  # a reattached canary: its latest
            self.canary = None
            self.host_seconds["finish"] += perf_counter() - t0

    def summary(self) -> dict:
        """Requests, steps, verified slots, protected tokens, detections and the prefix-shared tokens
        (cached tokens of requests admitted with a prefix already in the cache) so far (flushes)."""
        stats = dict(self._finished)
        if self.canary is not None:
            self.canary.flush()
            stats[self._session] = self.canary.stats()
        total = lambda key: sum(s.get(key, 0) for s in stats.values())  # noqa: E731
        return {"requests": self.requests, "steps": self.steps, "verified_slots": total("verified_slots"),
                "protected_tokens": total("protected_tokens"), "detections": len(self.detections),
                "skipped_verifies": total("skipped_verifies"), "prefix_shared_tokens": self.prefix_shared_tokens,
                "failed_requests": len(self.failed_requests)}
