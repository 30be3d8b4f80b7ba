"""What a :class:`~kvcanary.manager.canary.KvCanary` is made of, built once from its pool groups and its
:class:`~kvcanary.config.CanaryConfig`: the pool groups, one verify context per :class:`Key` over the HEAD and
TAIL canary buffers of each group and half, the status block and the violation ring they count
into, and one step plan per group plus the sweep's (docs/format.md §6, §8; the status layout is
``abi.StatusLayout``). Nothing here launches anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from .. import abi
from ..config import CanaryConfig
from ..errors import ValidationError, ValidationTypeError
from ..ops import backends
from ..ops.batch import StepPlan
from ..ops.checks import checked
from ..ops.sources import RealKvSource, source_list
from ..ops.state import CanaryBuffer, VerifyContext, ViolationSink
from ..reporting.outputs import Reporter
from ..reporting.selftest import SelfTest
from ..validate import fail, instance, integer

STAGES = ("HEAD", "TAIL")


@dataclass
class PoolGroup:
    """One KV pool group. ``halves`` defaults to K and V ("K" only when only K sources are given).
    SWA groups also give ``window`` (tokens) and ``full_to_swa`` (int64 map of full-pool slots)."""

    num_slots: int
    k_sources: Sequence[RealKvSource] = ()
    v_sources: Sequence[RealKvSource] = ()
    halves: tuple[str, ...] | None = None
    window: int = 0
    full_to_swa: Any = None

    def __post_init__(self):
        integer("PoolGroup.num_slots", self.num_slots, lo=1, hi=1 << 40, fix="pass the pool's slot count")
        integer("PoolGroup.window", self.window, lo=0, hi=(1 << 31) - 1, fix="pass 0 or the window in tokens")
        self.k_sources = source_list(self.k_sources, "PoolGroup.k_sources")
        self.v_sources = source_list(self.v_sources, "PoolGroup.v_sources")
        h = self.halves
        if h is not None and (not isinstance(h, (str, tuple, list)) or not all(isinstance(x, str) for x in h)):
            fail("PoolGroup.halves", "None, 'K', 'V' or a tuple of them", h, "pass halves=('K', 'V') or ('K',)",
                 kind=ValidationTypeError)
        halves = self.resolved_halves()
        if not halves or len(set(halves)) != len(halves) or not set(halves) <= {"K", "V"}:
            raise ValidationError(f"kv-canary: PoolGroup.halves must be ('K',), ('V',) or ('K', 'V'), got "
                                  f"{self.halves!r}. Fix: name each half of the pool once")
        for half, given in (("K", self.k_sources), ("V", self.v_sources)):
            if given and half not in halves:
                raise ValidationError(f"kv-canary: PoolGroup.{half.lower()}_sources must be empty when halves "
                                      f"{halves} has no {half}, got {len(given)} source(s). Fix: add {half!r} to "
                                      f"halves, or drop the sources")

    def resolved_halves(self) -> tuple[str, ...]:
        if self.halves is not None:
            return tuple(self.halves) if isinstance(self.halves, (tuple, list)) else (self.halves,)
        return ("K",) if self.k_sources and not self.v_sources else ("K", "V")


class Key(NamedTuple):
    """A verify context of the canary: stage (HEAD/TAIL/SWEEP), group (FULL/SWA), half, op."""

    stage: str
    group: str
    half: str
    op: str


class Parts(NamedTuple):
    """A canary's checked settings and its state, as :func:`build` made them."""

    config: CanaryConfig             # the settings, checked
    reporter: Reporter
    groups: dict[str, PoolGroup]     # "FULL", and "SWA" when given
    backend: Any                     # backends.HostBackend or CudaBackend
    keys: list[Key]                  # the contexts in status order
    layout: abi.StatusLayout
    status: Any                      # int64 [layout.size]
    ring: Any                        # int64 [ring_capacity, RING_COLS]
    self_test: SelfTest
    ctx: dict[Key, VerifyContext]
    plans: dict[str, StepPlan]       # per group, and "SWEEP"
    head_ctx: dict[str, VerifyContext]  # each group's first context: reports of its plan and records
    ring_requests: Any               # int64 [ring_capacity]: the request of each stored ring row (§5.7)


