"""GPU tier: the request verdicts of the kernels (docs/format.md §5.7) equal the CPU reference's,
word for word, with every stored row's request, on the seeded workloads the tier already uses:
the plan builder's rejected batch values, the tiled verifies (fused and materialised) on stamped
state with corrupted records, KV bytes and req_to_token entries, and the write's input asserts;
then whole canary steps: one request among many, two requests sharing a corrupted block, a wrong
new token, the padding slot, a stray padding token (no request), a fault no request reads."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.runtime import memory
from tests.gpu.emulated.test_plan import on, random_batch, stamped_engine
from tests.support import workloads
from tests.support.session import Session, host_plan
from tests.test_verdicts import _flip_b_cached_kv, _flip_shared_kv, failed_by_step

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]  # no GPU: kernels run in tests/emu


def host(a):
    return np.array(a) if isinstance(a, np.ndarray) else a.numpy()


def sink_with_verdicts(device, capacity: int, requests: int) -> kc.ViolationSink:
    z = (lambda shape, fill=0: np.full(shape, fill, np.int64)) if device is None else \
        (lambda shape, fill=0: memory.to_device(np.full(shape, fill, np.int64)))
    zi = np.zeros((1,), np.int32) if device is None else memory.to_device(np.zeros((1,), np.int32))
    return kc.ViolationSink(z((capacity, abi.RING_COLS)), zi, z(1), z(1), verdicts=z(requests, 7),
                            failed_requests=z(1, 5), ring_requests=z(capacity, -9))


def effects(sink) -> tuple:
    """(rows with their requests sorted, verdict words, failed count): a backend's whole account."""
    ring, wi = host(sink.arrays[0]), int(host(sink.arrays[1])[0])
    req = host(sink.verdict_arrays[2])
    rows = sorted(tuple(row) + (int(r),) for row, r in zip(ring[:wi].tolist(), req[:wi]))
    return rows, host(sink.verdict_arrays[0]).tolist(), int(host(sink.verdict_arrays[1])[0])


@pytest.mark.parametrize("seed,swa,expected", [(0, False, False), (1, True, True)])
def test_plan_builder_verdicts_equal_reference(seed, swa, expected):
    """Rejected batch values (a row past req_to_token, a prefix past max_len, a negative extend,
    padding before a real row) fail the request they name, after the reset of the step's first
    build (the words start poisoned: 7 each, count 5)."""
    batch, kw = random_batch(seed, swa=swa, expected=expected)
    got = {}
    for dev in (None, 0):
        sink = sink_with_verdicts(dev, 4096, 80)
        ctx = kc.VerifyContext(kc.CanaryBuffer.allocate(30000, device=dev), sink, abi.LaunchTag.HEAD_K_FULL)
        plan = kc.StepPlan.allocate(80, 1 << 16, device=dev)
        kwd = dict(kw, swa_map=memory.to_device(kw["swa_map"])) if swa and dev is not None else kw
        if dev is None:  # the host validates values first: run the reference on the raw batch
            _, rows = host_plan(batch, kw, 1 << 16)
            from kvcanary.ops.host import _report_batch
            from kvcanary.reference.canary import Verdicts
            Verdicts(sink.verdict_arrays[0], sink.verdict_arrays[1]).reset()
            for row in rows:
                _report_batch(sink)(np.array([row], np.int64))
        else:
            kc.build_plan(on(True, batch), plan, ctx=ctx, **kwd)
        got[dev] = effects(sink)
    assert got[None] == got[0]
    words = got[0][1]
    assert words[0] and words[1] and words[2]  # the three rejected values random_batch always plants
    assert got[0][2] == sum(w != 0 for w in words)


