"""kvcanary in vLLM through its KV connector door, with one flag and no patch::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvCanaryConnector",
        "kv_connector_module_path": "kvcanary.adapters.vllm_connector", "kv_role": "kv_producer"}'

vLLM loads :class:`KvCanaryConnector` in the scheduler and in every worker. The scheduler side
notes, per step, what the workers need and cannot know (:class:`~.vllm_steps.SchedulerNotes`); each
worker registers its KV caches (:func:`~.vllm.vllm_canary`) and, from the step-level hooks only,
runs HEAD in ``bind_connector_metadata`` (before the forward) and TAIL in ``finish_forward``
(after it) on the forward's stream, so FULL CUDA graphs stay on. The blocks that violation rows of
cached tokens name go back through ``get_block_ids_with_load_errors()`` to vLLM's own policy:
``kv_load_failure_policy="fail"`` (vLLM's default) ends every running request holding one with
FINISHED_ERROR and evicts the block and its descendants from the prefix cache; ``"recompute"`` cuts
the request back to its last good block and recomputes (docs/engines/vllm.md).

Settings travel in ``kv_connector_extra_config``: :class:`~kvcanary.CanaryConfig`'s fields (``mode``,
``hash_mode``, ...; ``device`` is the worker's own) plus ``layers`` ("first", "all" or indices) and
``verdicts`` ("auto", "step", "next": when a detection reaches vLLM). It claims no external
tokens and changes nothing in vLLM's scheduling: the schedule, the blocks and the tokens are the
same with and without it.

This module imports vLLM (only vLLM imports it); the rest of kvcanary never does.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from ..config import CanaryConfig
from ..errors import ValidationError
from .vllm import vllm_canary
from .vllm_steps import SchedulerNotes, StepNotes, WorkerSteps

log = logging.getLogger("kvcanary")

VERDICTS = ("auto", "step", "next")
ADAPTER_KEYS = ("layers", "verdicts")
KEPT_STEPS = 64  # request ids of the last steps, to name a failed request in the log
KEPT_FAILED = 4096  # failed requests remembered (one log line and one entry each)


class KvCanaryMetadata(KVConnectorMetadata):
    """The scheduler's notes of one step (:class:`~.vllm_steps.StepNotes`) on their way to the workers."""

    def __init__(self, notes: StepNotes):
        self.notes = notes


def connector_settings(extra: dict, *, max_num_seqs: int, max_model_len: int, async_scheduling: bool):
    """(CanaryConfig, layers, verdicts) from ``kv_connector_extra_config``; every error is a
    ``kv-canary:`` one naming the key and the fix. Defaults: ``mode="fail_request"`` (a detection
    reaches vLLM's failure policy), ``max_batch=max_num_seqs``, room to verify every cached token
    of a full batch, ``verdicts="auto"`` ("next" under async scheduling, "step" without)."""
    if not isinstance(extra, dict):
        raise ValidationError(f"kv-canary: kv_connector_extra_config must be a JSON object, got "
                              f"{type(extra).__name__}. Fix: pass {{}} or e.g. {{\"layers\": \"all\"}}")
    fields = tuple(n for n in CanaryConfig.names() if n != "device")
    unknown = sorted(set(extra) - set(fields) - set(ADAPTER_KEYS))
    if unknown:
        got = ("device: the canary runs on each worker's own GPU" if unknown == ["device"] else
               f"unknown keys {unknown}")
        raise ValidationError(f"kv-canary: kv_connector_extra_config takes {', '.join(ADAPTER_KEYS + fields)}; "
                              f"got {got}. Fix: remove {unknown}")
    verdicts = extra.get("verdicts", "auto")
    if verdicts not in VERDICTS:
        raise ValidationError(f"kv-canary: kv_connector_extra_config verdicts must be one of {VERDICTS}, got "
                              f"{verdicts!r}. Fix: \"step\" (the step that read bad KV emits no token; waits for "
                              f"the step's checks), \"next\" (waits only for the previous step's checks; exactly "
                              f"one token escapes) or \"auto\"")
    if verdicts == "auto":
        verdicts = "next" if async_scheduling else "step"
    settings = {"mode": "fail_request", "max_batch": max_num_seqs,
                "verify_capacity": max(1 << 20, min(max_num_seqs * max_model_len, (1 << 31) - 1))}
    settings.update({k: v for k, v in extra.items() if k in fields})
    return CanaryConfig(**settings), extra.get("layers"), verdicts