def build(full: PoolGroup, swa: PoolGroup | None, config: CanaryConfig) -> Parts:
    """Check the pool groups of ``KvCanary(full, swa)`` (each error names the argument) and allocate
    the canary's state as ``config`` says (``config.device`` None: host memory, the CPU reference
    runs the launches)."""
    for name, g in (("full", full), ("swa", swa)):
        if g is not None or name == "full":
            instance(f"KvCanary {name}", g, PoolGroup, "a kvcanary.PoolGroup",
                     "PoolGroup(num_slots, k_sources=..., v_sources=...)")
    if full.window:
        raise ValidationError(f"kv-canary: the full-attention group's window must be 0, got {full.window}. "
                              f"Fix: give window= (and full_to_swa=) to the SWA group, the second argument")
    if swa is not None and swa.full_to_swa is None:
        raise ValidationError("kv-canary: the SWA group needs full_to_swa (an int64 map of full-pool "
                              "slots to SWA slots), got None. Fix: PoolGroup(..., window=W, full_to_swa=map)")
    if swa is not None:
        checked(swa.full_to_swa, "swa.full_to_swa", dtype=np.int64, ndim=1)
    c = config
    device, max_batch, ring_capacity, mode_hash = c.device, c.max_batch, c.ring_capacity, c.hash_mode
    self_test_every, fingerprint_every = c.self_test_every, c.fingerprint_every
    reporter = Reporter(c.mode, c.export)
    groups = {"FULL": full, **({"SWA": swa} if swa is not None else {})}
    be = backends.for_device(device)
    keys = [Key(st, g, h, op) for g, grp in groups.items() for h in grp.resolved_halves()
            for st, op in (("HEAD", "verify"), ("HEAD", "write"), ("TAIL", "verify"),
                           ("TAIL", "write"), ("SWEEP", "verify"))]
    lay = abi.StatusLayout(len(keys), len(groups) + 1, max_batch)
    status = be.zeros((lay.size,), np.int64)
    ring = be.zeros((ring_capacity, abi.RING_COLS), np.int64)
    ring_requests = be.zeros((ring_capacity,), np.int64)
    flag = be.zeros((1,), np.int32)
    # the self-test (docs/format.md §11) rides on the first HEAD verify of the FULL group
    tested = Key("HEAD", "FULL", full.resolved_halves()[0], "verify")
    self_test = SelfTest(self_test_every, keys.index(tested), abi.LaunchTag[f"HEAD_{tested.half}_FULL"],
                         full.num_slots)
    buffers = {(st, g, h): CanaryBuffer.allocate(grp.num_slots, device=device)
               for g, grp in groups.items() for h in grp.resolved_halves() for st in STAGES}
    ctx: dict[Key, VerifyContext] = {}
    # the fingerprint budget's phase (docs/format.md §6.1): the run count of the HEAD verify of
    # the same group and half, which this step's HEAD stage advanced before TAIL reads it
    phase = {(k.group, k.half): be.cells(status, lay.runs(i)) for i, k in enumerate(keys)
             if k.stage == "HEAD" and k.op == "verify"}
    for i, key in enumerate(keys):
        sink = ViolationSink(ring, be.cells(status, abi.STATUS_CLAIM, dtype=np.int32),
                             be.cells(status, lay.runs(i)), be.cells(status, lay.runs(i) + 1),
                             claim=be.cells(status, abi.STATUS_CLAIM),
                             consumed=be.cells(status, abi.STATUS_CONSUMED),
                             skips=be.cells(status, abi.STATUS_SKIPS),
                             verdicts=be.cells(status, lay.failed + 1, max_batch),
                             failed_requests=be.cells(status, lay.failed), ring_requests=ring_requests)
        grp, head = groups[key.group], key.stage == "HEAD"
        sources = () if head else (grp.k_sources if key.half == "K" else grp.v_sources)
        ctx[key] = VerifyContext(buffers["HEAD" if head else "TAIL", key.group, key.half], sink,
                                 abi.LaunchTag[f"{key.stage}_{key.half}_{key.group}"], sources,
                                 abi.HashMode.NONE if head else mode_hash, chain_position_assert=flag,
                                 self_test_every=self_test_every if key == tested else 0,
                                 **(dict(fingerprint_every=fingerprint_every,
                                         fingerprint_phase=phase[key.group, key.half])
                                    if key.stage == "TAIL" and key.op == "verify" else {}))
    if c.chain_position_assert:
        next(iter(ctx.values())).set_chain_position_assert(True)
    plans: dict[str, StepPlan] = {}
    for k, g in enumerate([*groups, "SWEEP"]):
        cap = c.sweep_capacity if g == "SWEEP" else c.verify_capacity
        p = StepPlan.allocate(max_batch, cap, device=device, materialize=(g == "SWEEP" or not c.fused))
        p.num_valid, p.enable = (be.cells(status, lay.plan(k) + j, dtype=np.int32) for j in (0, 1))
        plans[g] = p
    first = {g: next(i for i, k in enumerate(keys) if k.group == g) for g in groups}
    head_ctx = {g: ctx[keys[i]] for g, i in first.items()}
    return Parts(config, reporter, groups, be, keys, lay, status, ring, self_test, ctx, plans, head_ctx, ring_requests)
