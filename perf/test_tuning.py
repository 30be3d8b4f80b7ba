"""Issue 13: the narrow verify's block tile swept in one run (GPU; no targets: it says what to ship).

The warp-tiled verify (kernels_src/verify.cu) has three tuning constants in kvcanary/abi.py:
``VERIFY_LANE_ENTRIES`` and ``HASHED_LANE_ENTRIES`` (entries per lane in a warp tile, VT, without
and with fingerprints: a variant here sets both) and ``VERIFY_MIN_BLOCKS`` (its
launch bound: registers per thread, hence blocks per SM). Each combination is compiled here with
NVRTC into a library of its own (verify.cu with ``KVC_TUNE_VT`` / ``KVC_TUNE_BLOCKS_PER_SM``
defined) and launched with the params ops packed for the shipped fused verify on the grid ops
would give it (the driver's occupancy of the variant, never more blocks than tiles): the
constants change no params struct. One benchmark per combination, layout and mode (its stats: the
launch's GPU time), decode bs 256 x 4096, against the bytes it must touch; every run must find
the workload clean, which also checks each variant's hashing. The shipped combination is marked.
"""

from __future__ import annotations

import functools

import pytest
from cuda.bindings import driver as cu

import kvcanary as kc
from kvcanary import abi, ops
from kvcanary.runtime.driver import check
from kvcanary.runtime.nvrtc_build import read_sources
from kvcanary.runtime.nvrtc_program import compile_cubin

from .clocks import gpu_timed
from .workloads import DECODE_256

TILE_ENTRIES = (1, 2, 4, 8)
BLOCKS_PER_SM = (2, 4, 8)


@functools.lru_cache(maxsize=None)
def variant_cubin(arch: int, vt: int, blocks: int) -> bytes:
    """verify.cu compiled with the swept constants (once per session)."""
    sources = {n: s for n, s in read_sources().items() if n in ("verify.cu", "common.cuh", "fingerprint.cuh")}
    sources["verify.cu"] = f"#define KVC_TUNE_VT {vt}\n#define KVC_TUNE_BLOCKS_PER_SM {blocks}\n" + sources["verify.cu"]
    return compile_cubin(sources, abi.render_prelude(), arch)


def variant(rt, vt: int, blocks: int):
    """(library, kvc_fused_verify function) of one swept combination, loaded on ``rt``."""
    lib = check(rt.call(cu.cuLibraryLoadData, variant_cubin(rt.arch, vt, blocks), None, None, 0, None, None, 0),
                "cuLibraryLoadData(tuning)")
    kernel = check(cu.cuLibraryGetKernel(lib, b"kvc_fused_verify"), "cuLibraryGetKernel")
    return lib, check(rt.call(cu.cuKernelGetFunction, kernel), "cuKernelGetFunction")


@gpu_timed
@pytest.mark.parametrize("blocks", BLOCKS_PER_SM)
@pytest.mark.parametrize("vt", TILE_ENTRIES)
@pytest.mark.parametrize("layout", ["decode", "paged", "random"])
@pytest.mark.parametrize("mode", ["identity", "partial"])
def test_verify_tile_shape(report, workloads, timer, bounds, mode, layout, vt, blocks):
    w = workloads.get(*DECODE_256, layout=layout)
    ctx = w.context(mode)
    plan = w.plan()
    kc.build_plan(w.batch, plan, stream=timer.handle)
    launch = ops.prepare_fused_verify(ctx, w.batch, plan)
    assert launch.name == "kvc_fused_verify"
    rt = launch.rt
    lib, fn = variant(rt, vt, blocks)
    try:
        per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, abi.BLOCK_THREADS, 0), "occupancy")
        tile = (32 * vt - 1) * (abi.BLOCK_THREADS // 32)  # entries a block of warp tiles verifies per round
        grid = max(1, min(int(per_sm) * rt.sm_count, -(-plan.verify_capacity // tile)))

        def run(s):
            check(cu.cuLaunchKernel(fn, grid, 1, 1, abi.BLOCK_THREADS, 1, 1, 0, s, launch.address, 0),
                  "cuLaunchKernel(tuning)")

        t = report.gpu(run)
        assert w.violations() == 0, f"VT {vt}, {blocks} blocks/SM: the workload must verify clean"
    finally:
        timer.sync()
        check(cu.cuLibraryUnload(lib), "cuLibraryUnload")
    lanes = abi.HASHED_LANE_ENTRIES if mode != "identity" else abi.VERIFY_LANE_ENTRIES  # what ops ships per mode
    shipped = (vt, blocks) == (lanes, abi.VERIFY_MIN_BLOCKS)
    report.row(f"tuning: verify fused {mode}, {w.label}, VT {vt}, {blocks} blocks/SM" + (" (shipped)" if shipped else ""),
               t, "s", bound=w.verify_bound_bytes(mode) / bounds.copy_bandwidth, bound_name="bytes it must touch / copy bw",
               vt=vt, min_blocks=blocks, grid=grid, resident_per_sm=int(per_sm))
