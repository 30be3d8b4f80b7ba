"""Per-request verdicts (docs/format.md §5.7) on the CPU reference: which request of a step's batch
a detection fails, with its bits and the slots its rows name. Expected batch indices come from
the scripted session (tests/support/session.py) by hand: which request reads the slot a test breaks."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.reporting.verdicts import FailedRequest
from tests.support.session import Session


def failed_by_step(records) -> dict:
    """{step: {batch_index: (reasons, slots)}} from the failed_request records a canary exported."""
    out: dict = {}
    for r in records:
        if r["type"] == "failed_request":
            out.setdefault(r["step"], {})[r["batch_index"]] = (r["reasons"], tuple(r["slots"]))
    return out


def _flip_b_cached_kv(sess, arrays):
    sess.flipped = int(sess.rtt[2, 2])  # B's cached position 2; step 3's batch: A 0, B 1, C 2
    sess.k[0][sess.flipped, 5] ^= 0x40
    sess.sync_pools()


def _flip_shared_kv(sess, arrays):
    sess.flipped = int(sess.rtt[1, 4])  # A's position 4, shared by C (rows 1 and 3: indices 0 and 2)
    sess.k[1][sess.flipped, 9] ^= 0x01
    sess.sync_pools()


def played(corrupt, **kw) -> tuple[Session, dict]:
    """The scripted session with ``corrupt`` applied at step 3, flushed: (session, failed_by_step)."""
    s = Session(**kw)
    s.play(corrupt_at=3, corrupt=corrupt)
    s.canary.flush()
    return s, failed_by_step(s.records)


def test_one_request_among_many_fails_alone_with_its_slot():
    s, got = played(_flip_b_cached_kv)
    # B reads its cached position 2 in step 3 and every later step it runs in: TAIL's real-KV check.
    # Step 3's batch is A, B, C (B index 1); from step 4 (A finished) it is B, C, D (B index 0)
    assert got == {3: {1: ("verify_real_kv_hash", (s.flipped,))},
                   **{k: {0: ("verify_real_kv_hash", (s.flipped,))} for k in (4, 5, 6)}}


def test_two_requests_sharing_a_corrupted_block_both_fail():
    s, got = played(_flip_shared_kv)
    assert got[3] == {0: ("verify_real_kv_hash", (s.flipped,)), 2: ("verify_real_kv_hash", (s.flipped,))}


def test_a_fault_no_request_reads_this_step_fails_none_until_one_reads_it():
    s = Session()
    s.step([(1, list(range(100, 110))), (2, list(range(200, 204)))])  # A and B prefill
    s.k[0][int(s.rtt[2, 1]), 3] ^= 0x08   # B's cached KV, while only A runs
    s.sync_pools()
    s.step([(1, [110])])                   # step 1: A alone, B not in the batch
    s.step([(1, [111]), (2, [204])])       # step 2: B reads it (batch index 1)
    s.canary.flush()
    got = failed_by_step(s.records)
    assert 1 not in got and got[2] == {1: ("verify_real_kv_hash", (int(s.rtt[2, 1]),))}


def test_a_wrong_new_token_fails_the_request_that_writes_it():
    def wrong_position(sess, arrays):
        arrays["pos"][-1] += 1  # the last new token of step 2's batch: B's (batch index 1)
    s = Session(chain_position_assert=True)
    s.play(corrupt_at=2, corrupt=wrong_position)
    s.canary.flush()
    got = failed_by_step(s.records)
    assert set(got[2]) == {1} and got[2][1][0] == "write_position"
    assert got[2][1][1] == (int(s.rtt[2, 13]),)  # the slot the bad token was written to


def test_a_request_reading_the_padding_slot_fails_and_a_stray_padding_token_fails_none():
    def zero_rtt(sess, arrays):
        sess.rtt[2, 3] = 0  # B's cached position 3 -> the padding slot (step 3: B is batch index 1)
    s = Session()
    s.play(corrupt_at=3, corrupt=zero_rtt)
    s.canary.flush()
    got = failed_by_step(s.records)
    assert set(got[3]) == {1} and "padding_slot_read" in got[3][1][0]

    s = Session()  # a padding lane past the batch's tokens on a real slot: no one request owns it
    s.step([(1, list(range(100, 104)))])
    arrays = s.plan_step([(1, [104])])
    loc = np.append(arrays["loc"], 77)
    b = kc.Batch(arrays["rows"], arrays["prefix"], arrays["extend"], s.rtt.copy(), np.append(arrays["ids"], 0),
                 np.append(arrays["pos"], 0), loc, swa_out_cache_loc=loc)
    with pytest.raises(kc.ValidationError, match=r"a padding token past sum\(extend_lens\)"):
        s.canary.before_forward(b)  # the host checks values first; on the device: tests/gpu/emulated/test_verdicts_gpu.py


def test_verdict_words_and_count_are_the_step_s_and_reset_at_the_next_head():
    s = Session()
    s.play(corrupt_at=3, corrupt=_flip_shared_kv, stop_after=3)
    words, count = np.array(s.canary.verdicts), int(s.canary.failed_count[0])
    assert words.shape == (8,) and count == 2
    assert words[0] == words[2] == int(abi.FailReason.VERIFY_REAL_KV_HASH_MISMATCH) and words[1] == 0
    assert not words[3:].any()
    s.sync_pools()
    arrays = s.plan_step([(2, [299])])  # a step of B alone: HEAD resets the words
    b = kc.Batch(arrays["rows"], arrays["prefix"], arrays["extend"], s.rtt.copy(), arrays["ids"], arrays["pos"],
                 arrays["loc"], swa_out_cache_loc=arrays["loc"])
    s.canary.before_forward(b)
    assert not np.array(s.canary.verdicts).any() and int(s.canary.failed_count[0]) == 0


def test_failed_requests_come_once_per_step_and_never_raise_in_fail_request_mode():
    s = Session(mode="fail_request")
    s.play(corrupt_at=3, corrupt=_flip_shared_kv, stop_after=3)
    first = s.canary.failed_requests()
    assert [(f.step, f.batch_index) for f in first] == [(3, 0), (3, 2)]
    assert all(isinstance(f, FailedRequest) and f.reasons == abi.FailReason.VERIFY_REAL_KV_HASH_MISMATCH
               for f in first)
    assert s.canary.failed_requests() == []  # the same snapshot again: already handed over
    s.canary.poll()
    assert s.canary.failed_requests() == []  # a step that ran no HEAD has no new verdicts
    assert any(r["type"] == "violation" for r in s.records)  # reported as in log mode


def test_a_failed_request_has_a_log_line_and_an_export_record(caplog):
    s = Session()
    with caplog.at_level("WARNING", logger="kvcanary"):
        s.play(corrupt_at=3, corrupt=_flip_b_cached_kv, stop_after=3)
    assert any(m.startswith("kv_canary failed request: step=3 batch_index=1 fail_reason=verify_real_kv_hash")
               for m in caplog.messages)
    rec = next(r for r in s.records if r["type"] == "failed_request")
    assert rec == {"type": "failed_request", "step": 3, "batch_index": 1, "reasons": "verify_real_kv_hash",
                   "fail_reason_bits": 4, "slots": [s.flipped]}


def _batch(s, arrays) -> kc.Batch:
    return kc.Batch(arrays["rows"], arrays["prefix"], arrays["extend"], s.rtt.copy(), arrays["ids"], arrays["pos"],
                    arrays["loc"], swa_out_cache_loc=arrays["loc"])


def _head_and_tail_faults(s):
    """Step 3's batch A (index 0), B (index 1): A's cached position 3 on the padding slot (HEAD's plan
    finds it), B's cached KV flipped (only TAIL, which reads real KV, finds it)."""
    s.rtt[1, 3] = 0
    s.k[0][int(s.rtt[2, 2]), 5] ^= 0x40
    s.sync_pools()
    return s.plan_step([(1, [114]), (2, [214])])


