"""Fail closed in a serving engine: from the canary's failed requests (batch index, bits, slots) to
the engine's request ids and the KV blocks to keep out of reuse (docs/operators.md, "What happens on a
detection"; docs/engines/sglang.md shows the hook in a scheduler).

:class:`FailedRequests` is the hook. Each step, note the engine's request ids in the order of the
batch handed to the canary (:func:`sglang_request_ids`, :func:`vllm_request_ids`); after the step,
:meth:`FailedRequests.take` turns the verdicts that have arrived into :class:`RequestFailure` s —
the request (as noted), its error, and the blocks (``slot // page_size``) its violation rows name —
for the engine's abort path. It never waits on the device: verdicts arrive with the canary's
snapshots, usually one or two steps later, so keep noted steps until then (``keep_steps``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .. import abi
from ..errors import CorruptedKvError, ValidationError, ValidationTypeError
from ..validate import integer


@dataclass(frozen=True)
class RequestFailure:
    """One request the canary failed: ``request`` as noted (an id, or the engine's request object),
    the step and its index in that step's batch, the fail bits, the slots its rows name and the
    blocks holding them (``slot // page_size``; slots outside the pool and the padding slot 0 name
    none), and the error to fail it with."""

    request: object
    step: int
    batch_index: int
    reasons: abi.FailReason
    slots: tuple[int, ...]
    blocks: tuple[int, ...]
    error: CorruptedKvError


class FailedRequests:
    """Batch index -> request, per step (see the module docstring). ``canary``: the KvCanary;
    ``page_size``: tokens per KV block (1 for a token-granular pool); ``num_slots``: the pool's
    slots (default: the canary's), past which a slot names no block. ``unmapped`` counts failures
    whose step was not noted (or was dropped after ``keep_steps``)."""

    def __init__(self, canary, *, page_size: int, num_slots: int | None = None, keep_steps: int = 256):
        self.canary = canary
        self.page_size = integer("page_size", page_size, lo=1, fix="pass the engine's tokens per KV block")
        self.num_slots = canary.groups["FULL"].num_slots if num_slots is None else num_slots
        self.keep_steps = integer("keep_steps", keep_steps, lo=1, fix="pass how many steps verdicts may lag, e.g. 256")
        self.steps: OrderedDict[int, list] = OrderedDict()
        self.unmapped = 0

    def note(self, requests, step: int | None = None) -> None:
        """The engine's requests of the step the canary is running, in batch order (call it with
        ``before_forward``: ``step`` defaults to ``canary.step``, the step ``after_forward`` reports)."""
        if isinstance(requests, (str, bytes)) or not hasattr(requests, "__len__"):
            raise ValidationTypeError(f"kv-canary: FailedRequests.note(requests) must be a sequence of the step's "
                                      f"requests in batch order, got {type(requests).__name__}. Fix: pass "
                                      f"sglang_request_ids(batch) or vllm_request_ids(input_batch)")
        self.steps[self.canary.step if step is None else step] = list(requests)
        while len(self.steps) > self.keep_steps:
            self.steps.popitem(last=False)

    def take(self) -> list[RequestFailure]:
        """The failures whose verdicts arrived since the last call (never waits on the device)."""
        out = []
        for f in self.canary.failed_requests():
            requests = self.steps.get(f.step)
            if requests is None or not 0 <= f.batch_index < len(requests):
                self.unmapped += 1
                continue
            blocks = tuple(sorted({s // self.page_size for s in f.slots if 0 < s < self.num_slots}))
            request = requests[f.batch_index]
            out.append(RequestFailure(request, f.step, f.batch_index, f.reasons, f.slots, blocks,
                                      CorruptedKvError(getattr(request, "rid", request), f)))
        return out


def sglang_request_ids(batch) -> list:
    """SGLang: the requests of a ``ScheduleBatch`` (its ``reqs``: ``Req`` objects, whose ``rid`` is the
    id; the order of ``forward_batch.req_pool_indices``, which :func:`~.sglang_batch` keeps), or the
    ``rids`` of a ``ForwardBatch`` that carries them."""
    reqs = getattr(batch, "reqs", None)
    if reqs is not None:
        return list(reqs)
    rids = getattr(batch, "rids", None)
    if rids is not None:
        return list(rids)
    raise ValidationError(f"kv-canary: sglang_request_ids needs a ScheduleBatch (.reqs) or a ForwardBatch with "
                          f".rids, got {type(batch).__name__} with neither. Fix: pass the ScheduleBatch the "
                          f"ForwardBatch was built from")


def vllm_request_ids(input_batch, num_reqs: int | None = None) -> list:
    """vLLM V1: the request ids of the model runner's ``InputBatch`` in its row order (``req_ids``),
    the order of the block table and ``query_start_loc`` that :func:`~.vllm_batch` reads; the
    first ``num_reqs`` (default: all)."""
    ids = getattr(input_batch, "req_ids", None)
    if ids is None:
        raise ValidationError(f"kv-canary: vllm_request_ids needs the model runner's InputBatch (.req_ids), got "
                              f"{type(input_batch).__name__} without it. Fix: pass self.input_batch of the "
                              f"GPU model runner")
    ids = list(ids)
    return ids if num_reqs is None else ids[:num_reqs]
