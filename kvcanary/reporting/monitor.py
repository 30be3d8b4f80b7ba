"""A canary's reporting half (docs/format.md §10): what the pump's status snapshots show becomes
violation reports (ring rows read back only when there are new ones), step stats and the health
check. Never waits on the device except to read back ring rows, and in :meth:`Monitor.flush`.

Launches enqueued per verify context = ``expected`` (sweeps, replays) + stage runs x stage mask;
each snapshot carries that account as it stood (its meta), so the health check compares like
with like.
"""

from __future__ import annotations

import warnings

import numpy as np

from .. import abi
from ..errors import KvCanaryError
from ..manager.assembly import STAGES, Key
from ..runtime.driver import PER_THREAD_STREAM
from .outputs import RingLedger
from .verdicts import FailedRequest, failed_requests
from .violations import decode_ring


class Monitor:
    """Snapshots of one canary built from ``parts`` (an :class:`~kvcanary.manager.assembly.Parts`) taken by
    ``pump``, reported every ``stats_every`` steps (0: only to listeners and the export target).
    ``step`` counts the steps reported."""

    def __init__(self, parts, pump, ring_capacity: int, stats_every: int):
        self.keys, self.layout, self.groups, self.plans = parts.keys, parts.layout, parts.groups, parts.plans
        self.backend, self.status, self.ring = parts.backend, parts.status, parts.ring
        self.reporter, self.self_test, self.pump, self.stats_every = parts.reporter, parts.self_test, pump, stats_every
        self.ledger = RingLedger(ring_capacity)
        self.step = 0
        self.expected = np.zeros(len(self.keys), np.int64)
        self._replays: dict = {}  # stages -> the increments of one replay (replayed)
        self.stage_runs = [0, 0]
        self.closed = True  # the newest stage enqueued was a TAIL (no step is open between HEAD and TAIL)
        self.masks = [np.array([k.stage == st for k in self.keys], np.int64) for st in STAGES]
        self.last = None  # (newest snapshot processed, its meta)
        self.skipped = 0
        self.skip_seen: dict = {}  # group -> the HEAD run whose skipped verify was counted (one per plan)
        self.plan_mismatches = 0   # ENTRY_COUNT rows: a launch's batch disagreed with the plan built at HEAD
        full = parts.groups["FULL"].resolved_halves()[0]
        self.tokens_ctx = self.keys.index(Key("TAIL", "FULL", full, "write"))
        self.verifies = np.array([i for i, k in enumerate(self.keys) if k.op == "verify"], np.intp)
        # request verdicts (docs/format.md §5.7): a step's words are whole in a snapshot that closes the
        # step (after its TAIL), and are reported once per HEAD run (the device's step count, this cell)
        self.ring_requests = parts.ring_requests
        self.head_runs = self.layout.runs(self.keys.index(Key("HEAD", "FULL", full, "verify")))
        self.verdict_run = 0          # the HEAD run whose verdicts were reported last
        self.failed: list[FailedRequest] = []  # reported, not yet taken (KvCanary.failed_requests)
        self.ended = None  # how the step's last launch took its snapshot (:meth:`claim`)

    def meta(self, tail: int = 0):
        """What a snapshot taken now carries (``tail``: TAIL runs enqueued with it, not yet counted),
        the last item whether it closes a step (taken after a TAIL, not between a HEAD and its TAIL)."""
        return (self.step, self.stage_runs[0], self.stage_runs[1] + tail, self.expected, self.ledger.floor,
                bool(tail) or self.closed)

    def ran(self, k: int) -> None:
        """Stage ``STAGES[k]`` was enqueued (or run on the host): counted, and whether a step is open."""
        self.stage_runs[k] += 1
        self.closed = k == 1

    # the snapshot a step's last launch takes (backends' run_stage ``end``): "folded" once claimed,
    # "skipped" when every FIFO slot was in flight, None when the stage took none (report launches one)
    def claim(self):
        got = self.pump.claim_end(self.meta(tail=1))
        self.ended = "skipped" if got is None else "folded"
        return got

    def unclaim(self, slot: int) -> None:
        self.pump.unclaim(slot)
        self.ended = None

    def count(self, indices) -> None:
        """One more launch enqueued for each context index (a new array: metas keep the old)."""
        expected = self.expected.copy()
        expected[indices] += 1
        self.expected = expected

    def replayed(self, stages: tuple) -> None:
        """One more run of every launch of ``stages`` (a replayed graph that captured them): one
        array addition, its increments kept per stages (a new array: metas keep the old)."""
        inc = self._replays.get(stages)
        if inc is None:
            inc = np.zeros_like(self.expected)
            inc[[i for i, k in enumerate(self.keys) if k.stage in stages]] = 1
            self._replays[stages] = inc
        self.expected = self.expected + inc
        self.closed = "TAIL" in stages

    def report(self, stream, advance: bool) -> None:
        """Report the snapshots completed so far, then snapshot again on ``stream`` (None: no new
        snapshot) unless the step's last launch took it (:meth:`claim`); ``advance``: this ends a step."""
        meta, ended, self.ended = self.meta(), self.ended, None
        taken = self.pump.take(meta)
        if ended is not None:
            enqueued = ended == "folded"
        else:
            enqueued = stream is not None and self.pump.snapshot(stream, meta)  # ring reads use a side stream
        if advance:
            self.step += 1
        try:
            for snap, m in taken:  # may raise in mode "raise", after the step advanced
                self.process(snap, m, stacklevel=4)
        finally:
            self.consume(stream)
            if enqueued or self.backend.synchronous:
                self.ledger.floor = self.ledger.consumed

    def consume(self, stream) -> None:
        """Rows taken: let the kernels reuse their ring slots (in stream order after this point)."""
        if self.ledger.total > self.ledger.consumed:
            self.ledger.consumed = self.ledger.total
            self.backend.set_consumed(self.status, self.ledger.total, stream)

    def flush(self) -> None:
        """Wait for the device and report every snapshot up to now (see ``KvCanary.flush``)."""
        taken = []
        if not self.backend.synchronous:
            # one more snapshot behind everything enqueued so far, in a slot freed first (a full
            # FIFO would skip it), labelled with the last step it covers
            taken = self.pump.drain(self.meta())
            self.pump.snapshot(PER_THREAD_STREAM, (self.step - 1, *self.meta()[1:]))
        try:
            for snap, meta in taken + self.pump.drain(self.meta()):
                self.process(snap, meta, stacklevel=4)
        finally:
            self.consume(None)
            self.ledger.floor = self.ledger.consumed  # the device is idle: no launch saw an older mark

    def process(self, snap: list, meta, stacklevel: int) -> None:
        """Report one snapshot (the status block as ints) taken with ``meta``; a skipped verify
        warns from ``stacklevel`` frames up (the caller of the public method that reported it).
        A plan is built by a HEAD run and read by every later snapshot until the next one, so a
        skipped verify is counted (and warned about) once per HEAD run, for the step that ran it."""
        step, head, tail, base, floor, closed = meta
        self.last = (snap, meta)
        for k, g in enumerate(self.groups):
            if not snap[self.layout.plan(k) + 1] & abi.INT32_MASK and (head or tail or base.any()):
                if self.skip_seen.get(g) == head:
                    continue
                self.skip_seen[g] = head
                self.skipped += 1
                warnings.warn(f"kv-canary: step {step}: the {g} verify was skipped because the batch has "
                              f"more cached entries than verify_capacity ({self.plans[g].verify_capacity}); fix: "
                              f"raise verify_capacity", RuntimeWarning, stacklevel=stacklevel)
        start, stop, lost = self.ledger.window(snap[abi.STATUS_CLAIM], floor)
        due = closed and self.verdicts_due(snap)
        rows = requests = None
        if stop > start or lost:
            rows, requests = self.backend.read_rows(self.ring, start, stop, self.ring_requests if due else None)
        if due:
            self.verdicts(snap, step, rows, requests)
        if rows is not None:
            found = self.self_test.sift(decode_ring(rows, len(rows)).violations)
            self.plan_mismatches += sum(v.batch_field == "ENTRY_COUNT" for v in found)
            self.reporter.violations(found, step, lost, self.ledger.lost)
        if self.stats_every or self.reporter.wants_stats:
            emit = bool(self.stats_every) and step % self.stats_every == 0
            self.reporter.stats(self.stats_of(snap, step), emit)

    def verdicts_due(self, snap: list) -> bool:
        """Whether a snapshot that closes a step (its meta says so: one taken between a HEAD and its
        TAIL waits for the TAIL's) has failed requests not reported yet (docs/format.md §5.7): it
        carries the verdict words only when its step failed a request; each HEAD run (the device's
        step count) is reported once. Whether the step is closed comes from the host, which knows
        the order it enqueued the stages in: the device's HEAD and TAIL run counts differ for good
        after a step whose TAIL never came (its forward raised), and agree between a HEAD and its
        TAIL after a TAIL without its HEAD."""
        lay = self.layout
        if len(snap) <= lay.failed + 1 or not snap[lay.failed]:
            return False
        return snap[self.head_runs] != self.verdict_run

    def verdicts(self, snap: list, step: int, rows, requests) -> None:
        """Report the failed requests of a :meth:`verdicts_due` snapshot (with the step's ring rows and
        their requests, None when it has none) and keep them for :meth:`take_failed`."""
        lay = self.layout
        self.verdict_run = snap[self.head_runs]
        if rows is None:
            rows, requests = np.zeros((0, abi.RING_COLS), np.int64), np.zeros(0, np.int64)
        found = failed_requests(step, snap[lay.failed + 1:lay.failed + 1 + lay.requests], rows, requests)
        self.failed += found
        self.reporter.failed_requests(found)

    def take_failed(self) -> list[FailedRequest]:
        out, self.failed = self.failed, []
        return out

    def runs(self, snap) -> np.ndarray:
        """(kernel runs, slot runs) per context of a snapshot, int64 [contexts, 2]."""
        return np.array(snap[self.layout.runs(0):self.layout.runs(len(self.keys))], np.int64).reshape(-1, 2)

    def stats_of(self, snap, step) -> dict:
        runs = self.runs(snap)
        return {"step": step, "protected_tokens": int(runs[self.tokens_ctx, 1]),
                "verified_slots": int(runs[self.verifies, 1].sum()),
                "violations": int(snap[abi.STATUS_CLAIM]) - self.self_test.due(runs), "self_tests": self.self_test.seen,
                "violations_recorded": self.ledger.recorded, "ring_overflow": self.ledger.lost,
                "skipped_verifies": self.skipped, "unattributed": int(snap[abi.STATUS_SKIPS]),
                "export_errors": self.reporter.export.errors, "steps_behind": self.pump.in_flight,
                "snapshots_skipped": self.pump.skipped}

    def stats(self) -> dict:
        snap = self.last[0] if self.last else [0] * self.layout.size
        return self.stats_of(snap, self.step)

    def health_check(self) -> None:
        """Raise as ``KvCanary.health_check`` says (nothing before the first snapshot)."""
        if self.last is None:
            return
        snap, meta = self.last
        runs, expected = self.runs(snap), meta[3] + meta[1] * self.masks[0] + meta[2] * self.masks[1]
        bad = [f"{k.stage}_{k.half}_{k.group} {k.op}: ran {runs[i, 0]} of {expected[i]}"
               for i, k in enumerate(self.keys) if runs[i, 0] < expected[i]]
        if snap[abi.STATUS_SKIPS] or self.plan_mismatches:
            bad.append(f"a launch's batch disagreed with the plan built at HEAD: {self.plan_mismatches} "
                       f"BATCH_INDEX_OUT_OF_RANGE rows with batch_field=ENTRY_COUNT (one per request and launch) "
                       f"and {snap[abi.STATUS_SKIPS]} verify entries skipped without a row")
        elif self.ledger.lost:  # a batch with more cached entries than its plan skips none: its rows say it
            bad.append(f"{self.ledger.lost} violation rows were lost to a full ring, so a launch whose batch "
                       f"disagreed with its plan (ENTRY_COUNT rows) cannot be ruled out (raise ring_capacity)")
        bad += self.self_test.problems(runs, self.ledger.lost)
        if bad:
            raise KvCanaryError("kv-canary: health check failed, expected every enqueued canary launch to have "
                                "run on the batch its plan was built from (and every due self-test row to "
                                "arrive), got: " + "; ".join(bad) + ". Fix: keep the canary launches on the "
                                "stream (or in the CUDA graph) that is replayed, and pass the same batch to "
                                "before_forward and after_forward")
