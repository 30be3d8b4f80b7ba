"""GPU tier: the scripted session on the device equals the CPU reference (records and buffers),
eager and CUDA-graph-replayed; the step API performs no host synchronisation."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from tests import session as sess_mod
from kvcanary import memory
from tests.session import Session
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


@pytest.mark.parametrize("fused", [True, False])
def test_step_api_does_not_synchronise(monkeypatch, fused):
    from cuda.bindings import driver as d
    s = Session(0, fused=fused)
    s.script()  # warm: launches packed, library loaded
    blocking = ["cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH",
                "cuMemcpyHtoD", "cuMemcpy", "cuStreamQuery"]
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
    for _ in range(5):
        s.canary.before_forward(batch)
        s.canary.after_forward(batch)
    monkeypatch.undo()
    assert calls == []
    s.canary.flush()
    s.canary.health_check()


def test_session_replayed_from_cuda_graphs_equals_eager():
    torch = pytest.importorskip("torch")
    eager = Session(0, chain_position_assert=True)
    eager_records = eager.script(3, _wrong_rtt)

    g = Session(0, chain_position_assert=True)
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
                g.canary._launches(batch, "HEAD"); g.canary._launches(batch, "TAIL")
            torch.cuda.synchronize()
            with torch.cuda.graph(graphs["HEAD"]):
                g.canary.before_forward(batch)
            with torch.cuda.graph(graphs["TAIL"]):
                g.canary.after_forward(batch)
            g.canary._expected[:] = 0
        graphs["HEAD"].replay()
        torch.cuda.synchronize()
        g.forward(arrays)
        graphs["TAIL"].replay()
        g.canary.record_replay()
        g.canary.poll(torch.cuda.current_stream().cuda_stream)

    script = [[(1, list(range(100, 112)))], [(1, [112]), (2, list(range(200, 208)))],
              [(1, [113]), (2, list(range(208, 214)))], "share", [(1, [114]), (2, [214]), (3, [300, 301, 302, 303])],
              "finish", [(2, [215]), (3, [304]), (1, [400, 401, 402])], [(2, [216]), (3, [305]), (1, [403])],
              [(2, [217]), (3, [306]), (1, [404])]]
    k = 0
    for item in script:
        if item == "share":
            g.share_prefix(1, 3, 6)
        elif item == "finish":
            g.finish(1, keep=6)
        else:
            step(item, _wrong_rtt if k == 3 else None)
            k += 1
    g.canary.flush()
    assert key(g.records) == key(eager_records)
    eb, gb = buffers(eager.canary), buffers(g.canary)
    for name in eb:
        np.testing.assert_array_equal(eb[name], gb[name], err_msg=str(name))
    g.canary.health_check()
