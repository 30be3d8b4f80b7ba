"""Plans (SPEC §8): the engine's batch, and the device arrays one step's launches read.

:class:`Batch` holds numbers an engine already has; :class:`StepPlan` holds what the plan builder
derives from them: the WritePlan, per-request verify-entry offsets (all the fused verify needs)
and, when materialised, the per-entry VerifyPlan. Every per-step value lives in the plan's memory,
so a step captured in a CUDA graph replays with new batch contents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import ArrayView
from .errors import ValidationError
from .state import alloc_zeros, checked, same_device

INT32_MAX = 2**31 - 1


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

    def views(self) -> dict[str, ArrayView]:
        v = {
            "req_pool_indices": checked(self.req_pool_indices, "batch.req_pool_indices", dtype=np.int64, ndim=1),
            "prefix_lens": checked(self.prefix_lens, "batch.prefix_lens", dtype=np.int64, ndim=1),
            "extend_lens": checked(self.extend_lens, "batch.extend_lens", dtype=np.int64, ndim=1),
        }
        bs = v["req_pool_indices"].shape[0]
        for name in ("prefix_lens", "extend_lens"):
            if v[name].shape[0] != bs:
                raise ValidationError(f"kv-canary: batch.{name} must have shape ({bs},) like "
                                      f"req_pool_indices, got {v[name].shape}")
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
        same_device(list(v.values()), "a Batch")
        return v


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

    @classmethod
    def allocate(cls, max_batch: int, verify_capacity: int, *, device: int | None = None,
                 materialize: bool = False) -> "StepPlan":
        if max_batch < 1:
            raise ValidationError(f"kv-canary: max_batch must be >= 1, got {max_batch}")
        if not 1 <= verify_capacity <= INT32_MAX:
            raise ValidationError(f"kv-canary: verify_capacity must be in [1, {INT32_MAX}], got {verify_capacity}")
        z = lambda shape, dt: alloc_zeros(shape, dt, device)  # noqa: E731
        p = cls(max_batch, verify_capacity, device,
                offsets=z((max_batch + 1,), np.int64), seed=z((max_batch,), np.int64),
                num_valid_reqs=z((1,), np.int32), entry_offsets=z((max_batch + 1,), np.int64),
                num_valid=z((1,), np.int32), enable=z((1,), np.int32))
        if materialize or device is None:  # the CPU backend always materialises
            p.slot, p.expected_token, p.expected_position, p.prev_slot = (
                z((verify_capacity,), np.int64) for _ in range(4))
        return p

    @property
    def materialized(self) -> bool:
        return self.slot is not None
