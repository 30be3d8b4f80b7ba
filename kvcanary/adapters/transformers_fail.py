"""Fail closed in transformers continuous batching (``TransformersCanary(mode="fail_request")``).

The request that read corrupted KV ends with ``status=FAILED`` and a :class:`~kvcanary.CorruptedKvError`
in the step its corruption was verified (its output keeps the tokens of the steps before; that
step's token is dropped), every other request carries on, and its KV blocks are kept out of prefix
reuse: a later request with the same prompt recomputes them.

How, within the engine's own API (transformers 5.18-5.25): each step's requests are noted in batch
order when the canary runs. ``inputs_and_outputs.prepare_batch_update`` (where the engine reads a
step's sampled tokens, having waited for them) is wrapped: it first waits for that step's canary
snapshot (an event recorded after the canary's TAIL: the engine waited for the step already, so
this costs nothing), takes the failed requests, fails each through the processor's
``_handle_request_error`` (status FAILED, error, output delivered) and ``scheduler.finish_request``
(blocks freed), and drops failed requests from the update it hands to ``update_batch``. The
blocks they held lose their content hash first (an unreferenced hashed block goes back to the
pool), and ``cache.mark_complete_blocks`` is wrapped so that another request holding one of those
blocks cannot register its hash again. Async batching updates a step after the next one was
launched: a failed request still in that step is dropped there too.
"""

from __future__ import annotations

from ..errors import CorruptedKvError, ValidationError

KEEP_STEPS = 64  # noted steps awaiting their update: async batching keeps 2
KEEP_ENDED = 2   # updates without a failed request's id before it is forgotten
FINISHED_STATUS = 3  # transformers' RequestStatus.FINISHED (FAILED is 4): a request at or past it has ended
_FIX = "fix: use transformers 5.18-5.25, or mode='log'"


def check_engine(processor) -> None:
    """The engine objects fail_request works through, each named when missing."""
    for obj, path in ((processor, "_handle_request_error"), (processor, "scheduler.finish_request"),
                      (processor, "scheduler.active_requests"), (processor, "inputs_and_outputs.prepare_batch_update"),
                      (processor, "cache.mark_complete_blocks"), (processor, "cache.cache_allocators")):
        target = obj
        for name in path.split("."):
            if not hasattr(target, name):
                raise ValidationError(f"kv-canary: mode='fail_request' needs the batch processor's {path}, got a "
                                      f"processor without it ({type(processor).__name__}); {_FIX}")
            target = getattr(target, name)
    for name, alloc in processor.cache.cache_allocators.items():
        ledger = getattr(alloc, "ledger", None)
        if not all(hasattr(ledger, a) for a in ("hash_to_block", "block_to_hash", "cached_blocks")) \
                or not hasattr(alloc, "block_table"):
            raise ValidationError(f"kv-canary: mode='fail_request' needs the {name} allocator's block_table and "
                                  f"ledger (hash_to_block, block_to_hash, cached_blocks), got {type(alloc).__name__} "
                                  f"without them; {_FIX}")