class KvCanaryConnector(KVConnectorBase_V1):
    """A vLLM ``KVConnectorBase_V1`` that stamps and verifies every KV slot (module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._refuse_uncovered(vllm_config, kv_cache_config)
        sched = vllm_config.scheduler_config
        self.config, self.layers, self.verdicts = connector_settings(
            self._kv_transfer_config.kv_connector_extra_config, max_num_seqs=sched.max_num_seqs,
            max_model_len=vllm_config.model_config.max_model_len, async_scheduling=bool(sched.async_scheduling))
        self.block_size = vllm_config.cache_config.block_size
        self.notes = SchedulerNotes() if role == KVConnectorRole.SCHEDULER else None
        self.canary = self.steps = None
        self._bound = self._batch = self._stream = None
        self._binds = 0          # steps bound so far (with or without a forward)
        self._steps: dict = {}   # canary step -> (bind number, request ids in batch order)
        self._events: list = []  # (bind number, event after that step's TAIL), oldest first
        self._pending: list = []  # failed requests taken from the canary, not handed to vLLM yet
        self._spare: list = []    # events whose step was waited for, to record again
        self.failed: list = []  # one dict per failed request (request id, step, reasons, blocks), the newest kept
        self._failed_ids: dict = {}

    def _refuse_uncovered(self, vllm_config, kv_cache_config) -> None:
        """Start-up refusals, each naming the setting and the fix."""
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if len(groups) > 1:
            raise ValidationError(f"kv-canary: KvCanaryConnector covers one KV cache group, got {len(groups)} "
                                  f"(a hybrid model: sliding-window, Mamba or cross-attention groups); vLLM cannot "
                                  f"map reported blocks back to requests across groups. Fix: serve this model "
                                  f"without the canary connector")
        if getattr(vllm_config.model_config, "is_encoder_decoder", False):
            raise ValidationError("kv-canary: KvCanaryConnector does not cover encoder-decoder models (their "
                                  "cross-attention cache is a second KV cache group). Fix: serve this model "
                                  "without the canary connector")
        role = self._kv_transfer_config.kv_role
        if role != "kv_producer":
            raise ValidationError(f"kv-canary: KvCanaryConnector needs \"kv_role\": \"kv_producer\", got {role!r}: a "
                                  f"consumer role makes vLLM defer block frees under async scheduling, which "
                                  f"changes its scheduling. Fix: set \"kv_role\": \"kv_producer\" in "
                                  f"--kv-transfer-config (the canary loads nothing)")

    # ---- what the connector claims: nothing that changes vLLM's scheduling ------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config) -> bool:
        return True  # the canary reads no block hashes: vLLM's prefix caching stays as without it

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    # ---- scheduler side ---------------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        self.notes.add(request)

    def request_finished(self, request, block_ids):
        self.notes.drop(request.request_id)
        return False, None

    def build_connector_meta(self, scheduler_output) -> KvCanaryMetadata:
        return KvCanaryMetadata(self.notes.build(scheduler_output))

    # ---- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        """Build the canary over the worker's per-layer caches (vLLM's packed views; the layout vLLM
        resolved). A layout the strides cannot place is a ``kv-canary:`` error here, at start-up."""
        layout = getattr(self._kv_cache_config, "kv_cache_layout", None) or getattr(
            self._vllm_config.cache_config, "kv_cache_layout", None)
        settings = {n: getattr(self.config, n) for n in CanaryConfig.names() if n != "device"}
        self.canary = vllm_canary(kv_caches, layers=self.layers, layout=layout, **settings)
        drafts = getattr(self._vllm_config, "speculative_config", None)  # positions past max_model_len
        spec = max(0, getattr(drafts, "num_speculative_tokens", 0) or 0)
        self.steps = WorkerSteps(block_size=self.block_size, rows=self.config.max_batch,
                                 max_len=self._vllm_config.model_config.max_model_len + spec + self.block_size,
                                 device=self.canary.device)

    def bind_connector_metadata(self, connector_metadata) -> None:
        """HEAD, before the forward: verify each scheduled request's cached prefix, stamp its new tokens."""
        super().bind_connector_metadata(connector_metadata)
        if self.canary is None or connector_metadata is self._bound:
            return
        self._bound = connector_metadata
        self._binds += 1
        self._stream = _current_stream(self.canary.device)
        self._batch = self.steps.batch(connector_metadata.notes, self._stream)
        if self._batch is not None:
            self._steps[self.canary.step] = (self._binds, self.steps.ids)
            self._steps.pop(self.canary.step - KEPT_STEPS, None)
            self.canary.before_forward(self._batch, stream=self._stream)

    def finish_forward(self) -> None:
        """TAIL, after the forward: verify with real KV, stamp the fingerprints of the new tokens."""
        if self._batch is None:
            return
        self.canary.after_forward(self._batch, stream=self._stream)
        self._batch = None
        if self._stream is not None:
            from ..runtime import memory
            event = self._spare.pop() if self._spare else memory.Event(self.canary.device)
            event.record(int(self._stream.cuda_stream))
            self._events.append((self._binds, event))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks that violation rows of cached tokens name, for vLLM's failure policy, from the
        steps whose verdicts are due: with ``verdicts="step"`` this step's (it first waits for the
        step's checks, so a request that read bad KV emits no token of this step), with ``"next"``
        the previous step's (its checks finished before this step's forward on the stream, so the
        wait is free and exactly one token can escape)."""
        if self.canary is None:
            return set()
        due = self._binds - (self.verdicts == "next")
        while self._events and self._events[0][0] <= due:
            event = self._events.pop(0)[1]
            event.synchronize()
            self._spare.append(event)
        self._pending += self.canary.failed_requests()
        now = [f for f in self._pending if self._steps.get(f.step, (0,))[0] <= due]
        self._pending = [f for f in self._pending if self._steps.get(f.step, (0,))[0] > due]
        blocks: set = set()
        slots = self.canary.groups["FULL"].num_slots
        report = self.config.mode == "fail_request"
        for f in now:
            ids = self._steps.get(f.step, (0, ()))[1]
            rid = ids[f.batch_index] if 0 <= f.batch_index < len(ids) else None
            named = sorted({s // self.block_size for s in f.slots if 0 < s < slots})
            if report:
                blocks.update(named)
            if rid is not None and rid in self._failed_ids:  # read the bad KV again before vLLM ended it
                continue
            self._failed_ids[rid] = None
            while len(self._failed_ids) > KEPT_FAILED:
                self._failed_ids.pop(next(iter(self._failed_ids)))
            self.failed.append({"request_id": rid, "step": f.step, "reasons": f.reason_text, "blocks": named,
                                "reported": report})
            del self.failed[:-KEPT_FAILED]
            log.error("kv-canary: vLLM request %s read KV that failed the canary's checks in step %d (%s); "
                      "blocks %s %s", rid, f.step, f.reason_text, named,
                      "reported to vLLM's kv_load_failure_policy" if report and named else
                      "not reported (no cached block named)" if report else f"not reported (mode={self.config.mode})")
        return blocks

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def shutdown(self) -> None:
        if self.canary is not None:
            self.canary.flush()


def _current_stream(device):
    """The worker's current torch stream on ``device`` (the forward's), None on the host."""
    if device is None:
        return None
    import torch
    return torch.cuda.current_stream(device)
