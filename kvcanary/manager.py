"""KvCanary: the object a serving engine holds (docs/format.md §6, §8-§10).

Per pool group (FULL and optionally SWA) and per half (K, V) it keeps two canary buffers: HEAD,
stamped before the forward without fingerprints (the new tokens' KV does not exist yet), and
TAIL, stamped after it with real-KV fingerprints. ``before_forward`` verifies the cached prefix
against HEAD and stamps the new tokens; ``after_forward`` does the same against TAIL with real KV
and then polls the asynchronous pump. ``sweep`` scrubs idle cached slots against TAIL. All step
launches are capturable in a CUDA graph (see README: what must stay static).

Threads: every public method holds the canary's lock, so one KvCanary may be driven from several
threads (nothing is lost or counted twice); a thread holds :attr:`KvCanary.lock` around each whole
step, whose two stages share one plan.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from operator import is_
from typing import Any, NamedTuple, Sequence

import numpy as np

from . import abi, backends, ops
from .errors import KvCanaryError, ValidationError, ValidationTypeError
from .packing import PackCache, arg_keys
from .plan import BATCH_FIELD_NAMES, MAX_BATCH_LIMIT, Batch, StepPlan
from .driver import PER_THREAD_STREAM, paired
from .records import CanaryRecords
from .selftest import SelfTest
from .reporting import Reporter, RingLedger
from .sources import RealKvSource, source_list
from .state import RING_CAPACITY_LIMIT, CanaryBuffer, VerifyContext, ViolationSink, checked
from .validate import INT32_MAX, boolean, device as check_device, fail, hash_mode as parse_hash_mode, instance, integer
from .violations import decode_ring

STAGES = ("HEAD", "TAIL")
LAYOUTS_KEPT = 8  # packed launch sets kept per stage, one per distinct batch layout


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


def _need_batch(batch, where: str) -> None:
    if not isinstance(batch, Batch):
        fail(f"{where}(batch)", "a kvcanary.Batch", batch, "build one with kvcanary.Batch(...) or an adapter "
             "(kvcanary.adapters.sglang_batch / vllm_batch)", kind=ValidationTypeError)


class _Hot(NamedTuple):
    """A stage's last step whose batch fields were all packing.IMMUTABLE: those very objects replay
    their packed launches without a key."""

    fields: tuple
    packed: Any


class Key(NamedTuple):
    """A verify context of the canary: stage (HEAD/TAIL/SWEEP), group (FULL/SWA), half, op."""

    stage: str
    group: str
    half: str
    op: str


class KvCanary:
    """Canary state and step launches for one KV pool (see module docstring)."""

    def __init__(self, full: PoolGroup, swa: PoolGroup | None = None, *, device: int | None = None,
                 hash_mode="partial", mode: str = "log", max_batch: int = 256,
                 verify_capacity: int = 1 << 20, ring_capacity: int = abi.DEFAULT_RING_CAPACITY,
                 sweep_capacity: int = 1 << 16, check_expected_token: bool = False,
                 chain_position_assert: bool = False, fused: bool = True, stats_every: int = 0,
                 self_test_every: int = 0, fingerprint_every: int = 1, export=None):
        mode_hash = parse_hash_mode(hash_mode)
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
        check_device("device", device)
        integer("ring_capacity", ring_capacity, lo=1, hi=RING_CAPACITY_LIMIT)
        integer("max_batch", max_batch, lo=1, hi=MAX_BATCH_LIMIT)
        integer("verify_capacity", verify_capacity, lo=1, hi=INT32_MAX)
        integer("sweep_capacity", sweep_capacity, lo=1, hi=INT32_MAX)
        integer("stats_every", stats_every, lo=0)
        integer("self_test_every", self_test_every, lo=0, hi=INT32_MAX,
                fix="pass 0 (off) or the number of steps between self-tests, e.g. 1000")
        integer("fingerprint_every", fingerprint_every, lo=1, hi=INT32_MAX,
                fix="pass 1 (every cached token's KV every step) or N (a rotating 1/N per step, e.g. 8)")
        if fingerprint_every > 1 and not fused:
            raise ValidationError(f"kv-canary: fingerprint_every={fingerprint_every} needs the fused verify, got "
                                  f"fused=False. Fix: pass fused=True (the default), or fingerprint_every=1")
        self.check_expected_token = boolean("check_expected_token", check_expected_token)
        self.fused, self.stats_every = boolean("fused", fused), stats_every
        boolean("chain_position_assert", chain_position_assert)
        self.reporter = Reporter(mode, export)
        self.mode, self.device, self.hash_mode = self.reporter.mode, device, mode_hash
        self.groups = {"FULL": full, **({"SWA": swa} if swa is not None else {})}
        self._lock = threading.RLock()
        self.backend = be = backends.for_device(device)
        self.keys = [Key(st, g, h, op) for g, grp in self.groups.items() for h in grp.resolved_halves()
                     for st, op in (("HEAD", "verify"), ("HEAD", "write"), ("TAIL", "verify"),
                                    ("TAIL", "write"), ("SWEEP", "verify"))]
        self.layout = lay = abi.StatusLayout(len(self.keys), len(self.groups) + 1)
        self.status = be.zeros((lay.size,), np.int64)
        self._ring = be.zeros((ring_capacity, abi.RING_COLS), np.int64)
        self.ring_capacity = ring_capacity
        flag = be.zeros((1,), np.int32)
        # the self-test (docs/format.md §11) rides on the first HEAD verify of the FULL group
        tested = Key("HEAD", "FULL", full.resolved_halves()[0], "verify")
        self.self_test = SelfTest(self_test_every, self.keys.index(tested), abi.LaunchTag[f"HEAD_{tested.half}_FULL"],
                                  full.num_slots)
        buffers = {(st, g, h): CanaryBuffer.allocate(grp.num_slots, device=device)
                   for g, grp in self.groups.items() for h in grp.resolved_halves() for st in STAGES}
        self.ctx: dict[Key, VerifyContext] = {}
        # the fingerprint budget's phase (docs/format.md §6.1): the run count of the HEAD verify of
        # the same group and half, which this step's HEAD stage advanced before TAIL reads it
        phase = {(k.group, k.half): be.cells(self.status, lay.runs(i)) for i, k in enumerate(self.keys)
                 if k.stage == "HEAD" and k.op == "verify"}
        for i, key in enumerate(self.keys):
            sink = ViolationSink(self._ring, be.cells(self.status, abi.STATUS_CLAIM, dtype=np.int32),
                                 be.cells(self.status, lay.runs(i)), be.cells(self.status, lay.runs(i) + 1),
                                 claim=be.cells(self.status, abi.STATUS_CLAIM),
                                 consumed=be.cells(self.status, abi.STATUS_CONSUMED),
                                 skips=be.cells(self.status, abi.STATUS_SKIPS))
            grp, head = self.groups[key.group], key.stage == "HEAD"
            sources = () if head else (grp.k_sources if key.half == "K" else grp.v_sources)
            self.ctx[key] = VerifyContext(buffers["HEAD" if head else "TAIL", key.group, key.half], sink,
                                          abi.LaunchTag[f"{key.stage}_{key.half}_{key.group}"], sources,
                                          abi.HashMode.NONE if head else mode_hash, chain_position_assert=flag,
                                          self_test_every=self_test_every if key == tested else 0,
                                          **(dict(fingerprint_every=fingerprint_every,
                                                  fingerprint_phase=phase[key.group, key.half])
                                             if key.stage == "TAIL" and key.op == "verify" else {}))
        if chain_position_assert:
            next(iter(self.ctx.values())).set_chain_position_assert(True)
        self.plans: dict[str, StepPlan] = {}
        for k, g in enumerate([*self.groups, "SWEEP"]):
            cap = integer("sweep_capacity" if g == "SWEEP" else "verify_capacity",
                          sweep_capacity if g == "SWEEP" else verify_capacity, lo=1, hi=(1 << 31) - 1)
            p = StepPlan.allocate(max_batch, cap, device=device, materialize=(g == "SWEEP" or not fused))
            p.num_valid, p.enable = (be.cells(self.status, lay.plan(k) + j, dtype=np.int32) for j in (0, 1))
            self.plans[g] = p
        self.pump = be.pump(self.status, self._ring)
        self.ledger = RingLedger(ring_capacity)
        self.step = 0
        # Launches enqueued per context = _expected (sweeps, replays) + stage runs x stage mask.
        self._expected = np.zeros(len(self.keys), np.int64)
        self._stage_runs = [0, 0]
        self._masks = [np.array([k.stage == st for k in self.keys], np.int64) for st in STAGES]
        self._last = None  # (newest snapshot processed, its meta)
        self._packed = {st: PackCache(LAYOUTS_KEPT) for st in STAGES}  # layout key -> launches, per stage
        self._held = {st: None for st in STAGES}  # the last step's batch fields, per stage
        self._hot: dict[str, _Hot | None] = {st: None for st in STAGES}
        self._stage_launches = 0
        self._skipped = 0
        first = {g: next(i for i, k in enumerate(self.keys) if k.group == g) for g in self.groups}
        self._tokens_ctx = self.keys.index(Key("TAIL", "FULL", full.resolved_halves()[0], "write"))
        self._verifies = np.array([i for i, k in enumerate(self.keys) if k.op == "verify"], np.intp)
        self._head_ctx = {g: self.ctx[self.keys[i]] for g, i in first.items()}

    @property
    def lock(self) -> threading.RLock:
        """The canary's re-entrant lock, which every public method takes. Threads that step one
        canary hold it around each whole step (``before_forward`` .. ``after_forward``): the two
        stages of a batch share the step's plan, so another thread's step must not come between."""
        return self._lock

    # ---- step API --------------------------------------------------------------------------------
    def before_forward(self, batch: Batch, stream=None) -> None:
        """HEAD: verify each request's cached prefix (identity) and stamp the new tokens."""
        _need_batch(batch, "before_forward")
        with self._lock:
            self._stage(batch, 0, stream)

    def after_forward(self, batch: Batch, stream=None) -> None:
        """TAIL: verify the prefix with real KV, stamp the new tokens with their fingerprints, then
        poll the pump (skipped while the stream is being captured into a CUDA graph)."""
        _need_batch(batch, "after_forward")
        with self._lock:
            s = self._stage(batch, 1, stream)
            if s is not False:  # False: captured
                self._report(s, advance=True)

    def _stage(self, batch: Batch, k: int, stream):
        """Enqueue (or, on the host, run) one stage; the stream, or False while it is capturing a
        graph (those launches count when the graph is replayed: :meth:`record_replay`)."""
        if self.mode == "none":
            return None
        s = self.backend.stream(stream, batch)
        if not self.backend.cached_launches:
            self._pack(batch, STAGES[k], s)  # the reference runs while packing
        else:
            launches = self._launches(batch, STAGES[k], s)
            for launch in launches:
                launch.go(s)
            self._stage_launches += len(launches)
            if self.backend.capturing(s):
                return False
        self._stage_runs[k] += 1
        return s

    def _launches(self, batch: Batch, stage: str, stream) -> list:
        """The stage's packed launches for this batch: validated and packed once per array layout
        (shapes, strides, dtypes, devices, scalars, which fields alias: :mod:`.packing`), then
        replayed with the current arrays' addresses patched into their params (an engine hands
        over new tensors every step). Keyed per call: a tensor may change in place (``set_``,
        ``resize_``); only a step of the very objects of the last one, all of them arrays kvcanary
        made (DeviceArray, ArrayView: fixed for life) or numbers, replays without a key."""
        fields = tuple(batch.__dict__.values())
        hot = self._hot[stage]
        if hot is not None and len(fields) == len(hot.fields) and all(map(is_, fields, hot.fields)):
            return hot.packed.launches  # the very immutable arrays of the stage's last step
        key, ptrs, fixed = arg_keys(fields)
        self._hot[stage] = None
        self._held[stage] = fields  # the last step's arrays stay alive until the next step of the stage
        if key is None:  # an array that cannot be keyed cheaply: validated and packed every step
            return self._pack(batch, stage, stream)
        cache = self._packed[stage]
        entry = cache.get(key, ptrs)
        if entry is None:
            launches = self._pack(batch, stage, stream)
            entry = cache.put(key, launches, fields, ptrs, BATCH_FIELD_NAMES)
        if fixed:  # every field IMMUTABLE: identity proves their layout and address
            self._hot[stage] = _Hot(fields, entry)
        return entry.launches

    def _pack(self, batch: Batch, stage: str, stream) -> list:
        """The launches of one stage for this batch's array layout (validated here, once per
        layout). They hold no reference to the batch's arrays: a later batch with the same layout
        replays them on its own arrays (same addresses)."""
        out = []
        for g, grp in self.groups.items():
            plan = self.plans[g]
            swa = dict(swa_window=grp.window, swa_map=grp.full_to_swa) if g == "SWA" else {}
            if stage == "HEAD":
                out += ops.prepare_build_plan(batch, plan, ctx=self._head_ctx[g], stream=stream, **swa)
            loc = batch.swa_out_cache_loc if g == "SWA" else batch.out_cache_loc
            if loc is None:
                raise ValidationError(f"kv-canary: batch.{'swa_' if g == 'SWA' else ''}out_cache_loc must be given "
                                      f"to stamp the {g} group, got None. Fix: pass the new tokens' slots")
            halves = grp.resolved_halves()
            first = self.ctx[Key("HEAD", g, halves[0], "write")]  # runs the step's serial chain
            # On the device the halves' writes share one launch and so do their verifies (blockIdx.y
            # the half): HEAD's halves then stamp side by side, each running the chain itself.
            pair = len(halves) == abi.HALVES and plan.device is not None
            writes, verifies = [], []
            for h in halves:  # stamp first, then verify: a new token stamped over a slot that
                # another request still reads (premature free, a draft landing in a committed slot) is
                # then caught by this very stage, before the forward reads it (HEAD) or right after (TAIL)
                vctx, wctx = self.ctx[Key(stage, g, h, "verify")], self.ctx[Key(stage, g, h, "write")]
                chain = None if wctx is first or (pair and stage == "HEAD") else first
                writes.append(ops.prepare_write(wctx, plan, batch.input_ids, batch.positions, loc, stream=stream,
                                                expected_input_ids=batch.expected_input_ids,
                                                expected_positions=batch.expected_positions, chain_from=chain))
                if self.fused:
                    verifies.append(ops.prepare_fused_verify(vctx, batch, plan, stream=stream,
                                                             check_expected_token=self.check_expected_token, **swa))
                else:
                    verifies.append(ops.prepare_verify(vctx, plan, check_expected_token=self.check_expected_token,
                                                       stream=stream))
            if pair:
                for launches in (writes, verifies):
                    both = paired(*launches)
                    out += launches if both is None else [both]
            else:
                out += [x for wv in zip(writes, verifies) for x in wv]
        return [launch for launch in out if launch is not None]

    def launches_per_step(self) -> int:
        """cuLaunchKernel calls of one eager ``before_forward`` + ``after_forward`` of the batch
        layout last packed: both stages' launches plus the pump's snapshot (0 on the host)."""
        if not self.backend.cached_launches or self.mode == "none":
            return 0
        return sum(len(next(reversed(c.entries.values())).launches) for c in self._packed.values() if c.entries) + 1

    @property
    def launch_count(self) -> int:
        """cuLaunchKernel calls made so far by the step API and the pump (captures included)."""
        return self._stage_launches + self.pump.launches

    def sweep(self, slots, positions, prev_slots, *, group: str = "FULL", stream=None) -> None:
        """Verify idle cached slots against the TAIL buffers with real KV (tags SWEEP_*).
        ``prev_slots[i]`` is slot i's predecessor (-1 for a chain head); host sequences."""
        from .sweep import sweep_plan
        group = self._group(group)
        with self._lock:
            plan = self.plans["SWEEP"]
            host, n = sweep_plan(slots, positions, prev_slots, plan.verify_capacity)
            s = self.backend.stream(stream, None)
            self.backend.stage_sweep(plan, host, n, s)
            halves = self.groups[group].resolved_halves()
            for h in halves:
                ops.verify(self.ctx[Key("SWEEP", group, h, "verify")], plan, stream=s)
            self._count([self.keys.index(Key("SWEEP", group, h, "verify")) for h in halves])
            if not self.backend.cached_launches:
                self._report(None, advance=False)  # a sweep is not a step

    def sweep_chains(self, chains, *, group: str = "FULL", stream=None) -> None:
        """:meth:`sweep` over node chains: each chain lists the slots of positions 0, 1, ... of one
        cached sequence (e.g. a radix-tree path from the root)."""
        from .sweep import chains_plan
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
        return self._records(slots, None, self._group(group), stream)

    def import_records(self, slots, records: CanaryRecords, *, group: str = "FULL", stream=None) -> None:
        """Place ``records`` (from :meth:`export_records` of a canary built alike, here or in
        another process through ``to_bytes``/``from_bytes``) at ``slots``, in the order given: the
        first read verifies them against the moved KV like any record."""
        if not isinstance(records, CanaryRecords):
            fail("import_records(records)", "kvcanary.CanaryRecords", records,
                 "pass what export_records() or CanaryRecords.from_bytes() returned", kind=ValidationTypeError)
        self._records(slots, records, self._group(group), stream)

    def _records(self, slots, records, group: str, stream):
        from . import records as rec
        bufs = rec.buffers(self, group)
        num_slots = bufs[0].num_slots
        exporting = records is None
        with self._lock:
            where, n = self.backend.record_slots(slots, num_slots, "export_records" if exporting else "import_records")
            mine = rec.descriptor(self, group, n)
            if exporting:
                out = self.backend.zeros((len(bufs), n, abi.FIELDS_PER_SLOT), np.int64)
            else:
                rec.check_compatible(mine, records.descriptor)
                if records.n != n:
                    raise ValidationError(f"kv-canary: import_records needs one record per slot ({n}), got {records.n}. "
                                          f"Fix: pass the slots the records were exported for, in order")
                out = self.backend.records_array(records.records)
            self.backend.copy_records(bufs, where, out, not exporting, self._head_ctx[group],
                                      self.backend.stream(stream, None))
            return CanaryRecords(out, mine) if exporting else None

    # ---- pump ------------------------------------------------------------------------------------
    def poll(self, stream=None) -> None:
        """Report what the newest completed snapshots show, then snapshot again (on ``stream``;
        skipped while it is capturing a graph). Never waits on the device, except to read back
        ring rows after violations were seen."""
        with self._lock:
            s = None if stream is None else self.backend.stream(stream, None)
            if s is not None and self.backend.capturing(s):
                return  # a snapshot launch in a capture would run only on replay
            self._report(s, advance=True)

    def _meta(self):
        return (self.step, self._stage_runs[0], self._stage_runs[1], self._expected, self.ledger.floor)

    def _report(self, stream, advance: bool) -> None:
        meta = self._meta()
        taken = self.pump.take(meta)
        enqueued = stream is not None and self.pump.snapshot(stream, meta)  # ring reads use a side stream
        if advance:
            self.step += 1
        try:
            for snap, m in taken:  # may raise in mode "raise", after the step advanced
                self._process(snap, m)
        finally:
            self._consume(stream)
            if enqueued or not self.backend.cached_launches:
                self.ledger.floor = self.ledger.consumed

    def _consume(self, stream) -> None:
        """Rows taken: let the kernels reuse their ring slots (in stream order after this point)."""
        if self.ledger.total > self.ledger.consumed:
            self.ledger.consumed = self.ledger.total
            self.backend.set_consumed(self.status, self.ledger.total, stream)

    def flush(self) -> None:
        """Wait for the device and report everything up to now, also what launches after the last
        step's snapshot found (a sweep, an export): shutdown and tests; this one synchronises."""
        with self._lock:
            taken = []
            if self.backend.cached_launches:
                # one more snapshot behind everything enqueued so far, in a slot freed first (a full
                # FIFO would skip it), labelled with the last step it covers
                taken = self.pump.drain(self._meta())
                self.pump.snapshot(PER_THREAD_STREAM, (self.step - 1, *self._meta()[1:]))
            try:
                for snap, meta in taken + self.pump.drain(self._meta()):
                    self._process(snap, meta)
            finally:
                self._consume(None)
                self.ledger.floor = self.ledger.consumed  # the device is idle: no launch saw an older mark

    def _count(self, indices) -> None:
        """One more launch enqueued for each context index (a new array: metas keep the old)."""
        expected = self._expected.copy()
        expected[indices] += 1
        self._expected = expected

    def _process(self, snap: list, meta) -> None:
        """Report one snapshot (the status block as ints) taken with ``meta``."""
        step, head, tail, base, floor = meta
        self._last = (snap, meta)
        for k, g in enumerate(self.groups):
            if not snap[self.layout.plan(k) + 1] & abi.INT32_MASK and (head or tail or base.any()):
                self._skipped += 1
                warnings.warn(f"kv-canary: step {step}: the {g} verify was skipped because the batch has more "
                              f"cached entries than verify_capacity ({self.plans[g].verify_capacity}); fix: "
                              f"raise verify_capacity", RuntimeWarning, stacklevel=3)
        start, stop, lost = self.ledger.take(snap[abi.STATUS_CLAIM], floor)
        if stop > start or lost:
            rows = self.backend.read_rows(self._ring, start, stop)
            found = self.self_test.take(decode_ring(rows, len(rows)).violations)
            self.reporter.violations(found, step, lost, self.ledger.lost)
        if self.stats_every or self.reporter.wants_stats:
            emit = bool(self.stats_every) and step % self.stats_every == 0
            self.reporter.stats(self._stats(snap, step), emit)

    def _runs(self, snap) -> np.ndarray:
        """(kernel runs, slot runs) per context of a snapshot, int64 [contexts, 2]."""
        return np.array(snap[self.layout.runs(0):self.layout.runs(len(self.keys))], np.int64).reshape(-1, 2)

    def _stats(self, snap, step) -> dict:
        runs = self._runs(snap)
        return {"step": step, "protected_tokens": int(runs[self._tokens_ctx, 1]),
                "verified_slots": int(runs[self._verifies, 1].sum()),
                "violations": int(snap[abi.STATUS_CLAIM]) - self.self_test.due(runs), "self_tests": self.self_test.seen,
                "violations_recorded": self.ledger.recorded, "ring_overflow": self.ledger.lost,
                "skipped_verifies": self._skipped, "unattributed": int(snap[abi.STATUS_SKIPS]),
                "export_errors": self.reporter.export.errors, "steps_behind": self.pump.in_flight,
                "snapshots_skipped": self.pump.skipped}

    def stats(self) -> dict:
        """Counters as of the newest processed snapshot (README: what each key means)."""
        with self._lock:
            snap = self._last[0] if self._last else [0] * self.layout.size
            return self._stats(snap, self.step)

    def add_listener(self, callback) -> None:
        """Call ``callback(record)`` with every record the export target gets: one dict per
        violation (``type="violation"``, the fields of docs/format.md §10 plus ``step``) and one per
        reported step (``type="stats"``, the keys of :meth:`stats`). A listener that raises is
        logged once and counted in ``export_errors``; no listener costs nothing."""
        if not callable(callback):
            raise ValidationTypeError(f"kv-canary: add_listener needs a callable, got {type(callback).__name__}. "
                                      f"Fix: pass a function taking one dict")
        with self._lock:
            self.reporter.listeners.append(callback)

    def health_check(self) -> None:
        """Raise if a launch that should have run has not advanced its kernel_run_counter, or if
        the kernels skipped verify entries whose batch disagreed with its plan (as of the newest
        processed snapshot)."""
        with self._lock:
            if self._last is None:
                return
            snap, meta = self._last
            runs, expected = self._runs(snap), meta[3] + meta[1] * self._masks[0] + meta[2] * self._masks[1]
            bad = [f"{k.stage}_{k.half}_{k.group} {k.op}: ran {runs[i, 0]} of {expected[i]}"
                   for i, k in enumerate(self.keys) if runs[i, 0] < expected[i]]
            if snap[abi.STATUS_SKIPS]:
                bad.append(f"{snap[abi.STATUS_SKIPS]} verify entries skipped because a launch's batch disagreed "
                           f"with the plan built at HEAD (BATCH_INDEX_OUT_OF_RANGE rows say which requests)")
            bad += self.self_test.problems(runs, self.ledger.lost)
            if bad:
                raise KvCanaryError("kv-canary: health check failed, expected every enqueued canary launch to have "
                                    "run on the batch its plan was built from (and every due self-test row to "
                                    "arrive), got: " + "; ".join(bad) + ". Fix: keep the canary launches on the "
                                    "stream (or in the CUDA graph) that is replayed, and pass the same batch to "
                                    "before_forward and after_forward")

    def buffers(self) -> dict[tuple[str, str, str], np.ndarray]:
        """Host copies of the canary buffers by (HEAD/TAIL, group, half). Synchronises (debugging
        and tests, not the serving loop)."""
        out = {}
        for k, ctx in self.ctx.items():
            if k.op == "write":
                arr = ctx.buffer.array
                out[k.stage, k.group, k.half] = np.array(arr) if isinstance(arr, np.ndarray) else arr.numpy()
        return out

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
            self._count([i for i, k in enumerate(self.keys) if k.stage in stages])