class RequestFailer:
    """Fails the requests a canary's verdicts name (see the module docstring). ``failed``: one
    record per failed request, the verdict that failed it (request id, step, reasons, slots, blocks
    kept out of reuse, whether it was ended here); a later step's verdict for a request failed
    already (async batching ran one more step with it) keeps that step's blocks out of reuse too,
    and is no new record."""

    def __init__(self, page_size: int, device: int | None = None):
        self.page_size, self.device = page_size, device
        self.spare: list = []                           # events of updated steps, recorded again by later ones
        self.steps: dict[int, tuple[list, object]] = {}  # canary step -> (request ids in batch order, event)
        self.pending: list = []                         # FailedRequests of steps not updated yet
        self.ended: dict = {}                           # id of a request failed here -> updates left to drop it
        self.poisoned: dict[str, set] = {}              # allocator name -> blocks kept out of prefix reuse
        self.failed: list[dict] = []

    def hook(self, processor, canary, patch) -> None:
        """Wrap the processor's ``prepare_batch_update`` (fails and drops failed requests; ``canary()``
        gives the canary) and its cache's ``mark_complete_blocks`` (:meth:`guard`), through
        ``patch(obj, name, fn)``."""
        io, cache = processor.inputs_and_outputs, processor.cache
        update, mark = io.prepare_batch_update, cache.mark_complete_blocks

        def prepare_batch_update(*args, **kwargs):
            return self.update(processor, canary(), update(*args, **kwargs))

        def mark_complete_blocks(*args, **kwargs):
            out = mark(*args, **kwargs)
            if self.poisoned:
                self.guard(cache)
            return out
        patch(io, "prepare_batch_update", prepare_batch_update)
        patch(cache, "mark_complete_blocks", mark_complete_blocks)

    def noted(self, step: int, request_ids: list, stream) -> None:
        """Step ``step`` of the canary ran on these requests (after its TAIL, on ``stream``: a handle or
        a torch stream; None on the host). Its event is a driver event, reused once its step is updated."""
        event = None
        if stream is not None and self.device is not None:
            from ..runtime import memory
            event = self.spare.pop() if self.spare else memory.Event(self.device)
            event.record(stream if type(stream) is int else int(stream.cuda_stream))
        self.steps[step] = (request_ids, event)
        while len(self.steps) > KEEP_STEPS:  # steps the engine never updated (none expected): the oldest go
            self._forget_step(min(self.steps))

    def _forget_step(self, step: int) -> None:
        event = self.steps.pop(step)[1]
        if event is not None:
            self.spare.append(event)

    def update(self, processor, canary, out):
        """``prepare_batch_update``'s (requests, tokens, logprobs) with failed requests failed and dropped."""
        requests_in_batch, new_tokens, logprobs = out
        ids = [f.state.request_id for f in requests_in_batch]
        step = self._step_of(ids)
        if step is not None and canary is not None:
            event = self.steps[step][1]
            if event is not None:
                event.synchronize()  # the step's canary snapshot: the engine has waited for the step already
            self.pending += canary.failed_requests()
            now = [f for f in self.pending if f.step <= step]
            self.pending = [f for f in self.pending if f.step > step]
            for f in now:
                noted = self.steps.get(f.step, ((), None))[0]
                if 0 <= f.batch_index < len(noted):
                    self._fail(processor, noted[f.batch_index], f)
            for s in [s for s in self.steps if s <= step]:
                self._forget_step(s)
        dropped, seen = set(self.ended), set(ids)
        # an id is dropped while updates carry it and for one more (async batching launched the next
        # step before this update), then forgotten: a later request with that id is the engine's again
        self.ended = {rid: KEEP_ENDED if rid in seen else left - 1 for rid, left in self.ended.items()
                      if rid in seen or left > 1}
        if not dropped & seen:
            return out
        keep, tokens, probs, at = [], [], [] if logprobs is not None else None, 0
        for f in requests_in_batch:
            drop = f.state.request_id in dropped
            if getattr(f, "has_new_token", False):
                if not drop:
                    tokens.append(new_tokens[at])
                    if probs is not None:
                        probs.append(logprobs[at])
                at += 1
            if not drop:
                keep.append(f)
        return keep, tokens, probs

    def _step_of(self, ids: list):
        """The oldest noted step whose requests are these (the engine updates steps in order)."""
        for step in sorted(self.steps):
            if self.steps[step][0] == ids:
                return step
        return None

    def _fail(self, processor, rid, failed) -> None:
        blocks, named = {}, {s // self.page_size for s in failed.slots if s > 0}  # slot = block * page_size + offset
        for name, alloc in processor.cache.cache_allocators.items():
            blocks[name] = sorted(named | set(alloc.block_table.get(rid, ())))
            for b in blocks[name]:
                forget_block(alloc, b)
            self.poisoned.setdefault(name, set()).update(blocks[name])
        if rid in self.ended:  # failed here already (a later step's verdict): its blocks only, not a new failure
            return
        self.ended[rid] = KEEP_ENDED
        state = processor.scheduler.active_requests.get(rid)
        live = state is not None and int(state.status) < FINISHED_STATUS
        if live:
            processor._handle_request_error(CorruptedKvError(rid, failed), state)  # FAILED, delivered
            processor.scheduler.finish_request(rid)  # after: it keeps the request's tokens (and frees its blocks)
            self.guard(processor.cache)
        self.failed.append({"request_id": rid, "step": failed.step, "reasons": failed.reason_text,
                            "slots": list(failed.slots), "blocks": blocks, "ended": live})

    def guard(self, cache) -> None:
        """After ``mark_complete_blocks``: poisoned blocks another request still holds lose the hash it
        registered again; a poisoned block that no request holds any more is forgotten (its next owner
        writes it afresh)."""
        for name, blocks in self.poisoned.items():
            alloc = cache.cache_allocators[name]
            held = {b for table in alloc.block_table.values() for b in table}
            for b in list(blocks):
                forget_block(alloc, b)
                if b not in held:
                    blocks.discard(b)


def forget_block(alloc, block: int) -> None:
    """Block ``block`` of ``alloc`` no longer matches any prefix; unreferenced, it goes back to the pool."""
    ledger = alloc.ledger
    h = ledger.block_to_hash.pop(block, None)
    if h is not None and ledger.hash_to_block.get(h) == block:
        del ledger.hash_to_block[h]
    if block in ledger.cached_blocks:
        del ledger.cached_blocks[block]
        alloc.pool.free_blocks(alloc.index, [block])


def forget_prefix_cache(cache) -> int:
    """Drop every block of the cache's prefix cache (transformers 5.18-5.25's allocator ledgers): the
    blocks a new canary has no records for (stamped under another canary, or under none) are then
    recomputed, not read as a cached prefix. Returns how many blocks were dropped."""
    dropped = 0
    for alloc in getattr(cache, "cache_allocators", {}).values():
        ledger = getattr(alloc, "ledger", None)
        if ledger is None or not hasattr(ledger, "block_to_hash"):
            continue
        for block in list(ledger.block_to_hash) + [b for b in list(ledger.cached_blocks)
                                                   if b not in ledger.block_to_hash]:
            forget_block(alloc, block)
            dropped += 1
    return dropped
