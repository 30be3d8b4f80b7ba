"""Issues 4 and 6: one full canary step through ``kvcanary.ops``, eager and graph-replayed.

A step is what an engine runs per forward for the K half: ``build_plan`` once, then HEAD (verify
the cached prefix without real KV, stamp the new tokens) and TAIL (verify the prefix in the
variant's mode, stamp the new tokens with their fingerprints). The fused design uses
``fused_verify``; the plan + verify + write design materialises the plan (``build_plan`` with
``materialize=True``) and uses ``verify``; the SGLang-shaped design of issue 6 runs the same
materialised plan, then perf/kernels/baseline.cu: a 64 x 512 persistent verify and one thread per
request for the write (kvcanary's params structs, packed by ``kvcanary.ops.prepare_*``). Shapes: decode bs 1/64/256 x context 4096 and a
prefill 1 x 32768; identity-only and PARTIAL (1 source, 1 KiB per token).

One benchmark per measured operation (``what``): the fused step graph-replayed and eager (GPU
time vs bytes it must touch / copy bandwidth; the graph is captured with the raw driver, no
torch), the SGLang-shaped design and kvcanary's own plan design graph-replayed (each against the
fused step's graph replay, timed beside it; SGLang-shaped target >= 3x for decode bs 256), and
the host time per eager step vs launches x raw launch floor. Before timing, the SGLang-shaped
step must leave the canary buffers byte-equal to kvcanary's step, and every step must leave the
ring empty.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi, ops

from .clocks import gpu_timed
from .timing import Graph
from .workloads import STEP_SHAPES, settle, write

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


def sglang_step_fn(w, mode: str, probes):
    """(fn(stream), [(name, fn(stream))] of its launches) of the SGLang-shaped design, or
    (None, []) when kvcanary.ops cannot pack launches."""
    if not all(hasattr(ops, n) for n in ("prepare_build_plan", "prepare_verify", "prepare_write")):
        return None, []
    contexts = (w.context("identity", abi.LaunchTag.HEAD_K_FULL), w.context(mode, abi.LaunchTag.TAIL_K_FULL))
    plan = w.plan(materialize=True)
    build = ops.prepare_build_plan(w.batch, plan)
    b = w.batch
    pairs = [(ops.prepare_verify(c, plan), ops.prepare_write(c, plan, b.input_ids, b.positions, b.out_cache_loc))
             for c in contexts]
    write_grid = -(-plan.max_batch // 256)

    pieces = [(launch.name, launch) for launch in build]
    for verify, wr in pairs:
        pieces.append(("kvcb_verify_persistent", lambda s, a=verify.address: probes.launch_packed(
            "kvcb_verify_persistent", 64, 512, s, a)))
        pieces.append(("kvcb_write_one_thread", lambda s, a=wr.address: probes.launch_packed(
            "kvcb_write_one_thread", write_grid, 256, s, a)))

    def step(s: int) -> None:
        for _, piece in pieces:
            piece(s)

    step.keep_alive = (plan, contexts, build, pairs)  # packed launches hold raw pointers into these
    return step, pieces


def buffers(w, mode: str, poison_new: bool = False) -> list[np.ndarray]:
    """Host copies of the step's HEAD and TAIL buffers; ``poison_new`` first overwrites the new
    tokens' records on the device, so a write that stores nothing cannot pass as equal."""
    out = []
    for m, tag in (("identity", abi.LaunchTag.HEAD_K_FULL), (mode, abi.LaunchTag.TAIL_K_FULL)):
        array = w.context(m, tag).buffer.array
        host = array.numpy()
        if poison_new:
            host[w.slots[:, w.prefix:].ravel()] = 0xA5
            array.copy_from_host(host)
        out.append(host)
    settle()
    return out


def check_sglang_step(w, mode: str, fused, pieces, handle: int) -> None:
    """The SGLang-shaped step writes byte for byte what kvcanary's fused step writes."""
    fused(handle)
    ours = buffers(w, mode, poison_new=False)
    buffers(w, mode, poison_new=True)
    for what, piece in pieces:  # one launch at a time, so a fault names its kernel
        piece(handle)
        try:
            settle()
        except kc.KvCanaryError as exc:
            pytest.fail(f"SGLang-shaped step: {what} failed: {exc}")
    for a, b in zip(ours, buffers(w, mode)):
        np.testing.assert_array_equal(a, b, err_msg="the SGLang-shaped step must write what kvcanary writes")


@gpu_timed
@pytest.mark.parametrize("what", ["fused-graph", "fused-eager", "sglang-graph", "plan-graph"])
@pytest.mark.parametrize("mode", ["identity", "partial"])
@pytest.mark.parametrize("shape", list(STEP_SHAPES))
def test_step(report, workloads, timer, bounds, probes, shape, mode, what):
    w = workloads.get(*STEP_SHAPES[shape])
    fused = step_fn(w, mode, "fused")
    name = f"step {mode}, {w.label}"
    h = timer.handle
    design, replay = what.split("-")
    if design == "sglang":
        measured, pieces = sglang_step_fn(w, mode, probes)
        if measured is None:
            pytest.skip("kvcanary.ops cannot pack the launches of the SGLang-shaped step")
        check_sglang_step(w, mode, fused, pieces, h)
    else:
        measured = fused if design == "fused" else step_fn(w, mode, design)
    graph = Graph(timer, measured) if replay == "graph" else None
    t = report.gpu(graph.launch if graph else measured)
    assert w.violations() == 0, "the benchmark workload must step clean"
    if design == "fused":
        nbytes = w.step_bytes(mode)
        bound, bound_name = bounds.step(w, mode)
        tokens = w.entries + w.new_tokens
        report.row(f"{name}, fused, {replay}", t, "s", bound=bound, bound_name=bound_name,
                   series=f"{'step' if w.extend == 1 else 'prefill step'} {mode} {replay}", size=tokens,
                   **{"entries/s": tokens / t, "GB/s": nbytes / t / 1e9}, bytes_must=nbytes,
                   gpu_launch_floor_s=LAUNCHES["fused"] * bounds.gpu_launch_floor)
        return
    fused_graph = Graph(timer, fused)
    t_fused = timer.gpu_time(fused_graph.launch)  # the reference, timed beside the benchmark
    assert w.violations() == 0, "the benchmark workload must step clean"
    if design == "sglang":
        report.row(f"{name}: SGLang-shaped design / fused, graph", t, "s", bound=t_fused,
                   bound_name="fused step", ratio=t / t_fused,
                   target=DESIGN_TARGET if shape == "decode-bs256" else None)
    else:
        report.row(f"{name}: kvcanary plan+verify+write / fused, graph", t, "s", bound=t_fused,
                   bound_name="fused step", ratio=t / t_fused)


@pytest.mark.parametrize("mode", ["identity", "partial"])
@pytest.mark.parametrize("shape", list(STEP_SHAPES))
def test_step_host_time(report, workloads, timer, bounds, shape, mode):
    w = workloads.get(*STEP_SHAPES[shape])
    fused, h = step_fn(w, mode, "fused"), timer.handle
    t = report.host(lambda: fused(h), batch=10, rounds=15, sync=timer.sync)
    assert w.violations() == 0, "the benchmark workload must step clean"
    floor = LAUNCHES["fused"] * bounds.launch_floor
    report.row(f"step {mode}, {w.label}: host time per eager step (kvcanary.ops)", t, "s", bound=floor,
               bound_name=f"{LAUNCHES['fused']} x raw launch floor")
