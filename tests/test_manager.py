"""KvCanary on the CPU reference: a scripted session stays clean; each fault surfaces in the
right step with the right tag and reason; log vs raise; health check; stats and export."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import kvcanary as kc
from tests.support.session import SCRIPT, Session


def violations(records):
    return [r for r in records if r["type"] == "violation"]


@pytest.mark.parametrize("swa", [False, True])
@pytest.mark.parametrize("hash_mode", ["none", "partial", "all"])
def test_scripted_session_is_clean(swa, hash_mode):
    s = Session(swa=swa, hash_mode=hash_mode, chain_position_assert=True)
    records = s.script()
    assert violations(records) == []
    stats = s.canary.stats()
    written = sum(len(new) for item in SCRIPT if isinstance(item, list) for _, new in item)
    assert stats["verified_slots"] > 100 and stats["protected_tokens"] == written == 45  # once per token
    s.canary.health_check()


def _wrong_rtt(sess, arrays):
    row = 2  # B's cached position 3 now points at A's slot 0
    sess.rtt[row, 3] = sess.rtt[1, 0]


def _zeroed_rtt(sess, arrays):
    sess.rtt[2, 3] = 0  # B's cached position 3 now points at the padding slot 0


@pytest.mark.parametrize("swa", [False, True])
def test_a_real_request_reading_the_padding_slot_is_reported(swa):
    """No slot-0 blind spot (issue 14): the entry itself on slot 0, and its successor whose
    required predecessor is slot 0, are reported (PADDING_SLOT_READ) in the step of the read,
    by HEAD and TAIL, K and V, on the FULL group (and the SWA group when the map sends it there)."""
    recs = violations(Session(swa=swa).script(corrupt_at=3, corrupt=_zeroed_rtt))
    step3 = [r for r in recs if r["step"] == 3 and "padding_slot_read" in r["fail_reason"]]
    full = {(r["launch_tag"], r["slot_idx"], r["position"]) for r in step3 if r["launch_tag"].endswith("FULL")}
    slot4 = None
    for tag in ("HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL"):
        assert (tag, 0, 3) in full, tag  # the entry on slot 0 (its plan position)
        nxt = [s for t, s, p in full if t == tag and p == 4]  # the successor, its predecessor on slot 0
        assert len(nxt) == 1 and nxt[0] != 0
        slot4 = nxt[0]
    assert slot4 is not None


def test_wrong_req_to_token_entry_is_reported_at_head_in_that_step():
    recs = violations(Session().script(corrupt_at=3, corrupt=_wrong_rtt))
    step3 = [r for r in recs if r["step"] == 3]
    assert step3 and {r["launch_tag"] for r in step3} >= {"HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL"}
    assert all("verify_position" in r["fail_reason"] or "verify_chain_hash" in r["fail_reason"] for r in step3)
    assert all(r["step"] >= 3 for r in recs)


def _flip_kv(sess, arrays):
    slot = int(sess.rtt[2, 2])
    sess.k[0][slot, 5] ^= 0x40
    sess.sync_pools()


@pytest.mark.parametrize("hash_mode,caught", [("partial", True), ("all", True), ("none", False)])
def test_flipped_kv_byte_is_reported_at_tail(hash_mode, caught):
    recs = violations(Session(hash_mode=hash_mode).script(corrupt_at=4, corrupt=_flip_kv))
    if not caught:
        assert recs == []  # identity-only mode does not read KV bytes (FAULTS.md coverage)
        return
    assert recs and recs[0]["step"] == 4
    assert {r["launch_tag"] for r in recs} == {"TAIL_K_FULL"}
    assert all(r["fail_reason"] == ["verify_real_kv_hash"] for r in recs)


def _wrong_position(sess, arrays):
    arrays["pos"][-1] += 1  # off by one at a chunk boundary


def test_wrong_position_is_reported_by_the_write_assert_and_next_verify():
    recs = violations(Session(chain_position_assert=True).script(corrupt_at=2, corrupt=_wrong_position))
    assert any(r["step"] == 2 and r["fail_reason"] == ["write_position"] for r in recs)
    assert any(r["step"] > 2 and "verify_position" in r["fail_reason"] for r in recs)


def test_log_mode_logs_each_row(caplog):
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        Session().script(corrupt_at=3, corrupt=_wrong_rtt)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_canary violation:")]
    assert lines and "launch_tag=HEAD_K_FULL" in lines[0]


def test_raise_mode_raises_once_with_every_row():
    s = Session(mode="raise")
    with pytest.raises(kc.CanaryViolationError) as err:
        s.script(corrupt_at=3, corrupt=_wrong_rtt)
    assert len(err.value.violations) >= 3
    assert str(err.value).count("kv_canary violation:") == len(err.value.violations)


def test_mode_none_launches_nothing():
    s = Session(mode="none")
    s.script(corrupt_at=3, corrupt=_wrong_rtt)
    assert s.canary.stats()["verified_slots"] == 0


def test_health_check_fails_when_a_launch_did_not_run():
    s = Session()
    s.script()
    s.canary.health_check()
    s.canary.monitor.expected[0] += 1  # a launch the host enqueued but the device never ran
    s.canary.poll()
    with pytest.raises(kc.KvCanaryError, match="health check failed.*HEAD_K_FULL verify: ran"):
        s.canary.health_check()


def test_overflow_of_verify_capacity_warns():
    s = Session()
    s.canary.plans["FULL"].verify_capacity = 4
    s.canary.plans["FULL"].slot = s.canary.plans["FULL"].slot[:4]
    for name in ("expected_token", "expected_position", "prev_slot"):
        setattr(s.canary.plans["FULL"], name, getattr(s.canary.plans["FULL"], name)[:4])
    with pytest.warns(RuntimeWarning, match="verify was skipped"):
        s.script()
    assert s.canary.stats()["skipped_verifies"] > 0


def _one_request_canary(**kw):
    """(a host canary over 64 slots of 16-byte K and V (``kw`` to KvCanary), the Batch of a step of
    request row 1 (slots 1.. in position order, token = position), its K pool)."""
    n = 64
    k, v = np.zeros((n, 16), np.uint8), np.zeros((n, 16), np.uint8)
    canary = kc.KvCanary(kc.PoolGroup(n, k_sources=[kc.source_from_slots(k)], v_sources=[kc.source_from_slots(v)]),
                         device=None, **{"max_batch": 2, **kw})
    rtt = np.zeros((3, 64), np.int32)
    rtt[1, :40] = np.arange(1, 41)

    def batch(past, new):  # the step's forward: its tokens' K and V land in their slots (a lost store is K14)
        for pos in range(past, past + new):
            k[pos + 1] = np.random.default_rng([pos, 0]).integers(1, 256, 16, dtype=np.uint8)
            v[pos + 1] = np.random.default_rng([pos, 1]).integers(1, 256, 16, dtype=np.uint8)
        return kc.Batch(req_pool_indices=np.array([1]), prefix_lens=np.array([past]), extend_lens=np.array([new]),
                        req_to_token=rtt, input_ids=np.arange(past, past + new),
                        positions=np.arange(past, past + new), out_cache_loc=np.arange(past + 1, past + new + 1))
    return canary, batch, k


def _step(canary, batch, past, new):
    b = batch(past, new)
    canary.before_forward(b)
    canary.after_forward(b)


def test_a_skipped_verify_counts_once_per_step_and_warns_at_the_caller():
    """Catches a skipped verify counted again by every later report of the same plan (it read 1
    after the step, 2 after flush, 4 after two polls, and the Prometheus counter followed) and a
    warning pointing into kvcanary instead of at the line that stepped. docs/format.md defines
    skipped_verifies as steps whose verify was skipped."""
    import warnings
    canary, batch, _ = _one_request_canary(verify_capacity=16)

    def step(past, new):
        _step(canary, batch, past, new)

    step(0, 10)  # 10 cached entries: within the capacity
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(10, 20)  # 10 cached: fine; writes up to position 29
        assert canary.stats()["skipped_verifies"] == 0
        step(30, 1)  # 30 cached entries > 16: skipped
        counts = [canary.stats()["skipped_verifies"]]
        canary.flush()
        counts.append(canary.stats()["skipped_verifies"])
        canary.poll()
        canary.poll()
        counts.append(canary.stats()["skipped_verifies"])
        step(31, 1)  # skipped again: a second step
        canary.flush()
        counts.append(canary.stats()["skipped_verifies"])
    assert counts == [1, 1, 1, 2]
    skips = [w for w in caught if "verify was skipped" in str(w.message)]
    assert len(skips) == 2 and all(w.filename == __file__ for w in skips), [(w.filename, w.lineno) for w in skips]


def test_after_forward_without_before_forward_is_an_error_naming_the_protocol():
    """Catches a lone TAIL misdiagnosed: on a fresh canary it warned twice to raise verify_capacity
    (wrong advice) and the health check passed; after a good step it logged an undecoded field code."""
    import warnings
    canary, batch, _ = _one_request_canary()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no misleading warning on the way
        with pytest.raises(kc.ValidationError, match=r"kv-canary: after_forward\(batch\) needs the same step's "
                                                      r"before_forward\(batch\) first.*Fix: call before_forward"):
            canary.after_forward(batch(0, 10))
        canary.before_forward(batch(0, 10))
        canary.after_forward(batch(0, 10))
        with pytest.raises(kc.ValidationError, match=r"no before_forward since step 1"):
            canary.after_forward(batch(10, 1))
        canary.flush()
    assert canary.stats()["skipped_verifies"] == 0 and canary.stats()["violations"] == 0
    canary.health_check()


def test_before_forward_twice_warns_and_starts_a_new_step():
    """An exception in the forward leaves a HEAD without its TAIL: the next HEAD says so and the
    canary carries on (never an error that would stop every later step)."""
    canary, batch, _ = _one_request_canary()
    canary.before_forward(batch(0, 10))
    with pytest.warns(RuntimeWarning, match=r"before_forward\(\) again without after_forward\(\).*TAIL verify did "
                                             r"not run") as caught:
        canary.before_forward(batch(0, 10))
    assert caught[0].filename == __file__
    canary.after_forward(batch(0, 10))
    canary.before_forward(batch(10, 1))
    canary.after_forward(batch(10, 1))
    canary.flush()
    assert canary.stats()["violations"] == 0
    canary.health_check()


def test_a_batch_that_differs_between_head_and_tail_fails_the_health_check_and_names_its_field(caplog):
    """Catches a health check that passed although a TAIL's batch disagreed with the plan HEAD built
    (its docstring says it fails), and log lines that left the field code undecoded."""
    canary, batch, _ = _one_request_canary()
    for past, new in ((0, 10), (10, 1)):
        canary.before_forward(batch(past, new))
        canary.after_forward(batch(past, new))
    canary.health_check()
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        canary.before_forward(batch(11, 1))
        canary.after_forward(batch(5, 1))  # another batch: 5 cached entries where the plan has 11
        canary.flush()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_canary violation:")]
    assert lines and all(line.endswith(" batch_field=ENTRY_COUNT") and "stored_token=11" in line
                         and "expected_aux=0x0000000000000005" in line for line in lines), lines
    with pytest.raises(kc.KvCanaryError, match=r"health check failed.*disagreed with the plan built at HEAD: 2 "
                                                r"BATCH_INDEX_OUT_OF_RANGE rows with batch_field=ENTRY_COUNT"):
        canary.health_check()


def test_sweep_finds_idle_corruption():
    s = Session(hash_mode="all")
    s.script()
    slots = [int(x) for x in s.rtt[2, :s.lens[2]]]
    prev = [-1] + slots[:-1]
    s.canary.sweep(slots, list(range(len(slots))), prev)
    assert violations(s.records) == []
    s.v[1][slots[4], 60] ^= 1
    s.canary.sweep(slots, list(range(len(slots))), prev)
    recs = violations(s.records)
    assert [(r["launch_tag"], r["slot_idx"], r["fail_reason"]) for r in recs] == [("SWEEP_V_FULL", slots[4], ["verify_real_kv_hash"])]


def test_export_to_file(tmp_path):
    path = tmp_path / "canary.jsonl"
    s = Session()
    s.canary = None
    from kvcanary.manager.canary import KvCanary, PoolGroup
    c = KvCanary(PoolGroup(64), export=str(path), stats_every=1)
    z = np.zeros(1, np.int64)
    b = kc.Batch(np.ones(1, np.int64), z, np.ones(1, np.int64), np.ones((2, 4), np.int32), z, z, np.ones(1, np.int64))
    c.before_forward(b)
    c.after_forward(b)
    c.reporter.export.close()
    lines = path.read_text().splitlines()
    assert lines and '"type": "stats"' in lines[-1]


def test_sweep_chains_walks_radix_paths():
    s = Session(hash_mode="partial")
    s.script()
    paths = [s.rtt[2, :s.lens[2]], s.rtt[3, :s.lens[3]]]  # C shares A's first 6 slots
    s.canary.sweep_chains(paths)
    assert violations(s.records) == []
    s.rtt[3, 2], s.rtt[3, 3] = s.rtt[3, 3], s.rtt[3, 2]  # two slots swapped in a cached path
    s.canary.sweep_chains([s.rtt[3, :s.lens[3]]])
    recs = violations(s.records)
    assert recs and {r["launch_tag"] for r in recs} <= {"SWEEP_K_FULL", "SWEEP_V_FULL"}
    assert all({"verify_position", "verify_chain_hash"} & set(r["fail_reason"]) for r in recs)


@pytest.mark.parametrize("mode", ["raise", "log"])
def test_after_a_ring_overflow_self_test_rows_alone_report_nothing(mode, caplog):
    """Catches a reporter whose early return tested the running overflow total instead of this
    report's new losses: once the ring had overflowed, every later step whose only new row was the
    self-test's raised an empty CanaryViolationError (raise) or logged "ring full" again (log). Here
    a step overflows a 4-row ring, then clean steps with the self-test on report nothing new
    (raise, log, export), while the self-test heartbeat keeps rising."""
    records = []
    canary, batch, k = _one_request_canary(mode=mode, ring_capacity=4, self_test_every=1, export=records.append)

    def step(past, new):
        _step(canary, batch, past, new)

    step(0, 10)
    k[1:11] ^= 1  # 10 cached tokens' K bytes change: more violations than the ring holds
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        if mode == "raise":
            with pytest.raises(kc.CanaryViolationError):
                step(10, 1)
        else:
            step(10, 1)
    k[1:11] ^= 1
    before = canary.stats()
    assert before["ring_overflow"] > 0
    reported = (len(caplog.records), len([r for r in records if r["type"] == "violation"]))
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        for past in range(11, 14):
            step(past, 1)  # clean: only the self-test's known-bad row is new
        canary.flush()
    after = canary.stats()
    assert (len(caplog.records), len([r for r in records if r["type"] == "violation"])) == reported
    assert after["ring_overflow"] == before["ring_overflow"] and after["violations"] == before["violations"]
    assert after["self_tests"] >= before["self_tests"] + 3
