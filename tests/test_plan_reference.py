"""The reference plan builder (docs/format.md §8) on hand-written batches, and plans driving write/verify."""

import numpy as np
import pytest

from kvcanary.abi import SEED_INVALID, BatchField, FailReason
from kvcanary.reference.canary import verify, write
from kvcanary.reference.plan import (
    VerifyPlanArrays,
    WritePlanArrays,
    build_plan,
    fill_plan,
)


def rtt_of(rows):
    """req_to_token int32 [len(rows), 8] with the given row prefixes, zero-padded."""
    out = np.zeros((len(rows), 8), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


RTT = rtt_of([[], [10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37]])


def plan(rpi, prefix, extend, *, verify_capacity=32, write_req_capacity=8, rtt=RTT, **kw):
    a = lambda x: np.array(x, dtype=np.int64)  # noqa: E731
    return build_plan(req_pool_indices=a(rpi), prefix_lens=a(prefix), extend_lens=a(extend),
                      req_to_token=rtt, verify_capacity=verify_capacity,
                      write_req_capacity=write_req_capacity, **kw)


def entries(v):
    n = int(v.num_valid[0])
    return list(zip(v.slot[:n].tolist(), v.expected_token[:n].tolist(),
                    v.expected_position[:n].tolist(), v.prev_slot[:n].tolist()))


def test_single_prefill_without_prefix():
    v, w = plan([1], [0], [5])
    assert entries(v) == [] and (v.num_valid[0], v.enable[0]) == (0, 1)
    assert w.offsets[:2].tolist() == [0, 5] and w.seed[:1].tolist() == [-1] and w.num_valid_reqs[0] == 1
    assert v.slot.dtype == np.int64 and v.num_valid.dtype == np.int32 and w.num_valid_reqs.dtype == np.int32
    assert len(v.slot) == 32 and len(w.offsets) == 9 and len(w.seed) == 8


def test_prefill_with_cached_prefix():
    v, w = plan([1], [3], [2])
    assert entries(v) == [(10, -1, 0, -1), (11, -1, 1, 10), (12, -1, 2, 11)]
    assert w.offsets[:2].tolist() == [0, 2] and w.seed[0] == 12


def test_decode_batch():
    v, w = plan([1, 2], [4, 2], [1, 1])
    assert entries(v) == [(10, -1, 0, -1), (11, -1, 1, 10), (12, -1, 2, 11), (13, -1, 3, 12),
                          (20, -1, 0, -1), (21, -1, 1, 20)]
    assert w.offsets[:3].tolist() == [0, 1, 2] and w.seed[:2].tolist() == [13, 21]
    assert (v.num_valid[0], v.enable[0], w.num_valid_reqs[0]) == (6, 1, 2)


def batch_row(request, field, value, bound, slot=-1, tag=0):
    """A BATCH_INDEX_OUT_OF_RANGE ring row as abi.BatchField defines its columns."""
    return (tag, slot, request, value, int(field), 0, bound, int(FailReason.BATCH_INDEX_OUT_OF_RANGE))


def test_rows_outside_the_request_pool_are_rejected_not_padding():
    # docs/format.md §8: only row 0 is padding; -1 and 9 (past req_to_token's 4 rows) are engine bugs:
    # reported, no entries, their tokens owned but never stamped (seed SEED_INVALID + field)
    rows = []
    v, w = plan([0, 2, -1, 3, 9], [3, 2, 2, 1, 4], [1, 3, 1, 0, 2], report=rows.append)
    assert entries(v) == [(20, -1, 0, -1), (21, -1, 1, 20), (30, -1, 0, -1)]
    assert w.offsets[:6].tolist() == [0, 0, 3, 4, 4, 6]  # padding owns none, rejected rows keep theirs
    bad = SEED_INVALID + int(BatchField.REQ_POOL_INDEX)
    assert w.seed[:5].tolist() == [-1, 21, bad, -1, bad]  # extend 0 gives no seed either
    assert w.num_valid_reqs[0] == 5
    assert sorted(map(tuple, np.concatenate(rows).tolist())) == sorted([
        batch_row(2, BatchField.REQ_POOL_INDEX, -1, 4), batch_row(4, BatchField.REQ_POOL_INDEX, 9, 4),
        batch_row(0, BatchField.PADDING_ORDER, 0, 2)])


def test_lengths_out_of_range_are_rejected_and_reported():
    rows = []
    v, w = plan([1, 2, 3], [-4, 99, 2], [-2, 1, -1], report=rows.append)
    assert entries(v) == []  # nothing is read for a rejected request
    assert w.offsets[:4].tolist() == [0, 0, 1, 1]
    assert w.seed[:3].tolist() == [SEED_INVALID + int(BatchField.PREFIX_LEN)] * 2 + [SEED_INVALID + int(BatchField.EXTEND_LEN)]
    assert sorted(map(tuple, np.concatenate(rows).tolist())) == sorted([
        batch_row(0, BatchField.PREFIX_LEN, -4, 8), batch_row(1, BatchField.PREFIX_LEN, 99, 8),
        batch_row(2, BatchField.EXTEND_LEN, -1, 0)])


def test_tokens_against_the_write_ranges():
    rows = []
    loc = np.array([11, 12, 13, -1, 0, 17], np.int64)   # 3 owned tokens, then -1 and 0 padding, then 17
    plan([1, 0], [0, 0], [3, 1], out_cache_loc=loc, report=rows.append)
    assert np.concatenate(rows).tolist() == [list(batch_row(-1, BatchField.TOKENS_UNOWNED, 5, 3, slot=17))]
    rows.clear()
    plan([1, 2], [0, 0], [3, 4], out_cache_loc=loc, report=rows.append)
    assert np.concatenate(rows).tolist() == [list(batch_row(-1, BatchField.TOKENS_SHORT, 7, 6))]
    rows.clear()
    plan([1, 0], [0, 0], [3, 1], out_cache_loc=loc[:5], report=rows.append)  # padding only: silent
    assert np.concatenate(rows).tolist() == []


def test_swa_window_clipping_and_map():
    swa_map = np.full(34, 0, dtype=np.int64)
    swa_map[[30, 31, 32, 33]] = [5, 6, 7, 8]  # 34..37 are outside the map
    v, w = plan([3, 1], [6, 1], [1, 1], swa_window=3, swa_map=swa_map)
    assert entries(v) == [(8, -1, 3, 7), (-2, -1, 4, 8), (-2, -1, 5, -2), (0, -1, 0, -1)]
    assert w.seed[:2].tolist() == [-2, 0]
    v, _ = plan([3], [2], [1], swa_window=3, swa_map=swa_map)  # window wider than the prefix
    assert entries(v) == [(5, -1, 0, -1), (6, -1, 1, 5)]
    v, _ = plan([3], [6], [1], swa_window=2)  # identity map
    assert entries(v) == [(34, -1, 4, 33), (35, -1, 5, 34)]


def test_expected_token_pool_with_offset():
    pool = np.arange(4 * 8, dtype=np.int64).reshape(4, 8) + 1000
    lens = np.array([4, 5], dtype=np.int64)
    v, _ = plan([1, 2], [5, 3], [1, 1], expected_pool=pool, expected_valid_lens=lens)
    assert [e[1] for e in entries(v)] == [1008, 1009, 1010, 1011, -1, 1016, 1017, 1018]
    v, _ = plan([1, 2], [5, 3], [1, 1], expected_pool=pool, expected_valid_lens=lens,
                expected_token_offset=1)
    assert [e[1] for e in entries(v)] == [1009, 1010, 1011, -1, -1, 1017, 1018, 1019]
    v, _ = plan([1], [3], [1], expected_pool=pool, expected_valid_lens=np.array([99]),
                expected_token_offset=-1)
    assert [e[1] for e in entries(v)] == [-1, 1008, 1009]


def test_overflow_by_one_disables_verify():
    v, w = plan([1, 2], [4, 2], [1, 1], verify_capacity=6)
    assert (v.num_valid[0], v.enable[0]) == (6, 1)
    v, w = plan([1, 2], [4, 2], [1, 1], verify_capacity=5)
    assert (v.num_valid[0], v.enable[0]) == (5, 0)
    assert not v.slot.any() and not v.prev_slot.any()  # no entry written
    assert w.offsets[:3].tolist() == [0, 1, 2] and w.seed[:2].tolist() == [13, 21]


def test_batch_larger_than_write_capacity_raises():
    with pytest.raises(ValueError, match=r"^kv-canary: .*3.*2"):
        plan([1, 2, 3], [1, 1, 1], [1, 1, 1], write_req_capacity=2)
    vp, wp = VerifyPlanArrays.zeros(8), WritePlanArrays.zeros(2)
    vp.slot[:] = 7
    with pytest.raises(ValueError):
        fill_plan(verify=vp, write=wp, req_pool_indices=np.array([1, 2, 3]), prefix_lens=np.ones(3, np.int64),
                  extend_lens=np.ones(3, np.int64), req_to_token=RTT)
    assert (vp.slot == 7).all() and vp.num_valid[0] == 0  # nothing written


class Sink:
    def __init__(self, num_slots):
        self.canary = np.zeros((num_slots, 32), dtype=np.uint8)
        self.kw = dict(ring=np.zeros((16, 8), np.int64), write_index=np.zeros(1, np.int32),
                       kernel_run_counter=np.zeros(1, np.int64), slot_run_counter=np.zeros(1, np.int64),
                       sources=[])

    def verify(self, v, tag=0):
        verify(canary=self.canary, slot=v.slot, expected_token=v.expected_token,
               expected_position=v.expected_position, prev_slot=v.prev_slot, num_valid=v.num_valid,
               enable=v.enable, tag=tag, check_expected_token=True, **self.kw)

    def write(self, w, ids, positions, locs, tag=2):
        a = lambda x: np.array(x, dtype=np.int64)  # noqa: E731
        write(canary=self.canary, offsets=w.offsets, seed=w.seed, num_valid_reqs=w.num_valid_reqs,
              input_ids=a(ids), positions=a(positions), out_cache_loc=a(locs), tag=tag, **self.kw)

    def rows(self):
        return self.kw["ring"][:min(int(self.kw["write_index"][0]), 16)].tolist()


def test_plans_drive_write_then_verify_clean():
    sink = Sink(64)
    pool = np.zeros((4, 8), np.int64)
    pool[1, :5], pool[2, :3] = [5, 6, 7, 8, 9], [1, 2, 3]
    # Step 1: prefill both requests (no prefix).
    _, w = plan([1, 2], [0, 0], [3, 2])
    sink.write(w, [5, 6, 7, 1, 2], [0, 1, 2, 0, 1], [10, 11, 12, 20, 21])
    # Step 2: decode one token each, verifying the prefix first, with expected tokens.
    v, w = plan([1, 2], [3, 2], [1, 1], expected_pool=pool, expected_valid_lens=np.array([5, 3]))
    sink.verify(v)
    sink.write(w, [8, 3], [3, 2], [13, 22])
    v, _ = plan([1, 2], [4, 3], [1, 1], expected_pool=pool, expected_valid_lens=np.array([5, 3]))
    sink.verify(v)
    assert sink.rows() == [] and sink.kw["slot_run_counter"][0] == 5 + 5 + 2 + 7
    pool[2, 1] = 99  # the pool now disagrees with what was stored at position 1
    v, _ = plan([1, 2], [4, 3], [1, 1], expected_pool=pool, expected_valid_lens=np.array([5, 3]))
    sink.verify(v)
    assert [(r[1], r[4], r[7]) for r in sink.rows()] == [(21, 99, 32)]


def test_shrinking_batch_does_not_read_stale_entries():
    sink = Sink(64)
    _, w = plan([1, 3], [0, 0], [5, 8])
    sink.write(w, list(range(13)), list(range(5)) + list(range(8)), [10, 11, 12, 13, 14] + list(range(30, 38)))
    vp, wp = VerifyPlanArrays.zeros(16), WritePlanArrays.zeros(4)
    kw = dict(req_to_token=RTT, verify=vp, write=wp)
    a = lambda x: np.array(x, dtype=np.int64)  # noqa: E731
    fill_plan(req_pool_indices=a([1, 3]), prefix_lens=a([5, 8]), extend_lens=a([1, 1]), **kw)
    assert vp.num_valid[0] == 13 and wp.num_valid_reqs[0] == 2
    fill_plan(req_pool_indices=a([1]), prefix_lens=a([5]), extend_lens=a([1]), **kw)
    assert vp.num_valid[0] == 5 and wp.num_valid_reqs[0] == 1
    assert vp.slot[5:13].tolist() == list(range(30, 38))  # stale, left in place
    assert wp.offsets[2] == 2 and wp.seed[1] == 37  # stale write entries past num_valid_reqs
    sink.canary[30:38] = 0xAB  # corrupt every slot only the stale entries name
    sink.verify(vp)
    assert sink.rows() == [] and sink.kw["slot_run_counter"][0] == 13 + 5
    before = sink.canary.copy()
    sink.write(wp, [9], [5], [15])
    assert np.array_equal(sink.canary[30:38], before[30:38]) and sink.kw["slot_run_counter"][0] == 13 + 5 + 1
