"""GPU tier: the scripted session on the device equals the CPU reference (records and buffers),
eager and CUDA-graph-replayed; the step API performs no host synchronisation and, besides its
launches, no driver call but the capture query; the pump's kvc_snapshot launches: exact copies,
FIFO order, skip-when-full, flush, a violation in the first poll after the device finished, and
graph capture with snapshots in flight (the pump is never captured)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvcanary as kc
from tests.support import session as sess_mod
from kvcanary import driver, memory
from kvcanary.pump import DEPTH, Pump
from tests.support import swa_window
from tests.support.session import Session
from tests.test_fingerprint_budget import BOUNDARY_CASES, budget_by_hand, reported_positions
from tests.test_manager import _flip_kv, _wrong_position, _wrong_rtt

pytestmark = pytest.mark.gpu


def key(records):
    return sorted((r["step"], r["launch_tag"], r["slot_idx"], r["position"], r["fail_reason_bits"],
                   r["stored_chain_hash"], r["expected_aux"]) for r in records if r["type"] == "violation")


def buffers(canary):
    out = {}
    for name, ctx in canary.ctx.items():
        arr = ctx.buffer.array
        out[name[:3]] = arr if isinstance(arr, np.ndarray) else arr.numpy()
    return out


@pytest.mark.emulated  # no GPU: the kernels run in tests/emu (fresh device arrays every step: patched launches)
@pytest.mark.parametrize("swa", [False, True])
@pytest.mark.parametrize("fault", [None, "rtt", "kv", "pos"])
def test_session_on_gpu_equals_reference(swa, fault):
    corrupt = {None: None, "rtt": _wrong_rtt, "kv": _flip_kv, "pos": _wrong_position}[fault]
    at = {None: None, "rtt": 3, "kv": 4, "pos": 2}[fault]
    host = Session(swa=swa, chain_position_assert=True)
    dev = Session(0, swa=swa, chain_position_assert=True)
    assert key(host.script(at, corrupt)) == key(dev.script(at, corrupt))
    hb, db = buffers(host.canary), buffers(dev.canary)
    for name in hb:
        np.testing.assert_array_equal(hb[name], db[name], err_msg=str(name))
    assert host.canary.stats()["verified_slots"] == dev.canary.stats()["verified_slots"]
    dev.canary.health_check()


@pytest.mark.emulated
@pytest.mark.parametrize("every", [2, 3, 100])
@pytest.mark.parametrize("fault", [None, "kv"])
def test_fingerprint_budget_on_gpu_equals_reference(every, fault):
    """KvCanary(fingerprint_every=N): the TAIL verifies fingerprint a rotating share of the cached
    tokens (docs/format.md §6.1); rows, buffers and counters equal the reference's."""
    corrupt = None if fault is None else _flip_kv
    host = Session(fingerprint_every=every)
    dev = Session(0, fingerprint_every=every)
    assert key(host.script(4, corrupt)) == key(dev.script(4, corrupt))
    assert ring_rows(host.canary) == ring_rows(dev.canary)
    hb, db = buffers(host.canary), buffers(dev.canary)
    for name in hb:
        np.testing.assert_array_equal(hb[name], db[name], err_msg=str(name))
    dev.canary.health_check()


@pytest.mark.emulated
@pytest.mark.parametrize("every,prefills", BOUNDARY_CASES)
def test_the_kernels_fingerprint_exactly_the_formats_positions(every, prefills):
    """Catches an off-by-one at the budget's "newest N tokens" boundary in the fused verify kernels
    (the session above never puts a fingerprinted position at the boundary that both sides would
    see differently): the exact set per request and phase, against docs/format.md §6.1 by hand."""
    steps = every + 1
    assert reported_positions(0, every, prefills, steps) == budget_by_hand(every, prefills, steps)