def test_a_snapshot_between_head_and_tail_hands_over_nothing_and_tail_only_requests_still_fail():
    s = Session(mode="fail_request")
    s.play(stop_after=2)
    arrays = _head_and_tail_faults(s)
    b = _batch(s, arrays)
    s.canary.before_forward(b)
    s.canary.poll()                           # a snapshot between the step's HEAD and its TAIL
    assert s.canary.failed_requests() == []   # HEAD's verdicts are not the step's yet
    s.forward(arrays)
    s.canary.after_forward(b)
    got = {f.batch_index: f.reasons for f in s.canary.failed_requests()}
    assert got == {0: abi.FailReason.PADDING_SLOT_READ, 1: abi.FailReason.VERIFY_REAL_KV_HASH_MISMATCH}


def test_a_step_whose_forward_raised_does_not_stop_later_failed_requests():
    """HEAD without its TAIL (the forward raised; the next HEAD warns and starts a new step): the
    device's HEAD and TAIL run counts differ from then on, and the next step's failed requests
    still come, once, in the step that read the corruption (before the fix: never again)."""
    s = Session(mode="fail_request")
    s.play(stop_after=2)
    arrays = s.plan_step([(3, [300, 301])])   # a new request C alone, never scheduled again
    s.canary.before_forward(_batch(s, arrays))
    s.forward(arrays)                         # ... and raised: no after_forward
    s.k[0][int(s.rtt[2, 2]), 5] ^= 0x40      # B's cached KV (batch index 1 below)
    arrays = s.plan_step([(1, [115]), (2, [215])])
    b = _batch(s, arrays)
    with pytest.warns(RuntimeWarning, match="before_forward\\(\\) again without after_forward"):
        s.canary.before_forward(b)
    s.canary.poll()
    assert s.canary.failed_requests() == []   # still between that HEAD and its TAIL
    s.forward(arrays)
    s.canary.after_forward(b)
    got = s.canary.failed_requests()
    assert [(f.batch_index, f.reasons) for f in got] == [(1, abi.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)]
    assert s.canary.failed_requests() == []


