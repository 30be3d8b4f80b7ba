"""Canary records that travel with their KV (issue 14): export -> bytes -> import on another
canary at other slots in another order is clean at the first read; every way a transfer can go
wrong (torn, partial, dropped, reordered, duplicated, wrong destination) is caught at the first
read with no extra kernel; an incompatible descriptor or altered bytes are refused."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import FailReason
from kvcanary.manager.canary import KvCanary, PoolGroup
from kvcanary.ops.records import CanaryRecords

N, BPT, LEN = 96, 32, 6


class Side:
    """One engine (its own KV pool and canary); request row 1 holds a sequence of LEN tokens."""

    def __init__(self, hash_mode="partial", halves=("K", "V"), seed=0):
        rng = np.random.default_rng(seed)
        self.k = rng.integers(0, 256, (N, BPT), dtype=np.uint8)
        self.v = rng.integers(0, 256, (N, BPT), dtype=np.uint8)
        src = lambda a: [kc.source_from_slots(a)]  # noqa: E731
        group = PoolGroup(N, k_sources=src(self.k), v_sources=src(self.v) if "V" in halves else (), halves=halves)
        self.records = []
        self.canary = KvCanary(group, hash_mode=hash_mode, max_batch=2, verify_capacity=256, export=self.records.append)
        self.rtt = np.zeros((2, 32), np.int32)
        self.tokens = list(range(100, 100 + LEN))

    def prefill(self, slots):
        self.rtt[1, :LEN] = slots
        b = kc.Batch(np.array([1]), np.array([0]), np.array([LEN]), self.rtt.copy(), np.array(self.tokens),
                     np.arange(LEN), np.array(slots, np.int64))
        self.canary.before_forward(b)
        self.canary.after_forward(b)

    def decode(self, slots, new_slot):
        """The first read of the moved prefix (at ``slots``): verify it, write one more token."""
        self.rtt[1, :LEN] = slots
        self.rtt[1, LEN] = new_slot
        b = kc.Batch(np.array([1]), np.array([LEN]), np.array([1]), self.rtt.copy(), np.array([999]),
                     np.array([LEN]), np.array([new_slot], np.int64))
        self.canary.before_forward(b)
        self.canary.after_forward(b)
        self.canary.flush()
        return [r for r in self.records if r["type"] == "violation"]


def move_kv(src: Side, dst: Side, src_slots, dst_slots):
    dst.k[dst_slots] = src.k[src_slots]
    dst.v[dst_slots] = src.v[src_slots]


SRC, DST = [5, 6, 7, 8, 9, 10], [40, 33, 71, 12, 55, 60]


def transfer(fault=None):
    a, b = Side(seed=1), Side(seed=2)
    a.prefill(SRC)
    rec = a.export_records_bytes = a.canary.export_records(SRC).to_bytes()
    recs = CanaryRecords.from_bytes(rec)
    src_slots, dst_slots = list(SRC), list(DST)
    if fault == "torn":            # the KV copy of one slot is half new, half stale
        move_kv(a, b, src_slots, dst_slots)
        b.k[dst_slots[2], : BPT // 2] ^= 0x5A
        b.canary.import_records(dst_slots, recs)
    elif fault == "partial":       # the records of the last two slots never arrive
        move_kv(a, b, src_slots, dst_slots)
        b.canary.import_records(dst_slots[:4], recs.take(slice(0, 4)))
    elif fault == "dropped":       # a whole slot's KV and record are lost
        move_kv(a, b, src_slots[:3] + src_slots[4:], dst_slots[:3] + dst_slots[4:])
        b.canary.import_records(dst_slots[:3] + dst_slots[4:], recs.take([0, 1, 2, 4, 5]))
    elif fault == "reordered":     # KV in order, records swapped between two slots
        move_kv(a, b, src_slots, dst_slots)
        b.canary.import_records(dst_slots, recs.take([0, 2, 1, 3, 4, 5]))
    elif fault == "duplicated":    # one token's KV and record land twice, the next one's never
        move_kv(a, b, src_slots[:4] + [src_slots[3]] + src_slots[5:], dst_slots)
        b.canary.import_records(dst_slots, recs.take([0, 1, 2, 3, 3, 5]))
    elif fault == "wrong destination":  # records placed at other slots than the KV
        move_kv(a, b, src_slots, dst_slots)
        b.canary.import_records([41, 34, 72, 13, 56, 61], recs)
    else:
        move_kv(a, b, src_slots, dst_slots)
        b.canary.import_records(dst_slots, recs)
    return b.decode(dst_slots, 80)


def test_records_travel_clean_to_other_slots_in_another_order():
    assert transfer() == []


@pytest.mark.parametrize("fault", ["torn", "partial", "dropped", "reordered", "duplicated", "wrong destination"])
def test_every_transfer_fault_is_caught_at_the_first_read(fault):
    got = transfer(fault)
    assert got, f"{fault}: not caught"
    assert {v["step"] for v in got} == {0}, "reported in the step of the first read"
    bits = 0
    for v in got:
        bits |= v["fail_reason_bits"]
    if fault == "torn":
        assert bits & FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    else:
        assert bits & (FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH)


def test_records_round_trip_bytes_and_take():
    a = Side()
    a.prefill(SRC)
    r = a.canary.export_records(SRC)
    assert r.records.shape == (4, LEN, 4) and r.descriptor["buffers"] == ["HEAD_K", "TAIL_K", "HEAD_V", "TAIL_V"]
    back = CanaryRecords.from_bytes(r.to_bytes())
    np.testing.assert_array_equal(back.records, r.records)
    assert back.descriptor == r.descriptor
    np.testing.assert_array_equal(r.take([2, 0]).records, r.records[:, [2, 0]])
    words = a.canary.buffers()["TAIL", "FULL", "K"].view(np.int64)  # TAIL K row of slot 7 = the record
    np.testing.assert_array_equal(r.records[1, 2], words[7, :4])


@pytest.mark.parametrize("other", [dict(hash_mode="all"), dict(hash_mode="none"), dict(halves=("K",))])
def test_an_incompatible_descriptor_is_refused(other):
    a, b = Side(), Side(**other)
    a.prefill(SRC)
    with pytest.raises(kc.ValidationError, match=r"^kv-canary: imported canary records must have this canary's .*Fix:"):
        b.canary.import_records(DST, a.canary.export_records(SRC))


def test_altered_or_foreign_bytes_are_refused():
    a = Side()
    a.prefill(SRC)
    data = bytearray(a.canary.export_records(SRC).to_bytes())
    data[40] ^= 1
    with pytest.raises(kc.ValidationError, match="checksum"):
        CanaryRecords.from_bytes(bytes(data))
    with pytest.raises(kc.ValidationError, match="must start with"):
        CanaryRecords.from_bytes(b"not records at all, just bytes")


def test_bad_slots_and_counts_are_refused():
    a = Side()
    a.prefill(SRC)
    with pytest.raises(kc.ValidationError, match=r"slots must lie in \[0, 96\), got 96"):
        a.canary.export_records([5, 96])
    for scalar in (5, np.int64(5), np.array(5)):  # one slot is [5]: a scalar is refused on every backend
        with pytest.raises(kc.ValidationError, match=r"got the scalar 5 .*Fix: pass .*\[5\] for one slot"):
            a.canary.export_records(scalar)
    r = a.canary.export_records(SRC)
    with pytest.raises(kc.ValidationError, match="one record per slot"):
        a.canary.import_records([1, 2], r)
    with pytest.raises(kc.ValidationTypeError, match="CanaryRecords"):
        a.canary.import_records(SRC, r.records)


def test_a_subset_round_trips_as_bytes_and_imports_clean():
    """Catches a subset (``take``) whose descriptor kept the source's record count: it still
    imported in-process, but its bytes could not be read back (from_bytes sized the records by the
    descriptor), so a partial transfer could never cross a process. Here the first 4 of 6 records
    travel as bytes to another canary, land at other slots and read clean; the remaining 2 travel
    the same way on their own."""
    a, b = Side(seed=1), Side(seed=2)
    a.prefill(SRC)
    exported = a.canary.export_records(SRC)
    head, tail = exported.take(slice(0, 4)), exported.take([4, 5])
    for part, n in ((head, 4), (tail, 2)):
        back = CanaryRecords.from_bytes(part.to_bytes())
        assert back.n == n == back.descriptor["n"]
        np.testing.assert_array_equal(back.records, exported.records[:, :4] if n == 4 else exported.records[:, 4:])
    dst = DST[:4]
    move_kv(a, b, SRC[:4], dst)
    b.canary.import_records(dst, CanaryRecords.from_bytes(head.to_bytes()))
    b.rtt[1, :4] = dst
    b.rtt[1, 4] = 80
    step = kc.Batch(np.array([1]), np.array([4]), np.array([1]), b.rtt.copy(), np.array([104]), np.array([4]),
                    np.array([80], np.int64))  # the sequence's own token at position 4
    b.canary.before_forward(step)
    b.canary.after_forward(step)
    b.canary.flush()
    assert [r for r in b.records if r["type"] == "violation"] == []
    assert b.canary.stats()["verified_slots"] == 4 * 4  # the 4 imported records, HEAD and TAIL, K and V
