"""KvCanary: the object a serving engine holds (docs/format.md §6, §8-§10).

Per pool group (FULL and optionally SWA) and per half (K, V) it keeps two canary buffers: HEAD,
stamped before the forward without fingerprints (the new tokens' KV does not exist yet), and
TAIL, stamped after it with real-KV fingerprints. ``before_forward`` verifies the cached prefix
against HEAD and stamps the new tokens; ``after_forward`` does the same against TAIL with real KV
and then polls the asynchronous pump. ``sweep`` scrubs idle cached slots against TAIL. All step
launches are capturable in a CUDA graph (docs/engines/custom.md, "CUDA graphs": what must stay static).

Threads: every public method holds the canary's lock, so one KvCanary may be driven from several
threads (nothing is lost or counted twice); a thread holds :attr:`KvCanary.lock` around each whole
step, whose two stages share one plan.

The parts are checked and built in :mod:`kvcanary.manager.assembly`, the stages' launches packed and replayed in
:mod:`kvcanary.manager.stages`, the snapshots reported in :mod:`kvcanary.reporting.monitor`; this module is the step orchestrator.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np

from .. import ops
from ..config import CanaryConfig
from ..errors import ValidationError, ValidationTypeError
from ..ops.batch import Batch
from ..ops.records import CanaryRecords
from ..ops.records import move as move_records
from ..ops.sweep import chains_plan, sweep_plan
from ..reporting.monitor import Monitor
from ..runtime import memory
from ..validate import fail
from . import assembly
from .assembly import STAGES, Key, PoolGroup
from .stages import StageLaunches


def _need_batch(batch, where: str) -> None:
    if not isinstance(batch, Batch):
        fail(f"{where}(batch)", "a kvcanary.Batch", batch, "build one with kvcanary.Batch(...) or an adapter "
             "(kvcanary.adapters.sglang_batch / vllm_batch)", kind=ValidationTypeError)


class KvCanary:
    """Canary state and step launches for one KV pool (see module docstring)."""

    def __init__(self, full: PoolGroup, swa: PoolGroup | None = None, *, config: CanaryConfig | None = None,
                 **settings):
        """``config``: a :class:`~kvcanary.CanaryConfig`; ``settings``: its fields as keywords (``device``,
        ``hash_mode``, ``mode``, ``max_batch``, ...), which override the config's."""
        self.config = CanaryConfig.of(config, settings)
        parts = assembly.build(full, swa, self.config)
        c = self.config
        self.hash_mode, self.check_expected_token, self.fused = c.hash_mode, c.check_expected_token, c.fused
        self.reporter, self.mode, self.device, self.stats_every = parts.reporter, c.mode, c.device, c.stats_every
        self.groups, self.backend, self.keys, self.layout = parts.groups, parts.backend, parts.keys, parts.layout
        self.status, self._ring, self.ring_capacity = parts.status, parts.ring, c.ring_capacity
        self.self_test, self.ctx, self.plans = parts.self_test, parts.ctx, parts.plans
        self._lock = threading.RLock()
        self.pump = self.backend.pump(self.status, self._ring, self.layout.failed, parts.ring_requests)
        self._verdicts, self._failed_count = parts.head_ctx["FULL"].sink.verdict_arrays[:2]
        self.stages = StageLaunches(parts)
        self.monitor = Monitor(parts, self.pump, c.ring_capacity, c.stats_every)
        self.ledger = self.monitor.ledger
        self._head_open = False  # before_forward ran and its after_forward has not (the step protocol)

    @property
    def lock(self) -> threading.RLock:
        """The canary's re-entrant lock, which every public method takes. Threads that step one
        canary hold it around each whole step (``before_forward`` .. ``after_forward``): the two
        stages of a batch share the step's plan, so another thread's step must not come between."""
        return self._lock

    @property
    def step(self) -> int:
        """Steps reported so far (each ``after_forward`` or ``poll`` outside a capture is one)."""
        return self.monitor.step

    # ---- step API --------------------------------------------------------------------------------
    def before_forward(self, batch: Batch, stream=None) -> None:
        """HEAD: verify each request's cached prefix (identity) and stamp the new tokens. A step is
        ``before_forward(batch)``, the forward, ``after_forward(batch)``; a HEAD while the last one's
        TAIL never came (an exception in the forward) warns and starts the new step."""
        _need_batch(batch, "before_forward")
        with self._lock:
            if self._head_open and self.mode != "none":
                warnings.warn("kv-canary: before_forward() again without after_forward() for the previous step "
                              "(did its forward raise?): that step's tokens were stamped by HEAD only and its "
                              "TAIL verify did not run; this HEAD starts a new step. Fix: call after_forward(batch) "
                              "after every forward that ran", RuntimeWarning, stacklevel=2)
            self._head_open = True  # also when HEAD refuses the batch: its TAIL says the same of it
            self._stage(batch, 0, stream)

    def after_forward(self, batch: Batch, stream=None) -> None:
        """TAIL: verify the prefix with real KV, stamp the new tokens with their fingerprints, then
        poll the pump (skipped while the stream is being captured into a CUDA graph). Needs the
        step's ``before_forward(batch)`` first (a ``kv-canary:`` error otherwise); the batch must be
        the one HEAD was given (a different one is reported by the kernels: BATCH_INDEX_OUT_OF_RANGE
        rows with ``batch_field=ENTRY_COUNT``, and :meth:`health_check` fails)."""
        _need_batch(batch, "after_forward")
        with self._lock:
            if not self._head_open and self.mode != "none":
                raise ValidationError(f"kv-canary: after_forward(batch) needs the same step's before_forward(batch) "
                                      f"first (TAIL verifies against the plan HEAD builds), got after_forward with no "
                                      f"before_forward since step {self.monitor.step}'s. Fix: call "
                                      f"before_forward(batch) before the model's forward, after_forward(batch) after")
            self._head_open = False
            s = self._stage(batch, 1, stream, end=self.monitor)  # its last launch takes the snapshot
            if s is not False:  # False: captured
                self.monitor.report(s, advance=True)

    def _stage(self, batch: Batch, k: int, stream, end=None):
        """Enqueue (or, on the host, run) one stage; the stream, or False while it is capturing a
        graph (those launches count when the graph is replayed: :meth:`record_replay`). ``end``: the
        monitor, when the stage ends the step (its last launch takes the pump's snapshot)."""
        if self.mode == "none":
            return None
        s = self.backend.stream(stream, batch)
        if not self.stages.run(batch, STAGES[k], s, end):
            return False
        self.monitor.ran(k)
        return s

    def launches_per_step(self) -> int:
        """kernel launches of one eager ``before_forward`` + ``after_forward`` of the batch
        layout last packed: both stages' launches (TAIL's last takes the pump's snapshot; 0 on the host)."""
        if self.backend.synchronous or self.mode == "none":
            return 0
        return self.stages.per_step()

    @property
    def launch_count(self) -> int:
        """kernel launches made so far by the step API and the pump (captures included)."""
        return self.stages.launched + self.pump.launches

    def sweep(self, slots, positions, prev_slots, *, group: str = "FULL", stream=None) -> None:
        """Verify idle cached slots against the TAIL buffers with real KV (tags SWEEP_*).
        ``prev_slots[i]`` is slot i's predecessor (-1 for a chain head); host sequences."""
        group = self._group(group)
        with self._lock:
            plan = self.plans["SWEEP"]
            host, n = sweep_plan(slots, positions, prev_slots, plan.verify_capacity)
            s = self.backend.stream(stream, None)
            self.backend.upload_sweep(plan, host, n, s)
            halves = self.groups[group].resolved_halves()
            for h in halves:
                ops.verify(self.ctx[Key("SWEEP", group, h, "verify")], plan, stream=s)
            self.monitor.count([self.keys.index(Key("SWEEP", group, h, "verify")) for h in halves])
            if self.backend.synchronous:
                self.monitor.report(None, advance=False)  # a sweep is not a step

    def sweep_chains(self, chains, *, group: str = "FULL", stream=None) -> None:
        """:meth:`sweep` over node chains: each chain lists the slots of positions 0, 1, ... of one
        cached sequence (e.g. a radix-tree path from the root)."""
        self._group(group)
        self.sweep(*chains_plan(chains), group=group, stream=stream)

    def _group(self, group) -> str:
        """The group a sweep names (case-insensitive), checked."""
        if not isinstance(group, str):
            fail("sweep group", f"one of {tuple(self.groups)}", group, "pass group='FULL'", kind=ValidationTypeError)
        if group.upper() not in self.groups:
            fail("sweep group", f"one of {tuple(self.groups)}", group, "pass group='FULL'")
        return group.upper()

    # ---- records that travel with their KV (kvcanary/records.py) ------------------------------------
    def export_records(self, slots, *, group: str = "FULL", stream=None) -> CanaryRecords:
        """The canary records of ``slots`` (every buffer of ``group``: HEAD/TAIL x K/V) and what
        their fingerprints cover, to move with the slots' KV (offload, transfer, migration). On
        the device a launch on ``stream`` (no host sync; host slots are uploaded first)."""
        group = self._group(group)
        with self._lock:
            return move_records(self, slots, None, group, stream)

    def import_records(self, slots, records: CanaryRecords, *, group: str = "FULL", stream=None) -> None:
        """Place ``records`` (from :meth:`export_records` of a canary built alike, here or in
        another process through ``to_bytes``/``from_bytes``) at ``slots``, in the order given: the
        first read verifies them against the moved KV like any record."""
        if not isinstance(records, CanaryRecords):
            fail("import_records(records)", "kvcanary.CanaryRecords", records,
                 "pass what export_records() or CanaryRecords.from_bytes() returned", kind=ValidationTypeError)
        group = self._group(group)
        with self._lock:
            move_records(self, slots, records, group, stream)

    # ---- request verdicts (docs/format.md §5.7) ------------------------------------------------------
    @property
    def verdicts(self):
        """The step's request verdicts where the kernels keep them: int64 ``[max_batch]``, word r the
        OR of the fail bits of every row attributed to request r of the batch (0: clean). Reset by
        each ``before_forward``; whole after ``after_forward``. A device array (CUDA array interface,
        DLPack) an engine may read inside its own graph, e.g. to end request r's sequence when
        ``verdicts[r] != 0``, with no host sync; on the host backend a numpy view."""
        return self._verdicts

    @property
    def failed_count(self):
        """int64 ``[1]`` beside :attr:`verdicts`: how many of the step's words are nonzero."""
        return self._failed_count

    def failed_requests(self) -> list:
        """The requests failed since the last call, as :class:`~kvcanary.reporting.verdicts.FailedRequest`
        (step, batch index, fail bits, the slots their rows name), from the snapshots completed so
        far: never waits on the device, starts no snapshot and counts no step. An engine adapter
        maps each batch index to its request id at that step and fails that request
        (``mode="fail_request"``: docs/operators.md, "What happens on a detection")."""
        with self._lock:
            if self.mode != "none":
                self.monitor.report(None, advance=False)
            return self.monitor.take_failed()

    # ---- pump ------------------------------------------------------------------------------------
    def poll(self, stream=None) -> None:
        """Report what the newest completed snapshots show, then snapshot again (on ``stream``;
        skipped while it is capturing a graph). Never waits on the device, except to read back
        ring rows after violations were seen."""
        with self._lock:
            s = None if stream is None else self.backend.stream(stream, None)
            if s is not None and self.backend.capturing(s):
                return  # a snapshot launch in a capture would run only on replay
            self.monitor.report(s, advance=True)

    def flush(self) -> None:
        """Wait for the device and report everything up to now, also what launches after the last
        step's snapshot found (a sweep, an export): shutdown and tests; this one synchronises."""
        with self._lock:
            self.monitor.flush()
        memory.release_pending()  # the device is idle and no capture is running: free collected arrays

    def stats(self) -> dict:
        """Counters as of the newest processed snapshot (docs/format.md §10.5: what each key means)."""
        with self._lock:
            return self.monitor.stats()

    def add_listener(self, callback, *, stats: bool = True) -> None:
        """Call ``callback(record)`` with every record the export target gets: one dict per
        violation (``type="violation"``, the fields of docs/format.md §10 plus ``step``) and one per
        reported step (``type="stats"``, the keys of :meth:`stats`). A listener that raises is
        logged once and counted in ``export_errors``; no listener costs nothing. ``stats=False``:
        every record but the per-step stats, which then cost nothing (they are built per step only
        for a listener or an export target that takes them)."""
        if not callable(callback):
            raise ValidationTypeError(f"kv-canary: add_listener needs a callable, got {type(callback).__name__}. "
                                      f"Fix: pass a function taking one dict")
        if type(stats) is not bool:
            fail("add_listener(stats=)", "True or False", stats, "pass stats=False for violation records only",
                 kind=ValidationTypeError)
        with self._lock:
            (self.reporter.listeners if stats else self.reporter.event_listeners).append(callback)

    def health_check(self) -> None:
        """Raise if a launch that should have run has not advanced its kernel_run_counter, or if a
        launch's batch disagreed with the plan built at HEAD (ENTRY_COUNT rows, or verify entries the
        kernels skipped for it), or if violation rows were lost to a full ring (an ENTRY_COUNT row
        among them cannot be ruled out), as of the newest processed snapshot."""
        with self._lock:
            self.monitor.health_check()

    def buffers(self) -> dict[tuple[str, str, str], np.ndarray]:
        """Host copies of the canary buffers by (HEAD/TAIL, group, half). Synchronises (debugging
        and tests, not the serving loop)."""
        out = {}
        for k, ctx in self.ctx.items():
            if k.op == "write":
                arr = ctx.buffer.array
                out[k.stage, k.group, k.half] = np.array(arr) if isinstance(arr, np.ndarray) else arr.numpy()
        return out

    def replayed(self, stream: int) -> None:
        """After a replay, on ``stream`` (a raw handle, not capturing), of a graph that captured a
        whole step (HEAD and TAIL): :meth:`record_replay` and :meth:`poll` in one call, the step's
        host cost after a replay (one snapshot launch)."""
        with self._lock:
            if self.mode != "none":  # mode "none" captures no launch
                self.monitor.replayed(STAGES)
            self.monitor.report(stream, advance=True)

    def record_replay(self, stages=STAGES) -> None:
        """Tell the health check that a captured graph holding these stages was replayed (a
        capture itself counts nothing)."""
        stages = (stages,) if isinstance(stages, str) else stages
        if not isinstance(stages, (tuple, list)) or not all(isinstance(st, str) for st in stages):
            fail("record_replay(stages=)", "'HEAD', 'TAIL' or a tuple of them", stages, "pass stages=('HEAD', 'TAIL')",
                 kind=ValidationTypeError)
        if not set(stages) <= set(STAGES):
            fail("record_replay(stages=)", f"a subset of {STAGES}", stages, "pass stages=('HEAD', 'TAIL')")
        with self._lock:
            self.monitor.replayed(tuple(stages))
