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
        self.step = 0
        self._expected = np.zeros(len(names), np.int64)   # launches enqueued per context
        self._last = None  # (snapshot, expected counts at its time)
        self._cache: dict = {}
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
        self.poll(s)

    def _stage(self, batch: Batch, stage: str, stream):
        if self.mode == "none":
            return None
        s = None if self.device is None else streams.resolve(stream, (batch.req_pool_indices,), (), self.device)
        launches, counted = self._launches(batch, stage)
        for launch in launches:
            launch(s)
        self._expected[counted] += 1  # plan-builder launches have no counters of their own
        return s

    def _launches(self, batch: Batch, stage: str) -> tuple[list, np.ndarray]:
        """(Launches, indices of the contexts they count for) of one stage; packed once per set of
        batch arrays on the GPU (on the CPU the ops run here and no launch is returned)."""
        key = (stage, id(batch), *(id(getattr(batch, f)) for f in batch.__dataclass_fields__))
        hit = self._cache.get(key)
        if hit is not None:
            return hit[0]
        out = []
        for g, grp in self.groups.items():
            plan = self.plans[g]
            swa = dict(swa_window=grp.window, swa_map=grp.full_to_swa) if g == "SWA" else {}
            if stage == "HEAD":
                out += [(None, l) for l in ops.prepare_build_plan(batch, plan, **swa)]
            loc = batch.swa_out_cache_loc if g == "SWA" else batch.out_cache_loc
            if loc is None:
                raise ValidationError(f"kv-canary: batch.{'swa_' if g == 'SWA' else ''}out_cache_loc is "
                                      f"required to stamp the {g} group")
            for h in grp.resolved_halves():
                vctx, wctx = self.ctx[stage, g, h, "verify"], self.ctx[stage, g, h, "write"]
                verify = ops.prepare_fused_verify if self.fused else (lambda c, b, p, **kw: ops.prepare_verify(
                    c, p, check_expected_token=kw["check_expected_token"]))
                out.append((self._names.index((stage, g, h, "verify")),
                             verify(vctx, batch, plan, check_expected_token=self.check_expected_token, **swa)))
                out.append((self._names.index((stage, g, h, "write")), ops.prepare_write(
                    wctx, plan, batch.input_ids, batch.positions, loc,
                    expected_input_ids=batch.expected_input_ids, expected_positions=batch.expected_positions)))
        counted = np.array([i for i, _ in out if i is not None], np.int64)
        if self.device is None:  # host ops already ran; nothing to replay
            return [], counted
        packed = ([launch for _, launch in out], counted)
        self._cache = {k: v for k, v in self._cache.items() if k[0] != stage}  # one batch per stage
        self._cache[key] = (packed, [getattr(batch, f) for f in batch.__dataclass_fields__], batch)
        return packed

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
        for h in self.groups[group].resolved_halves():
            i = self._names.index(("SWEEP", group, h, "verify"))
            ops.verify(self.ctx["SWEEP", group, h, "verify"], plan, stream=None if self.device is None else s)
            self._expected[i] += 1
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
        """Report what the newest completed snapshot shows, then snapshot again. Never waits on
        the device, except to read back ring rows after violations were seen."""
        self._report(stream, advance=True)

    def _report(self, stream, advance: bool) -> None:
        if self.device is not None and stream is not None:
            from . import memory
            if memory.is_capturing(stream, self.device):  # no event queries or copies in a capture
                return
        meta = (self.step, self._expected.copy())
        taken = self.pump.take(meta)
        if self.device is not None and stream is not None:
            self.pump.snapshot(stream, meta)  # ring reads below use a stream of their own
        if advance:
            self.step += 1
        for snap, (step, expected) in taken:  # may raise in mode "raise", after the step advanced
            self._process(snap, expected, step)

    def flush(self) -> None:
        """Wait for every snapshot and report it (shutdown and tests; this one does synchronise)."""
        for snap, (step, expected) in self.pump.drain((self.step, self._expected.copy())):
            self._process(snap, expected, step)

    def _process(self, snap: np.ndarray, expected: np.ndarray, step: int) -> None:
        wi = int(np.array([snap[0]], np.int64).view(np.int32)[0])
        n = len(self._names)
        runs = snap[1:1 + 2 * n].reshape(n, 2)
        self._last = (runs.copy(), expected)
        base = 1 + 2 * n
        for k, g in enumerate(self.groups):
            if int(np.array([snap[base + 2 * k + 1]], np.int64).view(np.int32)[0]) == 0 and self._expected.any():
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
        if self.stats_every or self.reporter.export._file or self.reporter.export._callback:
            emit = bool(self.stats_every) and step % self.stats_every == 0
            self.reporter.stats(self.stats(runs, wi, step), emit)

    def stats(self, runs=None, wi=None, step=None) -> dict:
        if runs is None:
            runs = self._last[0] if self._last else np.zeros((len(self._names), 2), np.int64)
        idx = lambda st, op: [i for i, nm in enumerate(self._names) if nm[0] == st and nm[3] == op]  # noqa: E731
        return {"step": self.step if step is None else step,
                "protected_tokens": int(runs[idx("TAIL", "write"), 1].sum()),
                "verified_slots": int(sum(runs[idx(st, "verify"), 1].sum() for st in ("HEAD", "TAIL", "SWEEP"))),
                "violations": self.reporter.reported if wi is None else int(wi),
                "skipped_verifies": self._skipped}

    def health_check(self) -> None:
        """Raise if a launch that should have run has not advanced its kernel_run_counter (as of
        the newest completed snapshot)."""
        if self._last is None:
            return
        runs, expected = self._last
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
        """Tell the health check that a captured graph holding these stages was replayed."""
        for i, nm in enumerate(self._names):
            if nm[0] in stages:
                self._expected[i] += 1
