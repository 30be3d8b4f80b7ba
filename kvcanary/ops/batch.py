"""Plans (docs/format.md §8): the engine's batch, and the device arrays one step's launches read.

:class:`Batch` holds numbers an engine already has; :class:`StepPlan` holds what the plan builder
derives from them: the WritePlan, per-request verify-entry offsets (all the fused verify needs)
and, when materialised, the per-entry VerifyPlan. Every per-step value lives in the plan's memory,
so a step captured in a CUDA graph replays with new batch contents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..abi import BatchField
from ..errors import BatchValueError, ValidationError
from ..interop.arrays import ArrayView
from ..validate import INT32_MAX, boolean, integer
from .checks import alloc_zeros, checked, same_device
from .state import ViolationSink

OFFSET_LIMIT = 1 << 62      # |expected_token_offset|: position + offset stays inside int64 on the device
MAX_BATCH_LIMIT = 1 << 24   # requests per step the plans are sized for (the prepare block loops over them)
REJECT_RING_ROWS = 64


@dataclass
class Batch:
    """One forward step of an engine, as plain arrays (torch, CuPy, JAX, numpy or kvcanary).

    - ``req_pool_indices``, ``prefix_lens``, ``extend_lens``: int64 ``[bs]``; row 0 is padding.
      ``prefix_lens`` counts tokens already in the cache (verified), ``extend_lens`` new tokens.
    - ``req_to_token``: int32 ``[rows, max_len]``, the full-pool slot of each request position.
    - ``input_ids``, ``positions``, ``out_cache_loc``: int64 ``[T]``, the new tokens in request
      order (request r owns ``extend_lens[r]`` consecutive entries; padding requests own none and
      must come last); ``out_cache_loc`` -1 skips an entry.
    - ``expected_pool`` (int64 ``[rows, len]``), ``expected_valid_lens`` (int64 ``[bs]``) and
      ``expected_token_offset`` (0 target model, +1 draft model): optional expected tokens.
    - ``expected_input_ids``, ``expected_positions``: optional int64 ``[T]`` the write asserts.
    - ``swa_out_cache_loc``: int64 ``[T]``, the SWA-pool slots of the new tokens (SWA group only).
    """

    req_pool_indices: Any
    prefix_lens: Any
    extend_lens: Any
    req_to_token: Any
    input_ids: Any = None
    positions: Any = None
    out_cache_loc: Any = None
    expected_pool: Any = None
    expected_valid_lens: Any = None
    expected_token_offset: int = 0
    expected_input_ids: Any = None
    expected_positions: Any = None
    swa_out_cache_loc: Any = None

    def views(self, swa_map=None) -> dict[str, ArrayView]:
        """Every given array as a checked view (dtype, rank, matching lengths, one device), and
        ``swa_map`` (int64 ``[full slots]``) when given. Values are not read."""
        v = {
            "req_pool_indices": checked(self.req_pool_indices, "batch.req_pool_indices", dtype=np.int64, ndim=1),
            "prefix_lens": checked(self.prefix_lens, "batch.prefix_lens", dtype=np.int64, ndim=1),
            "extend_lens": checked(self.extend_lens, "batch.extend_lens", dtype=np.int64, ndim=1),
        }
        bs = v["req_pool_indices"].shape[0]
        for name in ("prefix_lens", "extend_lens"):
            if v[name].shape[0] != bs:
                raise ValidationError(f"kv-canary: batch.{name} must have shape ({bs},) like "
                                      f"req_pool_indices, got {v[name].shape}. Fix: one entry per request")
        v["req_to_token"] = checked(self.req_to_token, "batch.req_to_token", dtype=np.int32, ndim=2)
        for name in ("input_ids", "positions", "out_cache_loc", "expected_input_ids", "expected_positions",
                     "swa_out_cache_loc"):
            if getattr(self, name) is not None:
                v[name] = checked(getattr(self, name), f"batch.{name}", dtype=np.int64, ndim=1)
        if self.expected_pool is not None:
            v["expected_pool"] = checked(self.expected_pool, "batch.expected_pool", dtype=np.int64, ndim=2)
            if self.expected_valid_lens is not None:
                v["expected_valid_lens"] = checked(self.expected_valid_lens, "batch.expected_valid_lens",
                                                   dtype=np.int64, shape=(bs,), ndim=1)
        if swa_map is not None:
            v["swa_map"] = checked(swa_map, "swa_map", dtype=np.int64, ndim=1)
        lengths = {name: v[name].shape[0] for name in ("input_ids", "positions", "out_cache_loc", "expected_input_ids",
                                                       "expected_positions", "swa_out_cache_loc") if name in v}
        if len(set(lengths.values())) > 1:  # name every length: which one is wrong is the caller's to say
            got = ", ".join(f"{name} {n}" for name, n in lengths.items())
            raise ValidationError(f"kv-canary: the batch's per-token arrays must have one entry per new token, all "
                                  f"of one length, got {got}. Fix: pass input_ids, positions and out_cache_loc (and "
                                  f"the optional per-token arrays) of one length")
        integer("batch.expected_token_offset", self.expected_token_offset, lo=-OFFSET_LIMIT, hi=OFFSET_LIMIT,
                fix="pass 0 (target model) or 1 (draft model)")
        same_device(list(v.values()), "a Batch")
        return v

    @staticmethod
    def check_window(swa_window) -> int:
        return integer("swa_window", swa_window, lo=0, hi=INT32_MAX, fix="pass 0 (no window) or the window in tokens")


def _reject(field: BatchField, name: str, index, expected: str, got, fix: str, *, request=-1, value=0,
            bound=0, slot=-1):
    where = f"{name}[{index}]" if index is not None else name
    raise BatchValueError(f"kv-canary: {where} must be {expected}, got {got}. Fix: {fix}", field=int(field),
                          request=int(request), value=int(value), bound=int(bound), slot=int(slot))


def check_batch_values(v: dict[str, ArrayView], batch: "Batch", *, swa: bool) -> None:
    """Host arrays only (never a device read): the values the kernels would report as
    BATCH_INDEX_OUT_OF_RANGE are rejected before anything runs (BatchValueError, with the
    fields of the row the device would write)."""
    rows, max_len = v["req_to_token"].shape
    rpi, pre, ext = (v[k].host for k in ("req_pool_indices", "prefix_lens", "extend_lens"))
    real = rpi != 0
    for i in np.flatnonzero(real & ((rpi < 0) | (rpi >= rows)))[:1]:
        _reject(BatchField.REQ_POOL_INDEX, "batch.req_pool_indices", i, f"0 (padding) or a request-pool row in "
                f"[1, {rows})", int(rpi[i]), f"pass rows of req_to_token (it has {rows}); row 0 is the padding row",
                request=i, value=rpi[i], bound=rows)
    for i in np.flatnonzero(real[1:] & ~real[:-1])[:1]:
        _reject(BatchField.PADDING_ORDER, "batch.req_pool_indices", i, "a real row (padding rows come last)", 0,
                f"move the padding requests (row 0) after the real ones (index {i + 1} is real)",
                request=i, bound=rpi[i + 1])
    for i in np.flatnonzero(real & ((pre < 0) | (pre > max_len)))[:1]:
        _reject(BatchField.PREFIX_LEN, "batch.prefix_lens", i, f"in [0, {max_len}] (req_to_token's max_len)",
                int(pre[i]), "pass the number of cached tokens of each request", request=i, value=pre[i], bound=max_len)
    for i in np.flatnonzero(real & (ext < 0))[:1]:
        _reject(BatchField.EXTEND_LEN, "batch.extend_lens", i, ">= 0", int(ext[i]),
                "pass the number of new tokens of each request", request=i, value=ext[i])
    loc = v.get("swa_out_cache_loc" if swa else "out_cache_loc")
    if loc is None:
        return
    T, ext = loc.shape[0], np.where(real, ext, 0)
    for i in np.flatnonzero(ext > T)[:1]:  # before the sum, which could wrap past int64
        _reject(BatchField.TOKENS_SHORT, "batch.out_cache_loc", None, f"at least extend_lens[{i}] = {int(ext[i])} "
                f"entries long", f"{T} entries", "pass one entry per new token of every request (request order)",
                value=ext[i], bound=T)
    need = int(ext.sum())
    if need > T:
        _reject(BatchField.TOKENS_SHORT, "batch.out_cache_loc", None, f"at least sum(extend_lens) = {need} entries "
                f"long", f"{T} entries", "pass one entry per new token of every request (request order)",
                value=need, bound=T)
    extra = np.flatnonzero(loc.host[need:] > 0)
    if len(extra):
        i = need + int(extra[0])
        _reject(BatchField.TOKENS_UNOWNED, "batch.out_cache_loc", i, f"-1 or 0 (a padding token past "
                f"sum(extend_lens) = {need})", int(loc.host[i]), "give every token with a slot to a request's "
                "extend_lens, or pad with -1 (skip) or 0 (the padding slot)", value=i, bound=need, slot=loc.host[i])



BATCH_FIELD_NAMES = tuple(f"batch.{name}" for name in Batch.__dataclass_fields__)  # in field order

@dataclass
class StepPlan:
    """Device (or host) arrays of one step: WritePlan, verify-entry offsets, optional VerifyPlan.

    ``num_valid`` and ``enable`` are shared by the fused verify and the materialised plan.
    """

    max_batch: int
    verify_capacity: int
    device: int | None
    offsets: Any = None        # WritePlan.offsets int64 [max_batch + 1]
    seed: Any = None           # WritePlan.seed int64 [max_batch]
    num_valid_reqs: Any = None  # int32 [1]
    entry_offsets: Any = None  # int64 [max_batch + 1]
    num_valid: Any = None      # int32 [1]
    enable: Any = None         # int32 [1]
    slot: Any = None           # VerifyPlan entries, int64 [verify_capacity] (materialised plans)
    expected_token: Any = None
    expected_position: Any = None
    prev_slot: Any = None
    _reject_sink: Any = field(default=None, repr=False)

    @classmethod
    def allocate(cls, max_batch: int, verify_capacity: int, *, device: int | None = None,
                 materialize: bool = False) -> "StepPlan":
        integer("max_batch", max_batch, lo=1, hi=MAX_BATCH_LIMIT)
        integer("verify_capacity", verify_capacity, lo=1, hi=INT32_MAX)
        boolean("materialize", materialize)
        z = lambda shape, dt: alloc_zeros(shape, dt, device)  # noqa: E731
        p = cls(max_batch, verify_capacity, device,
                offsets=z((max_batch + 1,), np.int64), seed=z((max_batch,), np.int64),
                num_valid_reqs=z((1,), np.int32), entry_offsets=z((max_batch + 1,), np.int64),
                num_valid=z((1,), np.int32), enable=z((1,), np.int32))
        p._reject_sink = _new_reject_sink(device)  # now: never allocate during a graph capture
        if materialize or device is None:  # the CPU backend always materialises
            p.slot, p.expected_token, p.expected_position, p.prev_slot = (
                z((verify_capacity,), np.int64) for _ in range(4))
        return p

    @property
    def materialized(self) -> bool:
        return self.slot is not None

    # ---- checked views of the plan's arrays, as the launches read them -------------------------------
    def entry_views(self) -> dict[str, ArrayView]:
        return {k: checked(getattr(self, k), f"plan.{k}", dtype=np.int64, shape=(self.verify_capacity,), ndim=1)
                for k in ("slot", "expected_token", "expected_position", "prev_slot")}

    def flag_views(self) -> tuple[ArrayView, ArrayView]:
        return tuple(checked(getattr(self, k), f"plan.{k}", dtype=np.int32, shape=(1,), ndim=1)
                     for k in ("num_valid", "enable"))

    def write_views(self) -> tuple[ArrayView, ArrayView, ArrayView]:
        return (checked(self.offsets, "plan.offsets", dtype=np.int64, shape=(self.max_batch + 1,), ndim=1),
                checked(self.seed, "plan.seed", dtype=np.int64, shape=(self.max_batch,), ndim=1),
                checked(self.num_valid_reqs, "plan.num_valid_reqs", dtype=np.int32, shape=(1,), ndim=1))

    def entry_offsets_view(self) -> ArrayView:
        return checked(self.entry_offsets, "plan.entry_offsets", dtype=np.int64, shape=(self.max_batch + 1,), ndim=1)

    @property
    def reject_sink(self):
        """The sink the plan builder reports rejected batch values to when no context is given
        (a small ring of the plan's own)."""
        if self._reject_sink is None:  # a plan built by hand
            self._reject_sink = _new_reject_sink(self.device)
        return self._reject_sink


def _new_reject_sink(device):
    return ViolationSink.allocate(REJECT_RING_ROWS, device=device)