def test_verify_entries_skipped_without_an_entry_count_row_fail_the_health_check():
    """A TAIL given an empty batch after a HEAD that planned cached entries: no request is left to
    carry an ENTRY_COUNT row, every planned entry is skipped, and the health check says so."""
    s = Session()
    s.play(stop_after=2)
    arrays = s.plan_step([(1, [114]), (2, [214])])
    s.canary.before_forward(_batch(s, arrays))
    s.forward(arrays)
    e = np.zeros(0, np.int64)
    s.canary.after_forward(kc.Batch(e, e, e, s.rtt.copy(), e, e, e, swa_out_cache_loc=e))
    s.canary.flush()
    planned = 2 * (14 + 14)  # A's 14 and B's 14 cached tokens, in each half (K, V)
    assert s.canary.stats()["unattributed"] == planned
    with pytest.raises(kc.KvCanaryError, match=f"and {planned} verify entries skipped without a row"):
        s.canary.health_check()


def test_a_batch_with_more_cached_entries_than_its_plan_fails_the_health_check_also_when_its_rows_are_lost():
    """TAIL's batch gives request B one cached token more than the plan HEAD built: no planned entry
    is skipped, the extra one is never verified, and only B's ENTRY_COUNT rows say so. With those rows
    lost to a full ring (HEAD's own violation took the one row), the health check still fails
    (before the fix: it passed, nothing left to show the batches disagreed)."""
    for capacity, named in ((4096, r"2 BATCH_INDEX_OUT_OF_RANGE rows with batch_field=ENTRY_COUNT"),
                            (1, r"violation rows were lost to a full ring, so a launch whose batch disagreed")):
        s = Session(ring_capacity=capacity)
        s.play(stop_after=2)
        arrays = s.plan_step([(1, [114]), (2, [214])])
        good = s.rtt.copy()
        s.rtt[1, 3] = s.rtt[1, 4]  # A's cached position 3 names position 4's slot: HEAD reports it first
        s.canary.before_forward(_batch(s, arrays))
        s.rtt[:] = good
        s.forward(arrays)
        prefix = arrays["prefix"].copy()
        prefix[1] += 1             # B: one cached token more than HEAD planned
        s.canary.after_forward(kc.Batch(arrays["rows"], prefix, arrays["extend"], s.rtt.copy(), arrays["ids"],
                                        arrays["pos"], arrays["loc"], swa_out_cache_loc=arrays["loc"]))
        s.canary.flush()
        assert s.canary.stats()["unattributed"] == 0  # nothing skipped: every planned entry still has its request
        with pytest.raises(kc.KvCanaryError, match=named):
            s.canary.health_check()
