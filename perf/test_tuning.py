"""Issue 6: the request-major verify's launch shape, swept in one run (GPU; no targets).

``kvc_fused_verify_rm`` has two tuning constants in kvcanary/abi.py: ``RM_CHUNKS`` (a task spans
RM_CHUNKS x VERIFY_LANE_ENTRIES positions of 32 requests) and ``RM_MIN_BLOCKS`` (its launch
bound: registers per thread, hence blocks per SM). Each combination is compiled here with NVRTC
into a library of its own (verify.cu only; the prelude rendered with the swept values) and
launched with the params ops packed for the shipped kernel: the constants change no params
struct. One benchmark per combination and mode (its stats: the launch's GPU time): decode bs
256 x 4096, identity-only and PARTIAL, against the bytes it must touch / copy bandwidth, the
shipped combination marked. Every run must find the workload clean, which also checks each
variant's hashing.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
from cuda.bindings import driver as cu

import kvcanary as kc
from kvcanary import abi, ops
from kvcanary.compile import compile_cubin, read_sources
from kvcanary.driver import check

from .clocks import gpu_timed
from .workloads import DECODE_256

CHUNKS = (1, 2, 4, 8)
MIN_BLOCKS = (2, 3, 4)


@contextlib.contextmanager
def constants(**values):
    old = {k: getattr(abi, k) for k in values}
    for k, v in values.items():
        setattr(abi, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(abi, k, v)


@functools.lru_cache(maxsize=None)
def variant_cubin(arch: int, chunks: int, min_blocks: int) -> bytes:
    """verify.cu compiled with the swept constants (once per session)."""
    sources = {n: s for n, s in read_sources().items() if n in ("verify.cu", "common.cuh", "fingerprint.cuh")}
    with constants(RM_CHUNKS=chunks, RM_MIN_BLOCKS=min_blocks):
        return compile_cubin(sources, abi.render_prelude(), arch)


def variant(rt, chunks: int, min_blocks: int):
    """(library, kvc_fused_verify_rm function) of one swept combination, loaded on ``rt``."""
    cubin = variant_cubin(rt.arch, chunks, min_blocks)
    lib = check(rt.call(cu.cuLibraryLoadData, cubin, None, None, 0, None, None, 0), "cuLibraryLoadData(tuning)")
    kernel = check(cu.cuLibraryGetKernel(lib, b"kvc_fused_verify_rm"), "cuLibraryGetKernel")
    return lib, check(rt.call(cu.cuKernelGetFunction, kernel), "cuKernelGetFunction")


@gpu_timed
@pytest.mark.parametrize("min_blocks", MIN_BLOCKS)
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("mode", ["identity", "partial"])
def test_request_major_launch_shape(report, workloads, timer, bounds, mode, chunks, min_blocks):
    w = workloads.get(*DECODE_256)
    ctx = w.context(mode)
    plan = w.plan()
    kc.build_plan(w.batch, plan, stream=timer.handle)
    launch = ops.prepare_fused_verify(ctx, w.batch, plan)
    assert launch.name == "kvc_fused_verify_rm"
    rt = launch.rt
    lib, fn = variant(rt, chunks, min_blocks)
    try:
        with constants(RM_CHUNKS=chunks, RM_MIN_BLOCKS=min_blocks):  # the grid ops would give it
            _, grid, _ = ops._verify_kernel("kvc_fused_verify", rt, launch.params, plan.verify_capacity,
                                            ctx.hash_bytes)

        def run(s):
            check(cu.cuLaunchKernel(fn, grid, 1, 1, abi.BLOCK_THREADS, 1, 1, 0, s, launch.address, 0),
                  "cuLaunchKernel(tuning)")

        t = report.gpu(run)
        assert w.violations() == 0, f"chunks {chunks}, {min_blocks} blocks/SM: the workload must verify clean"
    finally:
        timer.sync()
        check(cu.cuLibraryUnload(lib), "cuLibraryUnload")
    shipped = (chunks, min_blocks) == (abi.RM_CHUNKS, abi.RM_MIN_BLOCKS)
    report.row(f"tuning: verify fused_rm {mode}, {w.label}, chunks {chunks}, {min_blocks} blocks/SM"
               + (" (shipped)" if shipped else ""), t, "s", bound=w.verify_bytes(mode) / bounds.copy_bandwidth,
               bound_name="bytes it must touch / copy bw", chunks=chunks, min_blocks=min_blocks, grid=grid)
