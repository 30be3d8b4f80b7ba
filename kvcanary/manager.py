"""KvCanary: the object a serving engine holds (SPEC §6, §8-§10).

Per pool group (FULL and optionally SWA) and per half (K, V) it keeps two canary buffers: HEAD,
stamped before the forward without fingerprints (the new tokens' KV does not exist yet), and
TAIL, stamped after it with real-KV fingerprints. ``before_forward`` verifies the cached prefix
against HEAD and stamps the new tokens; ``after_forward`` does the same against TAIL with real KV
and then polls the asynchronous pump. ``sweep`` scrubs idle cached slots against TAIL. All step
launches are capturable in a CUDA graph (see README: what must stay static).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from operator import is_
from typing import Any, Sequence

import numpy as np

from . import abi, ops, streams
from .errors import KvCanaryError, ValidationError
from .plan import Batch, StepPlan
from .pump import Pump, int32_at, int64_slice
from .reporting import Reporter
from .sources import RealKvSource
from .state import CanaryBuffer, VerifyContext, ViolationSink, alloc_zeros
from .violations import decode_ring

HASH_MODES = {"none": abi.HashMode.NONE, "partial": abi.HashMode.PARTIAL, "all": abi.HashMode.ALL}


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

    def resolved_halves(self) -> tuple[str, ...]:
        if self.halves is not None:
            return tuple(self.halves)
        return ("K",) if self.k_sources and not self.v_sources else ("K", "V")


class KvCanary:
    """Canary state and step launches for one KV pool (see module docstring)."""

    def __init__(self, full: PoolGroup, swa: PoolGroup | None = None, *, device: int | None = None,
                 hash_mode: str = "partial", mode: str = "log", max_batch: int = 256,
                 verify_capacity: int = 1 << 20, ring_capacity: int = abi.DEFAULT_RING_CAPACITY,
                 sweep_capacity: int = 1 << 16, check_expected_token: bool = False,
                 chain_position_assert: bool = False, fused: bool = True, stats_every: int = 0,
                 export=None):
        if hash_mode not in HASH_MODES:
            raise ValidationError(f"kv-canary: hash_mode must be one of {tuple(HASH_MODES)}, got {hash_mode!r}")
        self.reporter = Reporter(mode, export)
        self.mode, self.device, self.fused = mode, device, fused
        self.check_expected_token, self.stats_every = check_expected_token, stats_every
        self.groups = {"FULL": full, **({"SWA": swa} if swa is not None else {})}
        if swa is not None and (swa.full_to_swa is None or swa.window < 0):
            raise ValidationError("kv-canary: the SWA group needs full_to_swa (int64 map) and window >= 0")
        hm = HASH_MODES[hash_mode]
        names = [(st, g, h, op) for g, grp in self.groups.items() for h in grp.resolved_halves()
                 for st, op in (("HEAD", "verify"), ("HEAD", "write"), ("TAIL", "verify"),
                                ("TAIL", "write"), ("SWEEP", "verify"))]
        n_groups = len(self.groups)
        # status block: [0] write_index, then (kernel runs, slot runs) per context, then
        # (num_valid, enable) per group plan and for the sweep plan.
        self.status = alloc_zeros((1 + 2 * len(names) + 2 * (n_groups + 1),), np.int64, device)
        ring = alloc_zeros((ring_capacity, abi.RING_COLS), np.int64, device)
        wi = int32_at(self.status, 0, device)
        flag = alloc_zeros((1,), np.int32, device)
        buffers = {(st, g, h): CanaryBuffer.allocate(self.groups[g].num_slots, device=device)
                   for g, grp in self.groups.items() for h in grp.resolved_halves() for st in ("HEAD", "TAIL")}
        self.ctx: dict[tuple, VerifyContext] = {}
        for i, (st, g, h, op) in enumerate(names):
            sink = ViolationSink(ring, wi, *(int64_slice(self.status, 1 + 2 * i + k, 1, device) for k in (0, 1)))
            grp = self.groups[g]
            head = st == "HEAD"
            sources = () if head else (grp.k_sources if h == "K" else grp.v_sources)
            self.ctx[st, g, h, op] = VerifyContext(
                buffers["HEAD" if head else "TAIL", g, h], sink, abi.LaunchTag[f"{st}_{h}_{g}"],
                sources, abi.HashMode.NONE if head else hm, chain_position_assert=flag)
        self._names, self._ring, self.ring_capacity = names, ring, ring_capacity
        # contexts whose slot runs the stats count: TAIL writes (protected tokens), all verifies
        self._tail_writes = np.array([i for i, nm in enumerate(names) if nm[0] == "TAIL" and nm[3] == "write"], np.intp)
        self._verifies = np.array([i for i, nm in enumerate(names) if nm[3] == "verify"], np.intp)
        if chain_position_assert:
            next(iter(self.ctx.values())).set_chain_position_assert(True)
        base = 1 + 2 * len(names)
        self.plans: dict[str, StepPlan] = {}
        for k, g in enumerate([*self.groups, "SWEEP"]):
            cap = sweep_capacity if g == "SWEEP" else verify_capacity
            p = StepPlan.allocate(max_batch, cap, device=device, materialize=(g == "SWEEP" or not fused))
            p.num_valid = int32_at(self.status, base + 2 * k, device)
            p.enable = int32_at(self.status, base + 2 * k + 1, device)
            self.plans[g] = p
        self.pump = Pump(self.status, ring, ring_capacity, device)
        self._rt = None
        if device is not None:
            from . import driver
            self._rt = driver.runtime(device)
        self.step = 0
        # Launches enqueued per context = _expected (sweeps, replays; replaced, never changed in
        # place, once a snapshot's meta holds it) + stage runs x the stage's mask.
        self._expected = np.zeros(len(names), np.int64)
        self._stage_runs = [0, 0]  # HEAD, TAIL stages enqueued outside a graph capture
        self._masks = [np.array([nm[0] == st for nm in names], np.int64) for st in ("HEAD", "TAIL")]
        self._enable_cells = [(base + 2 * k + 1, g) for k, g in enumerate(self.groups)]
        self._last = None  # (newest snapshot taken, its meta)
        self._hot: dict = {}  # stage -> (the Batch's field objects, bound launches, Launches)
        self._stage_launches = 0
        self._seen_rows = 0
        self._skipped = 0

    # ---- step API --------------------------------------------------------------------------------
    def before_forward(self, batch: Batch, stream=None) -> None:
        """HEAD: verify each request's cached prefix (identity) and stamp the new tokens."""
        self._stage(batch, "HEAD", stream)

    def after_forward(self, batch: Batch, stream=None) -> None:
        """TAIL: verify the prefix with real KV, stamp the new tokens with their fingerprints, then
        poll the pump (skipped while the stream is being captured into a CUDA graph)."""
        s = self._stage(batch, "TAIL", stream)
        if s is not False:  # False: captured
            self._report(s, advance=True)

    def _stage(self, batch: Batch, stage: str, stream):
        """Enqueue one stage; the stream handle (None on the CPU backend, or mode "none"), or
        False while that stream is capturing a graph (the launches are then not counted: they
        run when the graph is replayed, see :meth:`record_replay`)."""
        if self.mode == "none":
            return None
        k = stage == "TAIL"
        if self.device is None:
            self._launches(batch, stage)  # the host ops run here
            self._stage_runs[k] += 1
            return None
        s = stream if type(stream) is int else streams.resolve(stream, (batch.req_pool_indices,), (),
                                                               self.device)
        hot = self._hot.get(stage)
        if hot is None or not all(map(is_, batch.__dict__.values(), hot[0])):  # other arrays: repack
            hot = self._launches(batch, stage)
        for go in hot[1]:
            go(s)
        self._stage_launches += len(hot[1])
        if self._rt.capturing(s):
            return False
        self._stage_runs[k] += 1
        return s

    def _launches(self, batch: Batch, stage: str):
        """Pack the launches of one stage for this batch's arrays and keep them (hot path of
        :meth:`_stage`: replayed while every field of the Batch is the same object). On the
        CPU backend the ops run here and nothing is kept or returned."""
        out = []
        for g, grp in self.groups.items():
            plan = self.plans[g]
            swa = dict(swa_window=grp.window, swa_map=grp.full_to_swa) if g == "SWA" else {}
            if stage == "HEAD":  # plan-builder launches have no counters of their own
                out += ops.prepare_build_plan(batch, plan, **swa)
            loc = batch.swa_out_cache_loc if g == "SWA" else batch.out_cache_loc
            if loc is None:
                raise ValidationError(f"kv-canary: batch.{'swa_' if g == 'SWA' else ''}out_cache_loc is "
                                      f"required to stamp the {g} group")
            for h in grp.resolved_halves():
                vctx, wctx = self.ctx[stage, g, h, "verify"], self.ctx[stage, g, h, "write"]
                verify = ops.prepare_fused_verify if self.fused else (lambda c, b, p, **kw: ops.prepare_verify(
                    c, p, check_expected_token=kw["check_expected_token"]))
                out.append(verify(vctx, batch, plan, check_expected_token=self.check_expected_token, **swa))
                out.append(ops.prepare_write(
                    wctx, plan, batch.input_ids, batch.positions, loc,
                    expected_input_ids=batch.expected_input_ids, expected_positions=batch.expected_positions))
        if self.device is None:  # host ops already ran; nothing to replay
            return None
        hot = self._hot[stage] = (tuple(batch.__dict__.values()), tuple(lc.go for lc in out), out)
        return hot

    def launches_per_step(self) -> int:
        """cuLaunchKernel calls of one eager ``before_forward`` + ``after_forward`` of the batch
        last packed: both stages' launches plus the pump's snapshot (0 on the CPU backend)."""
        if self.device is None or self.mode == "none":
            return 0
        return sum(len(self._hot[st][1]) for st in ("HEAD", "TAIL") if st in self._hot) + 1

    @property
    def launch_count(self) -> int:
        """cuLaunchKernel calls made so far by the step API and the pump (captures included)."""
        return self._stage_launches + self.pump.launches

    def sweep(self, slots, positions, prev_slots, *, group: str = "FULL", stream=None) -> None:
        """Verify idle cached slots against the TAIL buffers with real KV (tags SWEEP_*).
        ``prev_slots[i]`` is slot i's predecessor (-1 for a chain head); host sequences."""
        slots, positions, prev = (np.ascontiguousarray(a, np.int64) for a in (slots, positions, prev_slots))
        n, plan = len(slots), self.plans["SWEEP"]
        if not (len(positions) == len(prev) == n) or n > plan.verify_capacity:
            raise ValidationError(f"kv-canary: sweep needs slots, positions, prev_slots of one length "
                                  f"<= sweep_capacity ({plan.verify_capacity}), got {len(slots)}, "
                                  f"{len(positions)}, {len(prev)}")
        host = {"slot": slots, "expected_position": positions, "prev_slot": prev,
                "expected_token": np.full(n, -1, np.int64)}
        if self.device is None:
            for k, a in host.items():
                getattr(plan, k)[:n] = a
            plan.num_valid[0], plan.enable[0] = n, 1
        else:
            s = streams.resolve(stream, (), (), self.device)
            self._stage_sweep(host, n, s)
        halves = self.groups[group].resolved_halves()
        for h in halves:
            ops.verify(self.ctx["SWEEP", group, h, "verify"], plan, stream=None if self.device is None else s)
        self._count([self._names.index(("SWEEP", group, h, "verify")) for h in halves])
        if self.device is None:
            self._report(None, advance=False)  # a sweep is not a step

    def sweep_chains(self, chains, *, group: str = "FULL", stream=None) -> None:
        """:meth:`sweep` over node chains: each chain lists the slots of positions 0, 1, ... of one
        cached sequence (e.g. a radix-tree path from the root)."""
        slots, positions, prev = [], [], []
        for chain in chains:
            chain = [int(x) for x in chain]
            slots += chain
            positions += range(len(chain))
            prev += [-1] + chain[:-1]
        self.sweep(slots, positions, prev, group=group, stream=stream)

    def _stage_sweep(self, host: dict, n: int, s: int) -> None:
        from . import memory
        plan = self.plans["SWEEP"]
        if not hasattr(self, "_sweep_staging"):
            self._sweep_staging = memory.PinnedBuffer((5, plan.verify_capacity), np.int64, self.device)
            self._sweep_done = memory.Event(self.device)
            self._sweep_done.record(s)
        self._sweep_done.synchronize()  # the previous sweep's upload has left the staging buffer
        st = self._sweep_staging.array
        for row, k in enumerate(("slot", "expected_position", "prev_slot", "expected_token")):
            st[row, :n] = host[k]
            memory.copy_async(getattr(plan, k).ptr, self._sweep_staging.ptr + row * 8 * plan.verify_capacity,
                              8 * n, s, self.device)
        st[4, 0], st[4, 1] = n, 1  # little-endian: the low int32 of each cell is the value
        cells = self._sweep_staging.ptr + 4 * plan.verify_capacity * 8
        memory.copy_async(plan.num_valid.ptr, cells, 4, s, self.device)
        memory.copy_async(plan.enable.ptr, cells + 8, 4, s, self.device)
        self._sweep_done.record(s)

    # ---- pump ------------------------------------------------------------------------------------
    def poll(self, stream=None) -> None:
        """Report what the newest completed snapshots show, then snapshot again (on ``stream``;
        skipped while it is capturing a graph). Never waits on the device, except to read back
        ring rows after violations were seen."""
        s = None if stream is None else streams.stream_handle(stream)
        if s is not None and self.device is not None and self._rt.capturing(s):
            return  # a snapshot launch in a capture would run only on replay
        self._report(s, advance=True)

    def _report(self, stream, advance: bool) -> None:
        meta = (self.step, self._stage_runs[0], self._stage_runs[1], self._expected)
        taken = self.pump.take(meta)
        if stream is not None and self.device is not None:
            self.pump.snapshot(stream, meta)  # ring reads below use a stream of their own
        if advance:
            self.step += 1
        for snap, meta in taken:  # may raise in mode "raise", after the step advanced
            self._process(snap, meta)

    def flush(self) -> None:
        """Wait for every snapshot and report it (shutdown and tests; this one does synchronise)."""
        for snap, meta in self.pump.drain((self.step, *self._stage_runs, self._expected)):
            self._process(snap, meta)

    def _count(self, indices) -> None:
        """One more launch enqueued for each context index (a new array: metas keep the old)."""
        expected = self._expected.copy()
        expected[indices] += 1
        self._expected = expected

    def _expected_at(self, meta) -> np.ndarray:
        _, head, tail, base = meta
        return base + head * self._masks[0] + tail * self._masks[1]

    def _process(self, snap: list, meta) -> None:
        """Report one snapshot (the status block as ints) taken with ``meta``."""
        step, head, tail, base = meta
        self._last = (snap, meta)
        wi = snap[0] & 0xFFFFFFFF  # the low int32 of cell 0 (little-endian)
        if wi >= 0x80000000:
            wi -= 1 << 32
        for cell, g in self._enable_cells:
            if not snap[cell] & 0xFFFFFFFF and (head or tail or base.any()):
                self._skipped += 1
                warnings.warn(f"kv-canary: step {step}: the {g} verify was skipped because the batch has "
                              f"more cached entries than verify_capacity ({self.plans[g].verify_capacity}); "
                              f"fix: raise verify_capacity", RuntimeWarning, stacklevel=3)
        stop = min(max(wi, 0), self.ring_capacity)
        if stop > self._seen_rows or wi > self.ring_capacity:
            rows = self.pump.read_ring(self._seen_rows, stop)
            readout = decode_ring(rows, stop - self._seen_rows)
            self._seen_rows = stop
            self.reporter.violations(readout.violations, step, max(0, wi - self.ring_capacity))
        if self.stats_every or self.reporter.wants_stats:
            emit = bool(self.stats_every) and step % self.stats_every == 0
            self.reporter.stats(self.stats(self._runs(snap), wi, step), emit)

    def _runs(self, snap) -> np.ndarray:
        """(kernel runs, slot runs) per context of a snapshot, int64 [contexts, 2]."""
        n = len(self._names)
        return np.array(snap[1:1 + 2 * n], np.int64).reshape(n, 2)

    def stats(self, runs=None, wi=None, step=None) -> dict:
        if runs is None:
            runs = self._runs(self._last[0]) if self._last else np.zeros((len(self._names), 2), np.int64)
        return {"step": self.step if step is None else step,
                "protected_tokens": int(runs[self._tail_writes, 1].sum()),
                "verified_slots": int(runs[self._verifies, 1].sum()),
                "violations": self.reporter.reported if wi is None else int(wi),
                "skipped_verifies": self._skipped}

    def add_listener(self, callback) -> None:
        """Call ``callback(record)`` with every record the export target gets: one dict per
        violation (``type="violation"``, the fields of SPEC §10 plus ``step``) and one per
        reported step (``type="stats"``, the keys of :meth:`stats`). Metrics exporters and the
        tensor-parallel aggregator subscribe here; no listener costs nothing."""
        self.reporter.listeners.append(callback)

    def health_check(self) -> None:
        """Raise if a launch that should have run has not advanced its kernel_run_counter (as of
        the newest completed snapshot)."""
        if self._last is None:
            return
        runs, expected = self._runs(self._last[0]), self._expected_at(self._last[1])
        lagging = [f"{st}_{h}_{g} {op}: ran {runs[i, 0]} of {expected[i]}"
                   for i, (st, g, h, op) in enumerate(self._names) if runs[i, 0] < expected[i]]
        if lagging:
            raise KvCanaryError("kv-canary: health check failed, expected every enqueued canary launch "
                                "to have run, got: " + "; ".join(lagging) + ". Fix: make sure the canary "
                                "launches are on the stream (or in the CUDA graph) that is replayed")

    def buffers(self) -> dict[tuple[str, str, str], np.ndarray]:
        """Host copies of the canary buffers by (HEAD/TAIL, group, half). Synchronises (debugging
        and tests, not the serving loop)."""
        out = {}
        for (st, g, h, op), ctx in self.ctx.items():
            if op == "write":
                arr = ctx.buffer.array
                out[st, g, h] = np.array(arr) if isinstance(arr, np.ndarray) else arr.numpy()
        return out

    def record_replay(self, stages=("HEAD", "TAIL")) -> None:
        """Tell the health check that a captured graph holding these stages was replayed (a
        capture itself counts nothing)."""
        self._count([i for i, nm in enumerate(self._names) if nm[0] in stages])
