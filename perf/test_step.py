"""Issues 4 and 6: one full canary step through ``kvcanary.ops``, eager and graph-replayed.

A step is what an engine runs per forward for the K half: ``build_plan`` once, then HEAD (verify
the cached prefix without real KV, stamp the new tokens) and TAIL (verify the prefix in the
variant's mode, stamp the new tokens with their fingerprints). The fused design uses
``fused_verify``; the plan + verify + write design materialises the plan (``build_plan`` with
``materialize=True``) and uses ``verify``. Shapes: decode bs 1/64/256 x context 4096 and a
prefill 1 x 32768; identity-only and PARTIAL (1 source, 1 KiB per token).

Rows: GPU time vs bytes it must touch / copy bandwidth (eager and graph-replayed; the graph is
captured with the raw driver, no torch), fused vs plan design (graph-replayed; target >= 3x for
decode bs 256), and host time per eager step vs launches x raw launch floor.
"""

from __future__ import annotations

import pytest

import kvcanary as kc
from kvcanary import abi

from .timing import Graph
from .workloads import STEP_SHAPES, write

DESIGN_TARGET = (">=", 3.0)
LAUNCHES = {"fused": 5, "plan": 6}  # prepare (+ expand), then verify + write for HEAD and TAIL


def step_fn(w, mode: str, design: str):
    """fn(stream) enqueueing one step of ``design`` on workload ``w``."""
    head = w.context("identity", abi.LaunchTag.HEAD_K_FULL)
    tail = w.context(mode, abi.LaunchTag.TAIL_K_FULL)
    plan = w.plan(materialize=design == "plan")

    def step(s: int) -> None:
        kc.build_plan(w.batch, plan, stream=s)
        for ctx in (head, tail):
            if design == "plan":
                kc.verify(ctx, plan, stream=s)
            else:
                kc.fused_verify(ctx, w.batch, plan, stream=s)
            write(ctx, plan, w.batch, s)

    return step


@pytest.mark.parametrize("mode", ["identity", "partial"])
@pytest.mark.parametrize("shape", list(STEP_SHAPES))
def test_step(report, workloads, timer, bounds, shape, mode):
    w = workloads.get(*STEP_SHAPES[shape])
    steps = {d: step_fn(w, mode, d) for d in ("fused", "plan")}

    def measure():
        out = {}
        for design, fn in steps.items():
            out[design, "eager"] = timer.gpu_time(fn)
            graph = Graph(timer, fn)
            out[design, "graph"] = timer.gpu_time(graph.launch)
        h = timer.handle
        out["host"] = timer.host_time({"step": lambda: steps["fused"](h)}, batch=10, repeat=15)["step"]
        return out

    t = report.measure(measure)
    assert w.violations() == 0, "the benchmark workload must step clean"
    nbytes = w.step_bytes(mode)
    bound = nbytes / bounds.copy_bandwidth
    name = f"step {mode}, {w.label}"
    tokens = w.entries + w.new_tokens
    for replay in ("graph", "eager"):
        fused = t["fused", replay]
        report.row(f"{name}, fused, {replay}", fused, "s", bound=bound,
                   bound_name="bytes it must touch / copy bw", series=f"step {mode} {replay}",
                   size=tokens, **{"entries/s": tokens / fused, "GB/s": nbytes / fused / 1e9},
                   plan_design_s=t["plan", replay], bytes_must=nbytes,
                   gpu_launch_floor_s=LAUNCHES["fused"] * bounds.gpu_launch_floor)
    speedup = t["plan", "graph"] / t["fused", "graph"]
    report.row(f"{name}: plan+verify+write design / fused, graph", t["plan", "graph"], "s",
               bound=t["fused", "graph"], bound_name="fused step", ratio=speedup,
               target=DESIGN_TARGET if shape == "decode-bs256" else None)
    floor = LAUNCHES["fused"] * bounds.launch_floor
    report.row(f"{name}: host time per eager step (kvcanary.ops)", t["host"], "s", bound=floor,
               bound_name=f"{LAUNCHES['fused']} x raw launch floor")
