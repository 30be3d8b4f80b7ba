"""GPU tier, on a GPU only (tests/gpu/emulated/test_manager_emulated.py runs the rest of the manager's
device tests in the emulator too): the scripted session replayed from CUDA graphs equals the eager
one; the step API performs no host synchronisation and, besides its launches, no driver call but the
capture query; the pump's snapshots in FIFO order, skip-when-full, flush, a violation in the first
poll after the device finished, and graph capture with snapshots in flight (the pump is never captured)."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.reporting.pump import DEPTH
from kvcanary.runtime import devices, driver, memory
from tests.support import session as sess_mod
from tests.support.session import Session, host_buffers, violation_key
from tests.test_manager import _wrong_rtt

pytestmark = pytest.mark.gpu


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
    assert violation_key(g.records) == violation_key(eager_records)
    # the request verdicts (docs/format.md §5.7) reset and fill inside the replayed graphs as in eager steps
    from tests.test_verdicts import failed_by_step
    assert failed_by_step(g.records) == failed_by_step(eager_records) and 1 in failed_by_step(eager_records)[3]
    eb, gb = host_buffers(eager.canary), host_buffers(g.canary)
    for name in eb:
        np.testing.assert_array_equal(eb[name], gb[name], err_msg=str(name))
    assert g.canary.stats()["self_tests"] == eager.canary.stats()["self_tests"] == 3  # replays 2, 4, 6 of 7
    g.canary.health_check()


# ---- the pump -------------------------------------------------------------------------------------
def small_canary(**kw):
    """One group, K half, a one-request batch that re-stamps slot 5 each step (always clean)."""
    from kvcanary.manager.canary import KvCanary, PoolGroup
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
        rt = devices.runtime(0)
        res = rt.call(d.cuStreamWaitValue32, rt.cu_stream(stream), self.word.device_ptr, 1,
                      d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        memory.check(res, "cuStreamWaitValue32")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.word.array[0] = 1  # opened before any wait on the stream, even when an assert failed


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
    # step 3's snapshot is taken by its TAIL's last launch: a fast device may have finished it by
    # the time after_forward reads the FIFO, which then reports it at once, as step 3's
    assert {r["step"] for r in s.records if r["type"] == "violation"} <= {3}
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
