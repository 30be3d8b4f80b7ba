"""Issue 29: where a graph-replayed manager step's time goes, kernel by kernel.

The lent H200 has no Nsight Systems, so the timeline comes from the torch profiler (CUPTI kernel
activity, which keeps a replayed graph's kernels and their programmatic-dependent-launch overlap):
the manager's K+V identity step (``perf/test_baselines.py``'s ``make_manager``), replayed from a
``torch.cuda.graph`` with the plan build folded into HEAD's writes (``KVCANARY_FOLD=1``) and apart
(the default), 30 replays each, each after an L2 flush and a spin gate as the timed rows run it.
Per kernel of the step (in launch order): its start after the step's first kernel started, its
duration and its gap after the previous kernel ended (negative: the two overlapped), medians over
the replays. Rows: the step's span (first kernel start to last kernel end) against the sum of its
kernels' durations (below 1: the kernels overlapped), folded and apart; the per-kernel medians go
in the row (``kernels``) and, with ``KVCANARY_TIMELINE_DIR`` set, a JSON file per case there.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

import pytest

from .clocks import gpu_timed
from .test_baselines import graphed_step, make_manager
from .workloads import STEP_SHAPES

REPLAYS = 30
GATE_NS = 20_000


def kernel_events(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every kvcanary kernel of a chrome trace, in start order."""
    out = [(e["name"], float(e["ts"]), float(e["dur"])) for e in trace.get("traceEvents", [])
           if e.get("cat") == "kernel" and str(e.get("name", "")).startswith("kvc_")]
    return sorted(out, key=lambda k: k[1])


def per_kernel(events: list[tuple[str, float, float]], replays: int) -> list[dict]:
    """Medians per kernel position of ``replays`` equal replays of one step (see the docstring)."""
    if not events or len(events) % replays:
        raise AssertionError(f"perf: {len(events)} kvcanary kernels traced, not a multiple of {replays} replays")
    n = len(events) // replays
    steps = [events[i * n:(i + 1) * n] for i in range(replays)]
    names = [k[0] for k in steps[0]]
    if any([k[0] for k in s] != names for s in steps):
        raise AssertionError("perf: the replays traced different kernel sequences")
    out = []
    for j, name in enumerate(names):
        start = [s[j][1] - s[0][1] for s in steps]
        dur = [s[j][2] for s in steps]
        gap = [s[j][1] - (s[j - 1][1] + s[j - 1][2]) for s in steps] if j else [0.0] * replays
        out.append(dict(name=name, start_us=statistics.median(start), dur_us=statistics.median(dur),
                        gap_us=statistics.median(gap)))
    spans = [max(k[1] + k[2] for k in s) - s[0][1] for s in steps]
    out.append(dict(name="(step span)", start_us=0.0, dur_us=statistics.median(spans), gap_us=0.0))
    return out


def trace_replays(fn, timer, replays: int = REPLAYS) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn(timer.handle)
    timer.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            timer.flush_l2()
            timer.probes.spin(GATE_NS, timer.handle)
            fn(timer.handle)
        timer.sync()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return per_kernel(kernel_events(trace), replays)


@gpu_timed
@pytest.mark.parametrize("fold", [True, False], ids=["folded", "apart"])
@pytest.mark.parametrize("shape", ["decode-bs1", "decode-bs64"])
def test_manager_step_timeline(report, workloads, timer, monkeypatch, shape, fold):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.profiler")
    from kvcanary.ops import backends
    w = workloads.get(*STEP_SHAPES[shape])
    monkeypatch.setattr(backends, "FOLD", fold)
    canary = make_manager(w, "identity", True)
    step = graphed_step(torch, w, canary, timer)
    report.gpu(step)
    kernels = trace_replays(step, timer)
    canary.flush()
    assert canary.stats()["violations"] == 0, "the benchmark workload must step clean"
    first = kernels[0]["name"]
    assert first.startswith("kvc_prepare_write") if fold else first == "kvc_prepare", first
    span, busy = kernels[-1]["dur_us"], sum(k["dur_us"] for k in kernels[:-1])
    how = "folded" if fold else "apart"
    for k in kernels:
        print(f"\n[timeline] {shape} {how}: {k['name']:<40} start {k['start_us']:7.2f} dur {k['dur_us']:6.2f} "
              f"gap {k['gap_us']:6.2f} us", end="")
    out = os.environ.get("KVCANARY_TIMELINE_DIR")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"timeline-{shape}-{how}.json"), "w") as f:
            json.dump(kernels, f, indent=1)
    report.row(f"manager step identity, K+V, {w.label}, graph, plan build {how}: kernel span (torch profiler)",
               span * 1e-6, "s", bound=busy * 1e-6, bound_name="sum of its kernels' durations (same trace)",
               kernels=kernels)
