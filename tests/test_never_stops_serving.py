"""The canary never stops the engine it guards (issue 11, parts 3 and 4), on the CPU reference.

- an export target that cannot be opened fails at construction (a kv-canary error with a fix); one
  that fails later (a full disk, a raising callback or listener) is logged once, counted in
  ``stats()["export_errors"]``, and the steps carry on;
- mode "raise" raises once for each new set of violations, never again on later clean steps; "ring
  full" is logged once per new overflow;
- four threads stepping one KvCanary lose no violation.

Every violation here is a write assert (docs/format.md §7): a token whose ``expected_input_ids`` entry differs
is one WRITE_TOKEN row in each of the step's four write launches (HEAD and TAIL, K and V).
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import CanaryViolationError, KvCanary, PoolGroup, ValidationError, ValidationTypeError

WRITES = ("HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL")  # the launches that assert a write


class Requests:
    """Decode-style steps of ``len(rows)`` requests: each step appends one token per request (request
    i in row ``rows[i]``, its token j in slot ``first_slot + i * steps + j``)."""

    def __init__(self, rows, steps: int, first_slot: int = 1, table_rows: int = 8):
        self.rows, self.steps, self.first = list(rows), steps, first_slot
        self.rtt = np.zeros((table_rows, steps), np.int32)
        self.done = 0

    def batch(self, bad: bool = False) -> kc.Batch:
        j, n = self.done, len(self.rows)
        slots = np.array([self.first + i * self.steps + j for i in range(n)], np.int64)
        self.rtt[self.rows, j] = slots
        ids = np.array([1000 * r + j for r in self.rows], np.int64)
        expected = ids.copy()
        if bad:
            expected[0] += 1  # the engine fed the wrong token to request 0
        self.done += 1
        return kc.Batch(np.array(self.rows, np.int64), np.full(n, j, np.int64), np.ones(n, np.int64), self.rtt.copy(),
                        input_ids=ids, positions=np.full(n, j, np.int64), out_cache_loc=slots,
                        expected_input_ids=expected, expected_positions=np.full(n, j, np.int64))


POOLS: dict = {}  # id(canary) -> its K and V pools, which step()'s forward writes


def make_canary(num_slots=256, **kw) -> KvCanary:
    pools = [np.zeros((num_slots, 32), np.uint8) for _ in range(2)]
    group = PoolGroup(num_slots, [kc.source_from_slots(pools[0])], [kc.source_from_slots(pools[1])])
    canary = KvCanary(group, **{"max_batch": 8, "verify_capacity": 1 << 12, **kw})
    POOLS[id(canary)] = pools
    return canary


def step(canary, batch) -> None:
    canary.before_forward(batch)
    for h, pool in enumerate(POOLS.get(id(canary), ())):  # the forward: the new tokens' KV lands (K14 otherwise)
        for slot, token in zip(np.asarray(batch.out_cache_loc).tolist(), np.asarray(batch.input_ids).tolist()):
            pool[slot] = np.random.default_rng([token, h]).integers(1, 256, pool.shape[1], dtype=np.uint8)
    canary.after_forward(batch)


def log_lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# ---- export ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["/proc/kvcanary.jsonl", "/nonexistent-kvcanary/x.jsonl", "a-folder"])
def test_an_export_target_that_cannot_be_opened_fails_at_construction(tmp_path, target):
    target = str(tmp_path) if target == "a-folder" else target
    with pytest.raises(ValidationError) as err:
        make_canary(export=target)
    text = str(err.value)
    assert text.startswith("kv-canary: export must be a file kvcanary can append to, got ") and "Fix: " in text
    assert repr(target) in text


def _export_fails_later(caplog, canary, what: str, steps: int = 6):
    """Clean steps, one with a violation (mode log), more clean steps: every call returns, the
    failure is logged once, and export_errors counts every record the target should have taken."""
    records = []
    canary.add_listener(records.append)  # a working listener sees every record the target missed
    reqs = Requests([1], steps)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        for j in range(steps):
            step(canary, reqs.batch(bad=(j == 2)))
        canary.flush()
    stats = canary.stats()
    assert stats["step"] == steps and stats["violations"] == len(WRITES)
    assert [r["launch_tag"] for r in records if r["type"] == "violation"] == list(WRITES)
    assert stats["export_errors"] == len(records) >= steps  # one stats record per step at least
    assert len(log_lines(caplog, f"{what} failed")) == 1
    assert len(log_lines(caplog, "kv_canary violation")) == len(WRITES)  # the report itself still got out


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_full_disk_is_logged_once_counted_and_serving_goes_on(caplog):
    _export_fails_later(caplog, make_canary(export="/dev/full"), "export file")


def test_a_raising_export_callback_is_logged_once_counted_and_serving_goes_on(caplog):
    def callback(record):
        raise RuntimeError("the collector is down")
    _export_fails_later(caplog, make_canary(export=callback), "export callback")


def test_a_raising_listener_is_logged_once_counted_and_serving_goes_on(caplog):
    canary = make_canary()
    canary.add_listener(lambda record: 1 / 0)
    _export_fails_later(caplog, canary, "listener")


def test_raise_mode_still_raises_the_report_while_the_export_fails():
    canary = make_canary(mode="raise", export=lambda record: (_ for _ in ()).throw(OSError(28, "No space left")))
    reqs = Requests([1], 4)
    step(canary, reqs.batch())
    with pytest.raises(CanaryViolationError) as err:
        step(canary, reqs.batch(bad=True))
    assert len(err.value.violations) == len(WRITES)
    step(canary, reqs.batch())  # the next steps keep working
    step(canary, reqs.batch())
    assert canary.stats()["export_errors"] > 0 and canary.stats()["step"] == 4


# ---- raise once, "ring full" once --------------------------------------------------------------------------
def test_raise_mode_raises_once_for_each_new_set_of_violations():
    canary = make_canary(mode="raise")
    reqs = Requests([1, 2], 9)
    raised = []
    for j in range(9):
        try:
            step(canary, reqs.batch(bad=j in (2, 6)))
        except CanaryViolationError as exc:
            raised.append((j, sorted(v.tag_name for v in exc.violations), exc.overflow))
    canary.flush()  # reports nothing new: no raise
    assert raised == [(2, sorted(WRITES), 0), (6, sorted(WRITES), 0)]
    assert canary.stats()["violations"] == 2 * len(WRITES)


def test_after_a_ring_overflow_raise_mode_raises_once_not_on_every_clean_step():
    canary = make_canary(mode="raise", ring_capacity=2)
    reqs = Requests([1], 6)
    step(canary, reqs.batch())
    with pytest.raises(CanaryViolationError) as err:
        step(canary, reqs.batch(bad=True))
    assert (len(err.value.violations), err.value.overflow) == (2, len(WRITES) - 2)
    assert "(+2 not recorded: ring full)" in str(err.value)
    for _ in range(4):
        step(canary, reqs.batch())  # clean: no raise
    canary.flush()
    stats = canary.stats()
    assert (stats["violations"], stats["violations_recorded"], stats["ring_overflow"]) == (4, 2, 2)


def test_ring_full_is_logged_once_per_new_overflow(caplog):
    canary = make_canary(ring_capacity=2)
    reqs = Requests([1], 10)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        for j in range(10):
            step(canary, reqs.batch(bad=j in (1, 6)))
            if j == 4:
                assert len(log_lines(caplog, "ring full")) == 1  # not again on the clean steps 2..4
        canary.flush()
    assert len(log_lines(caplog, "ring full")) == 2
    assert len(log_lines(caplog, "kv_canary violation")) == 4  # the ring is reused: 2 rows each time
    stats = canary.stats()
    assert (stats["violations"], stats["violations_recorded"], stats["ring_overflow"]) == (8, 4, 4)


# ---- threads --------------------------------------------------------------------------------------------------
def test_four_threads_stepping_one_canary_lose_no_violation():
    """Each engine thread holds ``canary.lock`` around its whole step (HEAD and TAIL share the step's
    plan); a fifth thread reads stats and polls meanwhile, without it (each call takes the lock)."""
    threads, steps, bad_every = 4, 40, 5
    canary = make_canary(num_slots=1 + threads * steps)
    records, errors, done = [], [], threading.Event()
    canary.add_listener(records.append)
    start = threading.Barrier(threads + 1)

    def engine(t: int) -> None:
        reqs = Requests([t + 1], steps, first_slot=1 + t * steps)  # its own row and slots
        try:
            start.wait()
            for j in range(steps):
                batch = reqs.batch(bad=j % bad_every == bad_every - 1)
                with canary.lock:
                    step(canary, batch)
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    def monitor() -> None:
        start.wait()
        while not done.is_set():
            canary.stats()
            canary.poll()

    workers = [threading.Thread(target=engine, args=(t,)) for t in range(threads)]
    watcher = threading.Thread(target=monitor)
    for w in [*workers, watcher]:
        w.start()
    for w in workers:
        w.join()
    done.set()
    watcher.join()
    canary.flush()
    assert errors == []
    expected = threads * (steps // bad_every) * len(WRITES)
    rows = [r for r in records if r["type"] == "violation"]
    assert canary.stats()["violations"] == len(rows) == expected
    for t in range(threads):  # each thread's corruptions, in its own slots: every one of them
        mine = [r for r in rows if 1 + t * steps <= r["slot_idx"] < 1 + (t + 1) * steps]
        assert sorted(r["slot_idx"] for r in mine) == sorted(
            1 + t * steps + j for j in range(steps) if j % bad_every == bad_every - 1 for _ in WRITES)
        assert all(r["fail_reason"] == ["write_token"] for r in mine)


def test_a_listener_without_stats_gets_every_violation_and_no_step_builds_stats(monkeypatch):
    """Catches per-step stats built for nobody: an adapter that only wants violations (the
    transformers client) listens with ``stats=False``; it gets each violation record and no stats
    record, and no step builds a stats record (a numpy pass over the snapshot, every step)."""
    from kvcanary.reporting.monitor import Monitor
    built = []
    original = Monitor.stats_of
    monkeypatch.setattr(Monitor, "stats_of", lambda self, snap, step: built.append(step) or original(self, snap, step))
    canary = make_canary()
    records = []
    canary.add_listener(records.append, stats=False)
    reqs = Requests([1], 5)
    for j in range(5):
        step(canary, reqs.batch(bad=(j == 2)))
    canary.flush()
    assert [r["launch_tag"] for r in records if r["type"] == "violation"] == list(WRITES)
    assert all(r["type"] != "stats" for r in records) and built == []
    with pytest.raises(ValidationTypeError, match=r"add_listener\(stats=\).*True or False"):
        canary.add_listener(records.append, stats="no")
