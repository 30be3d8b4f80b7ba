"""GPU tier: hostile device data (what an engine bug can put in the arrays kvcanary reads) gives
reports, never an out-of-bounds access, and the same reports as the reference byte for byte.

Run under compute-sanitizer on the GPU machine (``.ci/gpu sanitize``): memcheck must find 0
errors. Cases: request-pool rows outside the table (negative, past it, INT64 extremes), prefixes
beyond req_to_token, negative lengths, padding rows before real ones, garbage req_to_token and
SWA-map entries, a TAIL batch that differs from the HEAD batch its plan was built from (other
rows, longer prefixes, a narrower req_to_token, more requests), garbage plan entries and
num_valid for the plan verify, garbage write plans, tokens past the write ranges, a one-row ring.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.reference import canary as reference
from kvcanary.reference import plan as reference_plan
from kvcanary.reference.canary import RefSource
from kvcanary.runtime import memory
from tests.support.session import host_plan

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]  # no GPU: kernels run in tests/emu

I64 = np.iinfo(np.int64)
NUM_SLOTS, ROWS, MAX_LEN, BPT = 600, 6, 40, 64


def host(a):
    return a if isinstance(a, np.ndarray) else a.numpy()


def engine(seed: int):
    """A stamped pool: rows 1..ROWS-1 with random prefixes, a canary buffer and KV bytes."""
    rng = np.random.default_rng(seed)
    rtt = np.zeros((ROWS, MAX_LEN), np.int32)
    rtt[1:] = rng.permutation(np.arange(1, NUM_SLOTS))[: (ROWS - 1) * MAX_LEN].reshape(ROWS - 1, MAX_LEN)
    canary = rng.integers(0, 256, (NUM_SLOTS, 32), dtype=np.uint8)
    pool = rng.integers(0, 256, (NUM_SLOTS, BPT), dtype=np.uint8)
    return rng, rtt, canary, pool


def hostile_batches(rng, rtt):
    """(name, batch dict, kw) of HEAD batches with out-of-range values, and a clean one."""
    bs = 5
    rpi = np.array([1, 2, 3, 4, 5], np.int64)
    pre = rng.integers(1, MAX_LEN, bs).astype(np.int64)
    ext = np.ones(bs, np.int64)

    def batch(rpi=rpi, pre=pre, ext=ext, rtt=rtt, T=None, loc=None):
        T = int(np.where(rpi != 0, np.maximum(ext, 0), 0).sum()) if T is None else T
        loc = rng.integers(1, NUM_SLOTS, T).astype(np.int64) if loc is None else loc
        return dict(req_pool_indices=rpi, prefix_lens=pre, extend_lens=ext, req_to_token=rtt,
                    input_ids=rng.integers(0, 999, len(loc)).astype(np.int64),
                    positions=rng.integers(0, MAX_LEN, len(loc)).astype(np.int64), out_cache_loc=loc)

    def with_(a, i, v):
        a = a.copy()
        a[i] = v
        return a

    out = [("clean", batch(), {})]
    for v in (-1, ROWS, 1 << 40, I64.min, I64.max):
        out.append((f"row {v}", batch(rpi=with_(rpi, 2, v)), {}))
    for v in (-5, MAX_LEN + 1, I64.max):
        out.append((f"prefix {v}", batch(pre=with_(pre, 1, v)), {}))
    out.append(("extend -3", batch(ext=with_(ext, 0, -3)), {}))
    out.append(("padding first", batch(rpi=with_(rpi, 0, 0)), {}))
    bad_rtt = rtt.copy()
    bad_rtt[2, :5] = [-7, 0, NUM_SLOTS + 9, np.iinfo(np.int32).max, np.iinfo(np.int32).min]
    out.append(("rtt garbage", batch(rtt=bad_rtt, pre=with_(pre, 1, 6)), {}))
    swa_map = rng.integers(-3, NUM_SLOTS + 5, NUM_SLOTS + 3).astype(np.int64)
    swa_map[:4] = [I64.min, I64.max, -1, -3]
    out.append(("swa map garbage", batch(), dict(swa_window=7, swa_map=swa_map)))
    out.append(("tokens short", batch(T=2), {}))
    loc = rng.integers(1, NUM_SLOTS, 9).astype(np.int64)
    out.append(("tokens unowned", batch(loc=loc), {}))
    return out


def sink_effects(sink):
    ring, wi = host(sink.arrays[0]), int(host(sink.arrays[1])[0])
    return sorted(map(tuple, ring[:min(wi, len(ring))].tolist())), wi, int(host(sink.arrays[2])[0]), \
        int(host(sink.arrays[3])[0])


def ref_plan(b, kw, cap, max_batch):
    """The reference plan of host batch ``b`` (the SWA group writes no out_cache_loc)."""
    arrays = {k: v for k, v in b.items() if k not in ("input_ids", "positions", "out_cache_loc")}
    return host_plan({**arrays, "out_cache_loc": b["out_cache_loc"] if "swa_map" not in kw else None}, kw, cap,
                     max_batch)


def dev_batch(b):
    return kc.Batch(**{k: memory.to_device(v) for k, v in b.items()})


@pytest.mark.parametrize("case", range(len(hostile_batches(np.random.default_rng(0), engine(0)[1]))))
def test_hostile_head_batch_is_reported_like_the_reference(case):
    rng, rtt, canary, pool = engine(case)
    name, b, kw = hostile_batches(rng, rtt)[case]
    max_batch, cap = 8, 4096
    plan_ref, rows_ref = ref_plan(b, kw, cap, max_batch)
    builder_finds = name.split()[0] in ("row", "prefix", "extend", "padding", "tokens")  # else the verify does
    assert builder_finds == (rows_ref != []), name
    dplan = kc.StepPlan.allocate(max_batch, cap, device=0)
    dkw = dict(kw, swa_map=memory.to_device(kw["swa_map"])) if "swa_map" in kw else {}
    db = dev_batch(b)
    if "swa_map" in kw:
        db.swa_out_cache_loc, db.out_cache_loc = db.out_cache_loc, None
    kc.build_plan(db, dplan, **dkw)
    assert sink_effects(dplan.reject_sink)[0] == rows_ref, name
    bs = len(b["req_pool_indices"])
    np.testing.assert_array_equal(host(dplan.offsets)[:bs + 1], plan_ref.offsets[:bs + 1])
    np.testing.assert_array_equal(host(dplan.seed)[:bs], plan_ref.seed[:bs])
    np.testing.assert_array_equal(host(dplan.entry_offsets)[:bs + 1], plan_ref.entry_offsets[:bs + 1])
    for mode, nbytes in ((abi.HashMode.PARTIAL, 16), (abi.HashMode.ALL, BPT)):  # narrow and wide verifies
        dsink = kc.ViolationSink.allocate(256, device=0)
        dctx = kc.VerifyContext(kc.CanaryBuffer(memory.to_device(canary)), dsink, abi.LaunchTag.TAIL_K_FULL,
                                [kc.RealKvSource(memory.to_device(pool), 1, BPT)], mode)
        kc.fused_verify(dctx, db, dplan, check_expected_token=True, **dkw)
        rsink = kc.ViolationSink.allocate(256)
        q = reference_plan.requests(b["req_pool_indices"], b["prefix_lens"], b["extend_lens"], rtt.shape,
                                    kw.get("swa_window", 0))
        rows, active, skipped = reference_plan.fused_verify_rows(
            canary=canary, q=q, entry_offsets=plan_ref.entry_offsets, num_valid=plan_ref.num_valid,
            enable=plan_ref.enable, capacity=cap, req_to_token=b["req_to_token"],
            sources=[RefSource(pool, 1, BPT, nbytes)], tag=int(abi.LaunchTag.TAIL_K_FULL), check_expected_token=True,
            swa_map=kw.get("swa_map"))
        reference.ring_append(rsink.ring_view.host, rsink.write_index_view.host, rows)
        got = sink_effects(dsink)
        assert got[0] == sink_effects(rsink)[0] and got[3] == active and skipped == 0, (name, mode)
    # the write of the same plan: rejected requests stamp nothing, bad slots are reported
    wsink = kc.ViolationSink.allocate(256, device=0)
    wctx = kc.VerifyContext(kc.CanaryBuffer(memory.to_device(canary)), wsink, abi.LaunchTag.TAIL_V_FULL, [],
                            abi.HashMode.NONE)
    loc = db.swa_out_cache_loc if "swa_map" in kw else db.out_cache_loc
    kc.write(wctx, dplan, db.input_ids, db.positions, loc)
    rcanary, rsink = canary.copy(), kc.ViolationSink.allocate(256)
    reference.write(canary=rcanary, offsets=plan_ref.offsets, seed=plan_ref.seed, num_valid_reqs=plan_ref.num_valid_reqs,
                    input_ids=b["input_ids"], positions=b["positions"], out_cache_loc=b["out_cache_loc"],
                    sources=[], tag=int(abi.LaunchTag.TAIL_V_FULL), ring=rsink.ring_view.host,
                    write_index=rsink.write_index_view.host, kernel_run_counter=rsink.kernel_run_view.host,
                    slot_run_counter=rsink.slot_run_view.host)
    assert sink_effects(wsink) == sink_effects(rsink), name
    np.testing.assert_array_equal(wctx.buffer.array.numpy(), rcanary, err_msg=name)


@pytest.mark.parametrize("change", ["rows", "longer prefixes", "narrower req_to_token", "more requests", "offsets"])
def test_tail_batch_that_differs_from_head_stays_in_bounds_and_is_reported(change):
    """The plan is built from HEAD's batch; TAIL gets another one (an engine bug rewriting the
    batch between the two). The fused verify reads only entries its own batch gives, skips and
    counts the rest, and reports each request whose entry count changed."""
    rng, rtt, canary, pool = engine(7)
    rpi = np.array([1, 2, 3], np.int64)
    pre = np.array([30, 12, 25], np.int64)
    head = dict(req_pool_indices=rpi, prefix_lens=pre, extend_lens=np.ones(3, np.int64), req_to_token=rtt)
    tail = dict(head)
    if change == "rows":
        tail["req_pool_indices"] = np.array([ROWS + 4, 0, -2], np.int64)
    elif change == "longer prefixes":
        tail["prefix_lens"] = np.array([MAX_LEN, MAX_LEN + 100, 40], np.int64)
    elif change == "narrower req_to_token":
        tail["req_to_token"] = np.ascontiguousarray(rtt[:3, :8])
    elif change == "more requests":
        tail = dict(req_pool_indices=np.array([1, 2, 3, 4, 5], np.int64), prefix_lens=np.array([30, 12, 25, 39, 39], np.int64),
                    extend_lens=np.ones(5, np.int64), req_to_token=rtt)
    dplan = kc.StepPlan.allocate(8, 4096, device=0)
    kc.build_plan(dev_batch(head), dplan)
    if change == "offsets":  # garbage where kvc_prepare wrote the entry offsets
        dplan.entry_offsets.copy_from_host(np.array([0, -50, 7, 1 << 40, -1, 3, 3, 9, 2], np.int64))
    dsink = kc.ViolationSink.allocate(1024, device=0, )
    skips = memory.zeros((1,), np.int64)
    dsink = kc.ViolationSink(*dsink.arrays, skips=skips)
    dctx = kc.VerifyContext(kc.CanaryBuffer(memory.to_device(canary)), dsink, abi.LaunchTag.TAIL_K_FULL,
                            [kc.RealKvSource(memory.to_device(pool), 1, BPT)], abi.HashMode.PARTIAL)
    kc.fused_verify(dctx, dev_batch(tail), dplan)
    rows, wi, runs, slots = sink_effects(dsink)
    counts = [r for r in rows if r[7] == int(abi.FailReason.BATCH_INDEX_OUT_OF_RANGE)]
    assert runs == 1 and slots == int(pre.sum())
    assert counts and all(r[4] == int(abi.BatchField.ENTRY_COUNT) for r in counts)
    if change != "offsets":  # with garbled offsets the owners are arbitrary: only safety is defined
        q = reference_plan.requests(tail["req_pool_indices"], tail["prefix_lens"], tail["extend_lens"],
                                    tail["req_to_token"].shape)
        ref_rows, active, skipped = reference_plan.fused_verify_rows(
            canary=canary, q=q, entry_offsets=host(dplan.entry_offsets), num_valid=host(dplan.num_valid),
            enable=host(dplan.enable), capacity=4096, req_to_token=tail["req_to_token"],
            sources=[RefSource(pool, 1, BPT, 16)], tag=int(abi.LaunchTag.TAIL_K_FULL), check_expected_token=False)
        assert rows == sorted(map(tuple, ref_rows.tolist())) and int(skips.numpy()[0]) == skipped


def test_garbage_plans_for_the_plan_verify_and_the_write():
    rng, rtt, canary, pool = engine(9)
    cap = 64
    plan = kc.StepPlan.allocate(4, cap, device=0, materialize=True)
    vals = np.array([0, -1, -2, -3, NUM_SLOTS, NUM_SLOTS - 1, I64.min, I64.max, 5], np.int64)
    for name in ("slot", "prev_slot", "expected_token", "expected_position"):
        getattr(plan, name).copy_from_host(rng.choice(vals, cap).astype(np.int64))
    plan.num_valid.copy_from_host(np.array([1 << 30], np.int32))   # clamped to the capacity
    plan.enable.copy_from_host(np.array([1], np.int32))
    plan.offsets.copy_from_host(np.array([5, -9, 1 << 50, 3, 2], np.int64))
    plan.seed.copy_from_host(np.array([I64.min + 1, -2, NUM_SLOTS * 9, 0], np.int64))
    plan.num_valid_reqs.copy_from_host(np.array([99], np.int32))
    for mode, nbytes in ((abi.HashMode.PARTIAL, 16), (abi.HashMode.ALL, BPT)):
        dsink = kc.ViolationSink.allocate(1, device=0)                 # a one-row ring: counted, not stored
        dctx = kc.VerifyContext(kc.CanaryBuffer(memory.to_device(canary)), dsink, abi.LaunchTag.SWEEP_K_FULL,
                                [kc.RealKvSource(memory.to_device(pool), 1, BPT)], mode)
        kc.verify(dctx, plan, check_expected_token=True)
        rsink = kc.ViolationSink.allocate(1)
        reference.verify(canary=canary, **{k: host(getattr(plan, k)) for k in ("slot", "expected_token",
                         "expected_position", "prev_slot")}, num_valid=host(plan.num_valid), enable=host(plan.enable),
                         sources=[RefSource(pool, 1, BPT, nbytes)], tag=int(abi.LaunchTag.SWEEP_K_FULL),
                         check_expected_token=True, ring=rsink.ring_view.host, write_index=rsink.write_index_view.host,
                         kernel_run_counter=rsink.kernel_run_view.host, slot_run_counter=rsink.slot_run_view.host)
        got, want = sink_effects(dsink), sink_effects(rsink)
        assert got[1:] == want[1:] and got[1] > 1  # the same count; which single row got the slot is a race
    T = 6
    toks = [memory.to_device(rng.integers(-5, NUM_SLOTS * 2, T).astype(np.int64)) for _ in range(3)]
    wsink = kc.ViolationSink.allocate(64, device=0)
    wctx = kc.VerifyContext(kc.CanaryBuffer(memory.to_device(canary)), wsink, abi.LaunchTag.TAIL_K_FULL,
                            [kc.RealKvSource(memory.to_device(pool), 1, BPT)], abi.HashMode.ALL)
    kc.write(wctx, plan, *toks)
    rcanary, rsink = canary.copy(), kc.ViolationSink.allocate(64)
    reference.write(canary=rcanary, offsets=host(plan.offsets), seed=host(plan.seed), num_valid_reqs=host(plan.num_valid_reqs),
                    input_ids=host(toks[0]), positions=host(toks[1]), out_cache_loc=host(toks[2]),
                    sources=[RefSource(pool, 1, BPT, BPT)], tag=int(abi.LaunchTag.TAIL_K_FULL),
                    ring=rsink.ring_view.host, write_index=rsink.write_index_view.host,
                    kernel_run_counter=rsink.kernel_run_view.host, slot_run_counter=rsink.slot_run_view.host)
    assert sink_effects(wsink) == sink_effects(rsink)
    np.testing.assert_array_equal(wctx.buffer.array.numpy(), rcanary)
