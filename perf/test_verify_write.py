"""Issues 3 and 6: verify and write throughput on the GPU, next to the bounds of this run.

Issue 28: the request verdicts' cost, the fused verify at decode bs 256 x 4096 with a sink that keeps
them (the canary's) against the same launch without (the pointers 0), timed alternately in one run.

Verify: decode bs 256 x context 4096 = 1M entries, identity-only, PARTIAL (1 source) and ALL
(1 source, 1 KiB per token), fused (``kvcanary.fused_verify``) at decode bs 256 and 64 x 4096 on
every slot layout of perf/workloads.py (lockstep decode, contiguous, paged, a vLLM-like mix of
block-table lengths, random), each against (a) the bytes it must touch / copy bandwidth (a 32-byte
sector per PARTIAL strip), (b) the plain one-entry-per-thread verify a competent engineer writes
first (perf/kernels/baseline.cu's kvcb_verify_simple) on the same launch and (c) the same-loads
probe of the fused verify (issue 29: every layout, the vLLM mix of request lengths included); the
materialised plan (``kvcanary.verify``) on the default layout. Write: 256 requests x 1 token
(decode) and 1 x 32768 (prefill), identity-only and ALL; a prefill against the serial-chain probe;
and (issue 29) the decode write PARTIAL and ALL on paged slots against the SGLang-shaped write (a
one-thread block per request, as SGLang's canary documents its write kernel), target <= 1.0x.
Each benchmark's stats are its launch's GPU time (CUDA events, L2 flushed before each round); the
probe, the entry-major comparison and the bounds are measured beside it with the same timer. Every
timed launch must leave the ring empty.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc

from .clocks import gpu_timed
from .workloads import DECODE_64, DECODE_256, MODES, write

VERIFY_TARGETS = {"identity": ("<=", 1.5), "partial": ("<=", 2.0)}  # issue 13: on every layout, both shapes
ALL_BANDWIDTH_TARGET = (">=", 0.9)
BASELINE_TARGET = ("<=", 1.0)   # kvcanary / the simple one-entry-per-thread verify: faster everywhere
PROBE_TARGETS = {"identity": ("<=", 1.15), "partial": ("<=", 1.3)}  # issue 29: vs the same-loads probe, every layout
PREFILL_TARGETS = {"identity": ("<=", 1.3), "all": ("<=", 1.5)}
SHAPES = {"bs256": DECODE_256, "bs64": DECODE_64}


def simple_verify(probes, ctx, w, plan):
    """fn(stream): perf/kernels/baseline.cu's kvcb_verify_simple on the params ops packed for the
    fused verify (one entry per lane, grid-stride over one resident wave of its blocks)."""
    from kvcanary import ops
    launch = ops.prepare_fused_verify(ctx, w.batch, plan)
    grid = probes.resident_grid("kvcb_verify_simple", plan.verify_capacity)
    return lambda s: probes.launch_packed("kvcb_verify_simple", grid, 256, s, launch.address), launch


@gpu_timed
@pytest.mark.parametrize("layout", ["decode", "contiguous", "paged", "vllm", "random"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", list(MODES))
def test_verify_throughput(report, workloads, timer, bounds, probes, mode, shape, layout):
    """The fused verify on every slot layout, next to the bytes it must touch, the simple
    baseline on the same launch and the same-loads probe."""
    w = workloads.get(*SHAPES[shape], layout=layout)
    ctx = w.context(mode)
    plan = w.plan()
    kc.build_plan(w.batch, plan, stream=timer.handle)
    t = report.gpu(lambda s: kc.fused_verify(ctx, w.batch, plan, stream=s))
    assert w.violations() == 0, "the benchmark workload must verify clean"
    simple, _keep = simple_verify(probes, ctx, w, plan)
    t_simple = timer.gpu_time(simple)
    assert w.violations() == 0, "the simple baseline must verify the workload clean as well"
    copy = bounds.copy_bandwidth
    must, touched = w.verify_bound_bytes(mode), w.verify_touched(mode, False)
    name = f"verify fused {mode}, {w.label}"
    common = dict(series=f"verify fused {mode} ({layout}, {shape})", size=w.entries, **{"entries/s": w.entries / t},
                  **{"GB/s": touched / t / 1e9}, bytes_touched=touched, bytes_must=must, simple_s=t_simple)
    report.row(name, t, "s", bound=must / copy, bound_name="bytes it must touch (a sector per PARTIAL strip) / copy bw",
               target=VERIFY_TARGETS.get(mode), **common)
    report.row(f"{name}: kvcanary / simple one-entry-per-thread verify", t, "s", bound=t_simple,
               bound_name="kvcb_verify_simple, same launch", target=BASELINE_TARGET)
    probe, probes_t = bounds.verify_probe(w, mode, plan)
    report.row(f"{name}: vs same-loads probe", t, "s", bound=probe, bound_name="same-loads probe",
               target=PROBE_TARGETS.get(mode), probe_s=probes_t)
    if mode == "all":
        report.row(f"{name}: bytes read / copy bandwidth", touched / t, "B/s", bound=copy,
                   bound_name="copy bw", target=ALL_BANDWIDTH_TARGET)


VERDICT_TARGET = ("<=", 1.02)  # issue 28: the verdicts add at most 2 % to the verify step


def verdict_context(w, ctx) -> kc.VerifyContext:
    """``ctx`` (same buffer, sources, mode, tag) with a sink that keeps request verdicts (§5.7)."""
    from kvcanary.runtime import memory
    sink = w.sink
    verdicts = kc.ViolationSink(*sink.arrays, verdicts=memory.zeros((w.bs,), "int64", 0),
                                failed_requests=memory.zeros((1,), "int64", 0),
                                ring_requests=memory.zeros((sink.capacity,), "int64", 0))
    return kc.VerifyContext(ctx.buffer, verdicts, ctx.tag, ctx.sources, ctx.hash_mode)


@gpu_timed
@pytest.mark.parametrize("mode", list(MODES))
def test_verdict_overhead(report, workloads, timer, mode):
    """The verify step with request verdicts on against the same launch with them off (issue 28)."""
    w = workloads.get(*DECODE_256)
    ctx = w.context(mode)
    on = verdict_context(w, ctx)
    plan = w.plan()
    kc.build_plan(w.batch, plan, stream=timer.handle, reset_verdicts=False)
    fns = {"on": lambda s: kc.fused_verify(on, w.batch, plan, stream=s),
           "off": lambda s: kc.fused_verify(ctx, w.batch, plan, stream=s)}
    report.gpu(fns["on"])
    t = timer.gpu_time_interleaved(fns)  # the ratio from rounds interleaved: clock drift cancels
    assert w.violations() == 0 and int(on.sink.verdict_arrays[1].numpy()[0]) == 0, "the workload must verify clean"
    report.row(f"verify fused {mode}, {w.label}: request verdicts on / off", t["on"], "s", bound=t["off"],
               bound_name="the same launch without verdicts, interleaved rounds", target=VERDICT_TARGET,
               series=f"verdicts {mode}", off_s=t["off"])


@gpu_timed
@pytest.mark.parametrize("mode", list(MODES))
def test_verify_plan_throughput(report, workloads, timer, bounds, mode):
    """The materialised-plan verify (sweeps, ``fused=False``) on the default layout."""
    w = workloads.get(*DECODE_256)
    ctx = w.context(mode)
    plan = w.plan(materialize=True)
    kc.build_plan(w.batch, plan, stream=timer.handle)
    t = report.gpu(lambda s: kc.verify(ctx, plan, stream=s))
    assert w.violations() == 0, "the benchmark workload must verify clean"
    probe, probes_t = bounds.verify_probe(w, mode, plan)
    report.row(f"verify plan {mode}, {w.label}", t, "s", bound=w.verify_bound_bytes(mode) / bounds.copy_bandwidth,
               bound_name="bytes it must touch / copy bw", series=f"verify plan {mode}", size=w.entries,
               **{"entries/s": w.entries / t})
    report.row(f"verify plan {mode}, {w.label}: vs same-loads probe", t, "s", bound=probe,
               bound_name="same-loads probe", probe_s=probes_t)


@gpu_timed
@pytest.mark.parametrize("mode", ["identity", "all"])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_write_throughput(report, workloads, timer, bounds, shape, mode):
    w = workloads.get(*(DECODE_256 if shape == "decode" else (1, 0, 32768)))
    ctx = w.context(mode)
    plan = w.plan()
    kc.build_plan(w.batch, plan, stream=timer.handle)
    t = report.gpu(lambda s: write(ctx, plan, w.batch, s))
    assert w.violations() == 0, "the benchmark workload must write clean"
    nbytes = w.write_bytes(mode)
    extra = dict(series=f"write {mode}", size=w.new_tokens, **{"entries/s": w.new_tokens / t},
                 **{"GB/s": nbytes / t / 1e9}, bytes_must=nbytes)
    name = f"write {mode}, {'decode' if w.extend == 1 else 'prefill'} {w.bs}x{w.extend} new tokens"
    if shape == "prefill":
        chain = bounds.chain(w.new_tokens)
        report.row(name, t, "s", bound=chain, bound_name=f"serial mix3 chain x{w.new_tokens}",
                   target=PREFILL_TARGETS[mode], **extra)
    else:
        report.row(name, t, "s", bound=nbytes / bounds.copy_bandwidth,
                   bound_name="bytes it must touch / copy bw", gpu_launch_floor_s=bounds.gpu_launch_floor,
                   **extra)


def sglang_write(probes, ctx, plan, batch):
    """fn(stream) of the write as SGLang's canary documents its ``canary_write_kernel``: one
    single-thread block per request, the chain and each entry's fingerprint serial in that thread
    (perf/kernels/baseline.cu's kvcb_write_one_thread launched with blocks of one thread), on the
    params kvcanary.ops packed for kvcanary's own write; and the packed launch (kept alive)."""
    from kvcanary import ops
    launch = ops.prepare_write(ctx, plan, batch.input_ids, batch.positions, batch.out_cache_loc)
    return lambda s: probes.launch_packed("kvcb_write_one_thread", plan.max_batch, 1, s, launch.address), launch


@gpu_timed
@pytest.mark.parametrize("mode", ["partial", "all"])
def test_write_vs_sglang(report, workloads, timer, probes, mode):
    """Issue 29: kvcanary's decode write against the SGLang-shaped write on the same launch (bs 256,
    a paged pool after churn, 1 KiB per token), timed in interleaved rounds. Before timing, the
    SGLang-shaped write must store what kvcanary's stores (the new slots poisoned between)."""
    w = workloads.get(*DECODE_256, layout="paged")
    ctx = w.context(mode)
    plan = w.plan()
    kc.build_plan(w.batch, plan, stream=timer.handle)
    ours = lambda s: write(ctx, plan, w.batch, s)  # noqa: E731
    theirs, _keep = sglang_write(probes, ctx, plan, w.batch)  # _keep owns the params theirs points at
    new = w.slots[:, w.prefix:].ravel()
    stamped = []
    for fn in (ours, theirs):
        host = ctx.buffer.array.numpy()
        host[new] = 0xA5  # a write that stores nothing cannot pass as equal
        ctx.buffer.array.copy_from_host(host)
        fn(timer.handle)
        timer.sync()
        stamped.append(ctx.buffer.array.numpy()[new])
    np.testing.assert_array_equal(stamped[1], stamped[0], err_msg="the SGLang-shaped write must store what kvcanary stores")
    report.gpu(ours)
    t = timer.gpu_time_interleaved({"kvcanary": ours, "sglang": theirs})
    assert w.violations() == 0, "the benchmark workload must write clean"
    report.row(f"write {mode}, decode {w.bs}x1 new tokens, paged slots: kvcanary / SGLang-shaped write "
               "(a one-thread block per request)", t["kvcanary"], "s", bound=t["sglang"],
               bound_name="SGLang-shaped write, interleaved rounds", target=BASELINE_TARGET,
               sglang_s=t["sglang"])