@pytest.mark.emulated
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit-plan"])
@pytest.mark.parametrize("zero_position", [5, 7], ids=["out-of-window-predecessor", "inside-the-window"])
@pytest.mark.parametrize("hash_mode,layers", swa_window.VARIANTS, ids=["narrow", "many", "wide", "identity"])
def test_an_swa_windows_slot_0_is_judged_as_the_reference_judges_it(hash_mode, layers, zero_position, fused):
    """Catches the padding-slot rule applied to the first SWA entry's out-of-window predecessor in
    any fused-verify variant (a false PADDING_SLOT_READ on a healthy request), and a 0 inside the
    window not reported: the kernels' rows equal the reference's, which tests/test_swa_window.py
    holds to docs/format.md §8."""
    want = swa_window.run(None, hash_mode, layers, zero_position, fused)
    assert (want == []) == (zero_position == 5)
    assert swa_window.run(0, hash_mode, layers, zero_position, fused) == want


class HeadRecordChanged(Session):
    """A session whose forward also changes one field of the HEAD K record of one new token (entry
    `entry` of step `at`) after before_forward: the record the later writes of the step (HEAD V,
    TAIL K, TAIL V) take their chain from on the device (docs/format.md §7, the chain once per step)."""

    def __init__(self, device=None, *, at, entry, field, **kw):
        super().__init__(device, **kw)
        self.at, self.entry, self.field = at, entry, field

    def forward(self, arrays):
        super().forward(arrays)
        if self.step_no != self.at:
            return
        arr = self.canary.ctx[("HEAD", "FULL", "K", "write")].buffer.array
        host = arr if isinstance(arr, np.ndarray) else arr.numpy()
        words = host.view(np.int64).reshape(host.shape[0], -1)
        words[int(arrays["loc"][self.entry]), self.field] ^= 0x10
        if not isinstance(arr, np.ndarray):
            arr.copy_from_host(host)


@pytest.mark.emulated
@pytest.mark.parametrize("at,entry", [(0, 0), (0, 5), (0, 11), (1, 1), (3, 1)])
@pytest.mark.parametrize("field", [kc.abi.FIELD_TOKEN, kc.abi.FIELD_POSITION, kc.abi.FIELD_PREV_HASH])
def test_a_head_record_changed_before_tail_is_not_copied_into_tail(at, entry, field):
    """TAIL takes the step's chain from HEAD K only when every link checks out: a HEAD K record
    changed between HEAD and TAIL (first, middle, last entry of a prefill; a decode entry) leaves
    TAIL K and V as the serial chain makes them (the reference); a changed position or chain is reported."""
    host = HeadRecordChanged(at=at, entry=entry, field=field, chain_position_assert=True)
    dev = HeadRecordChanged(0, at=at, entry=entry, field=field, chain_position_assert=True)
    recs = host.script()
    assert key(recs) == key(dev.script())
    if field != kc.abi.FIELD_TOKEN:  # a token changed at a request's last entry is what its successor chains on
        assert any(r["launch_tag"] == "HEAD_K_FULL" for r in recs if r["type"] == "violation")
    hb, db = buffers(host.canary), buffers(dev.canary)
    for name in hb:
        np.testing.assert_array_equal(hb[name], db[name], err_msg=str(name))


def ring_rows(canary):
    ring = canary._ring if isinstance(canary._ring, np.ndarray) else canary._ring.numpy()
    claim = int((canary.status if isinstance(canary.status, np.ndarray) else canary.status.numpy())[kc.abi.STATUS_CLAIM])
    return sorted(map(tuple, ring[:claim].tolist()))


@pytest.mark.emulated
@pytest.mark.parametrize("fused", [True, False])
def test_self_test_on_gpu_equals_reference(fused):
    host = Session(self_test_every=2, fused=fused)
    dev = Session(0, self_test_every=2, fused=fused)
    assert key(host.script(3, _wrong_rtt)) == key(dev.script(3, _wrong_rtt))
    assert ring_rows(host.canary) == ring_rows(dev.canary)  # the self-test rows included, byte for byte
    tests = [r for r in ring_rows(dev.canary) if r[7] & kc.FailReason.SELF_TEST]
    assert [r[6] for r in tests] == [2, 4, 6]  # expected aux: the runs 2, 4, 6 of the 7-step script's HEAD K verify
    assert host.canary.stats()["self_tests"] == dev.canary.stats()["self_tests"] == 3
    dev.canary.health_check()


