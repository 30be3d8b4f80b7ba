"""The baseline of a failed request: transformers' own continuous-batching engine, with no canary
attached, ends one request at one step through its own error path.

A fail_request run ends the request that read corrupted KV in the update of the step that verified
it. The run this module makes ends the same request at the same step without any kvcanary code, so
every other request's tokens can be compared with a run whose only difference is that the request
left the batch there (a failer that shifted another request's token, dropped another request or
ended the request a step late shows up against it; a baseline made by the canary's own failer would
carry the same bug).

Where, in the engine's own objects only (instance patches, each removed on exit):

- ``model.init_continuous_batching`` is wrapped so the manager's ``_create_batch_processor`` hooks the
  batch processor it creates (once: a persistent manager hands the same processor back);
- steps are counted as the canary counts them: each ``model_runner.compute_batch`` call outside
  ``model_runner.warmup`` (whose made-up requests are no step) is one step, numbered from 0; the ids
  of its requests are those ``inputs_and_outputs.prepare_batch_tensors`` was given last;
- the engine updates steps in the order it computed them (async batching: one step later), so each
  ``inputs_and_outputs.prepare_batch_update`` call is the update of the oldest step not updated yet.
  In the update of step ``step``, the request is ended as the engine ends a request that errored
  (``ContinuousBatchProcessor.handle_batch_error``): ``_handle_request_error`` (status FAILED, the
  error, the tokens generated so far, output delivered), then ``scheduler.finish_request`` (blocks
  freed); and it is dropped from the (requests, tokens, logprobs) that update hands to
  ``update_batch``, with its token. Async batching launched the next step before this update: the
  request is dropped from that step's update too (``update_batch`` skips FINISHED requests, not
  FAILED ones).
"""

from __future__ import annotations

from collections import deque


class EngineEndsRequest:
    """Context manager: while it is active, ``model``'s continuous batching (no canary) ends request
    ``rid`` in the update of engine step ``step``. After the run: :attr:`ended` (the step, the batch's
    request ids in order, the tokens the request had, or None if it was never ended), :attr:`dropped`
    (the steps whose update it was dropped from) and :attr:`steps` (steps counted)."""

    def __init__(self, model, rid: str, step: int, error: Exception | None = None):
        self.model, self.rid, self.step = model, rid, step
        self.error = error if error is not None else RuntimeError(f"ended by the engine at step {step}")
        self.ended: dict | None = None
        self.dropped: list[int] = []
        self.steps = 0
        self._patches: list = []
        self._hooked: set = set()

    def _set(self, obj, name: str, fn) -> None:
        setattr(obj, name, fn)
        self._patches.append((obj, name))

    def __enter__(self) -> "EngineEndsRequest":
        init = self.model.init_continuous_batching

        def init_continuous_batching(*args, **kwargs):
            manager = init(*args, **kwargs)
            if "_create_batch_processor" not in vars(manager):
                create = manager._create_batch_processor

                def create_batch_processor():
                    processor = create()
                    if id(processor) not in self._hooked:
                        self._hooked.add(id(processor))
                        self._hook(processor)
                    return processor
                self._set(manager, "_create_batch_processor", create_batch_processor)
            return manager
        self._set(self.model, "init_continuous_batching", init_continuous_batching)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in reversed(self._patches):
            if name in vars(obj):
                delattr(obj, name)
        self._patches.clear()

    def _hook(self, processor) -> None:
        io, runner = processor.inputs_and_outputs, processor.model_runner
        prepare, compute, warmup, update = (io.prepare_batch_tensors, runner.compute_batch, runner.warmup,
                                            io.prepare_batch_update)
        warming, prepared, computed = [False], [[]], deque()  # computed: (step, ids) not updated yet

        def prepare_batch_tensors(requests_in_batch, *args, **kwargs):
            out = prepare(requests_in_batch, *args, **kwargs)
            if not warming[0]:
                prepared[0] = [f.state.request_id for f in requests_in_batch]
            return out

        def compute_batch(model, batch_data):
            if not warming[0]:
                computed.append((self.steps, prepared[0]))
                self.steps += 1
            return compute(model, batch_data)

        def warm_up(*args, **kwargs):
            warming[0] = True
            try:
                return warmup(*args, **kwargs)
            finally:
                warming[0] = False

        def prepare_batch_update(*args, **kwargs):
            requests, new_tokens, logprobs = update(*args, **kwargs)
            step, ids = computed.popleft()
            got = [f.state.request_id for f in requests]
            assert got == ids, f"the engine updated step {step} with requests {got}, computed with {ids}"
            if step == self.step and self.rid in ids:
                state = processor.scheduler.active_requests.get(self.rid)
                assert state is not None, f"{self.rid} is in step {step}'s batch but no longer active"
                self.ended = {"step": step, "batch": ids, "generated": list(state.generated_tokens)}
                processor._handle_request_error(self.error, state)
                processor.scheduler.finish_request(self.rid)
            if self.ended is None or self.rid not in ids:
                return requests, new_tokens, logprobs
            self.dropped.append(step)
            kept, tokens, probs = [], [], None if logprobs is None else []
            at = 0  # new_tokens holds one token per request that has a new one, in batch order
            for future in requests:
                has_token = bool(getattr(future, "has_new_token", False))
                if future.state.request_id != self.rid:
                    kept.append(future)
                    if has_token:
                        tokens.append(new_tokens[at])
                        if probs is not None:
                            probs.append(logprobs[at])
                at += has_token
            return kept, tokens, probs

        self._set(io, "prepare_batch_tensors", prepare_batch_tensors)
        self._set(runner, "compute_batch", compute_batch)
        self._set(runner, "warmup", warm_up)
        self._set(io, "prepare_batch_update", prepare_batch_update)


def engine_ended_generation(model, prompts, rid: str, step: int, **generate_kwargs):
    """``model.generate_batch(prompts, **generate_kwargs)`` through a persistent manager (as the
    fail_request runs generate, destroyed after) while the engine ends ``rid`` at ``step``:
    (outputs, :class:`EngineEndsRequest`)."""
    ends = EngineEndsRequest(model, rid, step)
    try:
        with ends:
            out = model.generate_batch(prompts, persistent_manager=True, **generate_kwargs)
    finally:
        model.destroy_cached_continuous_batching_manager()
    return out, ends