@pytest.mark.parametrize("seed,mode,stride,sources,swa", [
    (30, abi.HashMode.NONE, 32, [], False),
    (31, abi.HashMode.PARTIAL, 40, [(16, 64, 64)], True),
    (32, abi.HashMode.ALL, 32, [(1, 1024, 1024)], False),                  # the wide kernels
    (35, abi.HashMode.PARTIAL, 32, [(1, 64, 64)] * 6 + [(16, 32, 32)] * 3, True),  # the *_many kernels
])
def test_verify_verdicts_equal_reference_on_stamped_state(seed, mode, stride, sources, swa):
    canary, pools, srcs, batch, kw = stamped_engine(seed, mode=mode, stride=stride, sources=sources, swa=swa)
    bs = len(batch["req_pool_indices"])

    def run(dev, fused):
        B = (lambda a: a) if dev is None else memory.to_device
        sink = sink_with_verdicts(dev, 1 << 16, bs)
        ctx = kc.VerifyContext(kc.CanaryBuffer(B(canary.copy())), sink, abi.LaunchTag.HEAD_K_FULL,
                               srcs([B(p.copy()) for p in pools]), mode)
        if dev is None:
            plan, _ = host_plan(batch, kw, 1 << 17, max_batch=bs)
            if fused:
                from kvcanary.ops import host as host_ops
                from kvcanary.reference import plan as reference_plan
                q = reference_plan.requests(batch["req_pool_indices"], batch["prefix_lens"], batch["extend_lens"],
                                            batch["req_to_token"].shape, kw.get("swa_window", 0))
                rows, _, _, req = reference_plan.fused_verify_rows(
                    canary=canary, q=q, entry_offsets=plan.entry_offsets, num_valid=plan.num_valid,
                    enable=plan.enable, capacity=1 << 17, req_to_token=batch["req_to_token"],
                    sources=host_ops._ref_sources(ctx), tag=int(abi.LaunchTag.HEAD_K_FULL),
                    check_expected_token=False, swa_map=kw.get("swa_map"), with_requests=True)
                host_ops._report(sink)(rows, req)
            else:
                kc.verify(ctx, plan, per_request=True)
        else:
            plan = kc.StepPlan.allocate(bs, 1 << 17, device=0, materialize=not fused)
            kwd = dict(kw, swa_map=memory.to_device(kw["swa_map"])) if swa else {}
            dbatch = on(True, batch)
            kc.build_plan(dbatch, plan, reset_verdicts=False, **kwd)  # its own sink: ctx's words untouched
            if fused:
                kc.fused_verify(ctx, dbatch, plan, **kwd)
            else:
                kc.verify(ctx, plan, per_request=True)
        return effects(sink)

    want = run(None, True)
    assert 0 < len(want[0]) < 200 and any(r[-1] >= 0 for r in want[0])
    assert run(None, False) == want  # the reference's two paths agree on every request
    assert run(0, True) == want
    assert run(0, False) == want


@pytest.mark.parametrize("seed", range(4))
def test_write_verdicts_equal_reference(seed):
    w = workloads.make(seed)
    ref = workloads.run(w, lambda a: a, host)
    gpu = workloads.run(w, memory.to_device, host)
    workloads.assert_same(ref, gpu)  # the rows with their requests, the words and the count
    attributed = [row for row in workloads.ring_rows(ref) if row[-1] >= 0]
    assert all(row[abi.COL_FAIL_REASON_BITS] & (abi.FailReason.WRITE_TOKEN_MISMATCH | abi.FailReason.WRITE_POSITION_MISMATCH
                                                | abi.FailReason.SLOT_OUT_OF_RANGE) for row in attributed)


# ---- whole steps through KvCanary --------------------------------------------------------------
def sessions(**kw):
    return Session(**kw), Session(0, **kw)


def both(play) -> tuple[dict, dict]:
    out = []
    for s in sessions():
        play(s)
        s.canary.flush()
        out.append(failed_by_step(s.records))
    return tuple(out)


def test_one_request_among_many_fails_alone_on_the_device():
    h, d = both(lambda s: s.play(corrupt_at=3, corrupt=_flip_b_cached_kv))
    assert d == h and set(d[3]) == {1}


def test_a_shared_corrupted_block_fails_both_readers_on_the_device():
    h, d = both(lambda s: s.play(corrupt_at=3, corrupt=_flip_shared_kv))
    assert d == h and set(d[3]) == {0, 2}


def test_a_fault_nobody_reads_fails_nobody_on_the_device():
    def play(s):
        s.step([(1, list(range(100, 110))), (2, list(range(200, 204)))])
        s.k[0][int(s.rtt[2, 1]), 3] ^= 0x08
        s.sync_pools()
        s.step([(1, [110])])
        s.step([(1, [111]), (2, [204])])
    h, d = both(play)
    assert d == h and 1 not in d and set(d[2]) == {1}


def test_a_stray_padding_token_fails_no_request_but_is_reported():
    """The device takes what the host would refuse: a padding lane past the batch's tokens on a
    real slot is a TOKENS_UNOWNED row that no one request owns."""
    s = Session(0)
    s.step([(1, list(range(100, 104)))])
    arrays = s.plan_step([(1, [104])])
    loc = np.append(arrays["loc"], 77)
    B = s._dev
    b = kc.Batch(B(arrays["rows"]), B(arrays["prefix"]), B(arrays["extend"]), B(s.rtt.copy()),
                 B(np.append(arrays["ids"], 0)), B(np.append(arrays["pos"], 0)), B(loc), swa_out_cache_loc=B(loc))
    s.canary.before_forward(b)
    s.forward(arrays)
    s.canary.after_forward(b)
    s.canary.flush()
    assert any(r["type"] == "violation" and r["batch_field"] == "TOKENS_UNOWNED" for r in s.records)
    assert failed_by_step(s.records) == {}
    assert s.canary.failed_requests() == []