@pytest.mark.emulated
@pytest.mark.parametrize("fused", [True, False])
def test_the_kernels_self_test_fails_the_health_check_once_its_record_looks_right(fused):
    """Catches a device self-test that cannot fail: one that set the position-mismatch bit without
    comparing the record's position would still send the known-bad row, so the health check would
    pass. With the canary-only record corrected (the position docs/format.md §11 expects), the
    kernel's check finds nothing wrong: its rows stop matching the known-bad one, none is counted,
    and the health check fails."""
    from kvcanary import abi
    from kvcanary.manager import Key
    dev = Session(0, self_test_every=2, fused=fused)
    ctx = dev.canary.ctx[Key("HEAD", "FULL", "K", "verify")]
    ctx._self_test.copy_from_host(np.array([abi.SELF_TEST_TOKEN, abi.SELF_TEST_POSITION, 0, 0], np.int64))
    dev.script()
    assert [r for r in dev.records if r["type"] == "violation"] == []  # self-test rows are never reported
    assert dev.canary.stats()["self_tests"] == 0
    with pytest.raises(kc.KvCanaryError, match=r"self-test: 0 of 3 expected self-test rows arrived.*did not match"):
        dev.canary.health_check()


@pytest.mark.parametrize("fused", [True, False])
def test_step_api_does_not_synchronise(monkeypatch, fused):
    from cuda.bindings import driver as d
    s = Session(0, fused=fused)
    s.script()  # warm: launches packed, library loaded
    blocking = ["cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH",
                "cuMemcpyHtoD", "cuMemcpy", "cuStreamQuery",
                # the pump reads completion words from pinned memory: no event, no copy per step
                "cuEventQuery", "cuEventRecord", "cuStreamWaitEvent", "cuMemcpyAsync", "cuMemcpyDtoHAsync"]
    calls = []

    def guard(name):
        return lambda *a, **k: calls.append(name) or (_ for _ in ()).throw(AssertionError(f"{name} during a step"))

    rows, prefix, extend = (memory.to_device(np.array(v, np.int64)) for v in ([2], [s.lens[2]], [1]))
    ids, pos = memory.to_device(np.array([999], np.int64)), memory.to_device(np.array([s.lens[2]], np.int64))
    s.rtt[2, s.lens[2]] = 500
    loc = memory.to_device(np.array([500], np.int64))
    batch = kc.Batch(rows, prefix, extend, memory.to_device(s.rtt), ids, pos, loc)
    s.canary.before_forward(batch)
    s.canary.after_forward(batch)  # packs the launches for this batch
    for name in blocking:
        monkeypatch.setattr(d, name, guard(name))
    n0 = s.canary.launch_count
    for _ in range(5):
        s.canary.before_forward(batch)
        s.canary.after_forward(batch)
    monkeypatch.undo()
    assert calls == []
    assert s.canary.launch_count - n0 <= 5 * s.canary.launches_per_step()
    s.canary.flush()
    s.canary.health_check()


