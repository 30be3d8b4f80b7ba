"""The self-test (docs/format.md §11) on the host backend: every N-th run of the first HEAD verify
checks a canary-only known-bad record; its row travels the ring like any other, is counted as a
self-test and never reported, and the health check fails when one did not arrive or was wrong.
Expected rows are written from §11 by hand."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.manager.canary import Key
from tests.support.session import SCRIPT, N, Session
from tests.test_manager import _wrong_position, _wrong_rtt

STEPS = sum(not isinstance(item, str) for item in SCRIPT)  # engine steps of the scripted session


def violations(records):
    return [r for r in records if r["type"] == "violation"]


def test_self_tests_are_counted_and_never_reported():
    plain, tested = Session(), Session(self_test_every=3)
    assert violations(tested.script()) == violations(plain.script()) == []
    st = tested.canary.stats()
    assert st["self_tests"] == STEPS // 3 and st["violations"] == 0
    assert plain.canary.stats()["self_tests"] == 0
    tested.canary.health_check()


def test_a_real_violation_is_reported_as_without_the_self_test():
    key = lambda rs: [(r["step"], r["launch_tag"], r["slot_idx"], r["fail_reason"]) for r in violations(rs)]  # noqa: E731
    plain, tested = Session(), Session(self_test_every=1)
    found = key(tested.script(3, _wrong_rtt))
    assert found == key(plain.script(3, _wrong_rtt)) and found
    assert tested.canary.stats()["violations"] == plain.canary.stats()["violations"]
    assert tested.canary.stats()["self_tests"] == STEPS


def test_the_row_is_the_one_format_md_describes():
    s = Session(self_test_every=2)
    s.play(stop_after=1)  # two steps: the HEAD verify ran twice, its second run is due
    ring, claim = s.canary._ring, int(s.canary.status[abi.STATUS_CLAIM])
    rows = [tuple(r) for r in ring[:claim].tolist()]
    bits = int(abi.FailReason.SELF_TEST | abi.FailReason.VERIFY_POSITION_MISMATCH)
    assert bits == 514
    assert rows == [(int(abi.LaunchTag.HEAD_K_FULL), N, 0, 0x5E1F7E57, 0x5E1F7E57, 0, 2, bits)]


def test_raise_mode_does_not_raise_on_self_tests():
    s = Session(mode="raise", self_test_every=1)
    s.script()
    assert s.canary.stats()["self_tests"] == STEPS


def test_a_record_that_no_longer_looks_bad_fails_the_health_check():
    s = Session(self_test_every=2)
    ctx = s.canary.ctx[Key("HEAD", "FULL", "K", "verify")]
    ctx.self_test_view.host[abi.FIELD_POSITION] = abi.SELF_TEST_POSITION  # a stray write "fixed" it
    s.script()
    assert violations(s.records) == []
    with pytest.raises(kc.KvCanaryError, match=r"self-test: 0 of 3 expected self-test rows arrived.*did not match"):
        s.canary.health_check()


def test_a_lost_self_test_row_fails_the_health_check(monkeypatch):
    from kvcanary.reference import canary as reference
    s = Session(self_test_every=2)
    s.play(stop_after=1)
    s.canary.health_check()
    monkeypatch.setattr(reference, "self_test_rows", lambda *a, **k: np.zeros((0, abi.RING_COLS), np.int64))
    s.play()  # the check stopped writing its rows (a dead detector)
    with pytest.raises(kc.KvCanaryError, match=r"self-test: 1 of \d+ expected self-test rows arrived"):
        s.canary.health_check()


def test_ring_overflow_is_named_when_it_ate_the_self_test_row():
    # step 2's HEAD K write reports a write_position row into the one-row ring before the HEAD K
    # verify's self-test claims a row: that self-test row is lost
    s = Session(ring_capacity=1, self_test_every=1, chain_position_assert=True)
    s.script(2, _wrong_position)
    assert s.canary.stats()["ring_overflow"] > 0
    with pytest.raises(kc.KvCanaryError, match=rf"self-test: [0-{STEPS - 1}] of {STEPS} .*the ring overflowed"):
        s.canary.health_check()


@pytest.mark.parametrize("bad", [-1, 1 << 31, 1.5, "3", True])
def test_bad_self_test_every_is_refused(bad):
    kind = kc.ValidationError if isinstance(bad, int) and not isinstance(bad, bool) else (kc.ValidationError,
                                                                                        kc.ValidationTypeError)
    with pytest.raises(kind, match="self_test_every"):
        Session(self_test_every=bad)


def test_the_self_tests_stat_and_counter_count_rows_seen_not_rows_due(monkeypatch):
    """Catches ``stats()["self_tests"]`` (and the Prometheus counter that follows it) reporting how
    many self-test rows were due instead of how many arrived: the heartbeat an operator alerts on
    would keep rising after the detector died. Here the check stops writing its rows after the
    first two steps (one row seen); rows keep falling due, the stat and the counter stay at 1."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvcanary.reference import canary as reference
    from kvcanary.reporting.metrics import PrometheusMetrics
    s = Session(self_test_every=2)
    registry = prometheus_client.CollectorRegistry()
    PrometheusMetrics(s.canary, registry=registry)
    s.play(stop_after=1)  # two steps: the HEAD K verify's run 2 was due and its row arrived
    assert s.canary.stats()["self_tests"] == 1
    monkeypatch.setattr(reference, "self_test_rows", lambda *a, **k: np.zeros((0, abi.RING_COLS), np.int64))
    s.play()
    s.canary.flush()
    monitor = s.canary.monitor
    assert monitor.self_test.due(monitor.runs(monitor.last[0])) == (2 + STEPS) // 2  # the two steps, then the script
    assert s.canary.stats()["self_tests"] == 1
    assert registry.get_sample_value("kvcanary_self_tests_total") == 1