def test_session_replayed_from_cuda_graphs_equals_eager():
    torch = pytest.importorskip("torch")
    eager = Session(0, chain_position_assert=True, self_test_every=2)
    eager_records = eager.script(3, _wrong_rtt)

    g = Session(0, chain_position_assert=True, self_test_every=2)  # the due test reads the device's run counter
    bs, T = 4, 16
    st = {k: torch.zeros(n, dtype=torch.int64, device="cuda") for k, n in
          (("rows", bs), ("prefix", bs), ("extend", bs), ("ids", T), ("pos", T), ("loc", T), ("swa", T))}
    rtt = torch.zeros((sess_mod.ROWS, sess_mod.MAXLEN), dtype=torch.int32, device="cuda")
    batch = kc.Batch(st["rows"], st["prefix"], st["extend"], rtt, st["ids"], st["pos"], st["loc"],
                     swa_out_cache_loc=st["swa"])
    graphs = {}

    def fill(arrays):
        for k, name in (("rows", "rows"), ("prefix", "prefix"), ("extend", "extend")):
            v = np.zeros(bs, np.int64)
            v[:len(arrays[name])] = arrays[name]
            st[k].copy_(torch.from_numpy(v))
        for k, name in (("ids", "ids"), ("pos", "pos"), ("loc", "loc")):
            v = np.full(T, -1 if k == "loc" else 0, np.int64)
            v[:len(arrays[name])] = arrays[name]
            st[k].copy_(torch.from_numpy(v))
        rtt.copy_(torch.from_numpy(g.rtt))

    def step(work, corrupt=None):
        arrays = g.plan_step(work, corrupt=corrupt)  # the canary runs from captured graphs
        fill(arrays)
        torch.cuda.synchronize()
        if not graphs:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            for stage in ("HEAD", "TAIL"):
                graphs[stage] = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s):  # pack launches outside capture (no canary launch here)
                g.canary.stages.launches(batch, "HEAD", s.cuda_stream); g.canary.stages.launches(batch, "TAIL", s.cuda_stream)
            torch.cuda.synchronize()
            snapshots = g.canary.pump.launches
            with torch.cuda.graph(graphs["HEAD"]):
                g.canary.before_forward(batch)
            with torch.cuda.graph(graphs["TAIL"]):
                g.canary.after_forward(batch)
            assert g.canary.pump.launches == snapshots  # the pump is not captured
            # a capture counts nothing for the health check: record_replay does, per replay
        graphs["HEAD"].replay()
        torch.cuda.synchronize()
        g.forward(arrays)
        graphs["TAIL"].replay()
        g.canary.record_replay()
        g.canary.poll(torch.cuda.current_stream().cuda_stream)

    g.play(3, _wrong_rtt, step=step)
    g.canary.flush()
    assert key(g.records) == key(eager_records)
    # the request verdicts (docs/format.md §5.7) reset and fill inside the replayed graphs as in eager steps
    from tests.test_verdicts import failed_by_step
    assert failed_by_step(g.records) == failed_by_step(eager_records) and 1 in failed_by_step(eager_records)[3]
    eb, gb = buffers(eager.canary), buffers(g.canary)
    for name in eb:
        np.testing.assert_array_equal(eb[name], gb[name], err_msg=str(name))
    assert g.canary.stats()["self_tests"] == eager.canary.stats()["self_tests"] == 3  # replays 2, 4, 6 of 7
    g.canary.health_check()


# ---- the pump -------------------------------------------------------------------------------------
def small_canary(**kw):
    """One group, K half, a one-request batch that re-stamps slot 5 each step (always clean)."""
    from kvcanary.manager import KvCanary, PoolGroup
    records = []
    canary = KvCanary(PoolGroup(64, halves=("K",)), device=0, hash_mode="none", max_batch=2,
                      verify_capacity=64, export=records.append, stats_every=1, **kw)
    rtt = np.zeros((2, 8), np.int32)
    rtt[1, 0] = 5
    def dev(v, dt=np.int64):
        return memory.to_device(np.array(v, dt))

    batch = kc.Batch(dev([1]), dev([0]), dev([1]), dev(rtt, np.int32), dev([7]), dev([0]), dev([5]))
    return canary, batch, records


class Gate:
    """Holds a stream at a cuStreamWaitValue32 on a pinned word until the host opens it: the device
    stays behind the host however slowly the host runs (a timed sleep did not under memcheck)."""

    def __init__(self, stream: int):
        d = driver._driver()
        self.word = memory.PinnedBuffer((1,), np.uint32, 0, mapped=True)
        rt = driver.runtime(0)
        res = rt.call(d.cuStreamWaitValue32, rt.cu_stream(stream), self.word.device_ptr, 1,
                      d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        memory.check(res, "cuStreamWaitValue32")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.word.array[0] = 1  # opened before any wait on the stream, even when an assert failed


@pytest.mark.emulated
def test_snapshot_kernel_copies_the_status_block_then_its_completion_word():
    host = np.arange(1, 301, dtype=np.int64) * -3  # a few hundred words, more than one block's pass
    status = memory.to_device(host)
    pump = Pump(status, memory.zeros((4, kc.abi.RING_COLS), np.int64), 4, 0)
    s = memory.new_stream(0)
    for k in range(2 * DEPTH + 1):  # every slot used twice
        pump.snapshot(s, k)
        deadline, taken = time.monotonic() + 5, []
        while not taken and time.monotonic() < deadline:  # plain loads of pinned memory, no driver call
            taken = pump.take()
        assert [m for _, m in taken] == [k], "the completion word never became visible to the host"
        assert taken[0][0] == host.tolist()
    assert pump.launches == 2 * DEPTH + 1 and pump.skipped == 0


def test_snapshots_in_order_skipped_when_full_then_flushed():
    torch = pytest.importorskip("torch")
    canary, batch, records = small_canary()
    stream = torch.cuda.Stream()
    s = stream.cuda_stream
    canary.before_forward(batch, stream=s)  # packs the launches
    canary.after_forward(batch, stream=s)
    canary.flush()
    first = canary.step
    with Gate(s):  # the device stays behind the host until the gate opens
        for _ in range(DEPTH + 3):
            canary.before_forward(batch, stream=s)
            canary.after_forward(batch, stream=s)
        assert canary.pump.skipped == 3 and canary.pump.fifo.in_flight == DEPTH
        assert canary.monitor.last[1][0] == first - 1, "a snapshot completed before the device got there"
    canary.flush()
    steps = [r["step"] for r in records if r["type"] == "stats"]
    # the DEPTH snapshots in flight, then flush's own, labelled with the last step it covers (a skipped one)
    assert steps[-DEPTH - 1:] == list(range(first, first + DEPTH)) + [first + DEPTH + 2]
    assert [r for r in records if r["type"] == "violation"] == []
    canary.health_check()


def test_a_violation_shows_up_in_the_first_poll_after_the_device_finished():
    s = Session(0)
    s.play(3, _wrong_rtt, stop_after=3)
    assert [r for r in s.records if r["type"] == "violation"] == []  # step 3's snapshot not taken yet
    memory.context_synchronize(0)
    s.canary.poll(driver.PER_THREAD_STREAM)
    found = [r for r in s.records if r["type"] == "violation"]
    assert found and {r["step"] for r in found} == {3}
    assert "HEAD_K_FULL" in {r["launch_tag"] for r in found}


def test_capture_with_snapshots_in_flight():
    torch = pytest.importorskip("torch")
    canary, batch, records = small_canary()
    stream = torch.cuda.Stream()
    s = stream.cuda_stream
    canary.before_forward(batch, stream=s)  # packs the launches outside the capture
    canary.after_forward(batch, stream=s)
    canary.flush()
    with Gate(s):  # the device stays behind: the next steps' snapshots are in flight
        for _ in range(3):
            canary.before_forward(batch, stream=s)
            canary.after_forward(batch, stream=s)
        assert canary.pump.fifo.in_flight == 3
    # open before the capture: torch.cuda.graph synchronises the device first (a closed gate would
    # hang it); the pump has not taken those snapshots, so for the host they are still in flight
    snapshots, step = canary.pump.launches, canary.step
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # global capture mode: the pump makes no event query
        cs = torch.cuda.current_stream().cuda_stream
        assert canary.pump.fifo.in_flight == 3
        canary.before_forward(batch, stream=cs)
        canary.after_forward(batch, stream=cs)
    assert canary.pump.launches == snapshots and canary.step == step
    with torch.cuda.stream(stream):
        for _ in range(4):
            g.replay()
            canary.record_replay()
            canary.poll(s)
    canary.flush()
    assert [r for r in records if r["type"] == "violation"] == []
    canary.health_check()
