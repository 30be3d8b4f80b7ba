"""Bounds measured in the same run as the benchmarks they judge.

- copy bandwidth: ``cuMemcpyDtoDAsync`` of 2 GiB, bytes read + written per second;
- "same loads, no compute" probes of each verify variant (perf/kernels/probes.cu);
- the serial-chain probe: one thread running ``kvc_mix3`` N times, no memory traffic;
- the host floor of a raw ``cuLaunchKernel`` of kvcanary's own empty kernel ``kvc_empty``
  (``KvcProbeParams`` through a prepacked pointer array), and the GPU time of an empty launch.
The same program carries perf/kernels/baseline.cu, the SGLang-shaped design kvcanary is compared
with (launched here with params structs packed by kvcanary.ops).

The probes are compiled here with kvcanary's NVRTC path (``compile_cubin`` with the generated ABI
prelude and kernels_src's ``common.cuh``) and loaded with ``cuLibraryLoadData``; they are never
part of kernels_src/, so they never ship and never enter kvcanary's compile cache key.
"""

from __future__ import annotations

import ctypes
from functools import cached_property
from pathlib import Path

import numpy as np
from cuda.bindings import driver as cu

from kvcanary import abi
from kvcanary.runtime import memory
from kvcanary.runtime.driver import check
from kvcanary.runtime.nvrtc_build import kernels_dir
from kvcanary.runtime.nvrtc_program import compile_cubin

from .timing import GpuTimer, pack_args, python_workload

KERNELS = Path(__file__).resolve().parent / "kernels"  # probes.cu, baseline.cu, owners.cuh
PROBE_NAMES = ("kvcp_spin", "kvcp_read", "kvcp_fill", "kvcp_chain", "kvcp_chain_vector", "kvcp_verify_loads",
               "kvcb_verify_persistent", "kvcb_write_one_thread", "kvcb_verify_simple")
KEY = 0x5EED_C0DE_0BAD_F00D  # probes store their folded loads only if they equal this: never
COPY_BYTES = 2 << 30
EMPTY_LAUNCHES = 100
BLOCK = 256

i64, u64 = ctypes.c_int64, ctypes.c_uint64


def probe_sources() -> dict[str, str]:
    """The perf program for compile_cubin: probes.cu, baseline.cu and their owners.cuh, and
    kernels_src's common.cuh."""
    return {**{name: (KERNELS / name).read_text() for name in ("probes.cu", "baseline.cu", "owners.cuh")},
            "common.cuh": (kernels_dir() / "common.cuh").read_text()}


def compile_probes(arch: int) -> bytes:
    return compile_cubin(probe_sources(), abi.render_prelude(), arch)


class Probes:
    """The probe kernels loaded on one device; each method enqueues one launch on ``stream``."""

    def __init__(self, rt):
        self.rt = rt
        lib = check(rt.call(cu.cuLibraryLoadData, compile_probes(rt.arch), None, None, 0, None, None, 0),
                    "cuLibraryLoadData(probes)")
        self.library = lib
        self.fn = {n: check(rt.call(cu.cuKernelGetFunction, check(cu.cuLibraryGetKernel(lib, n.encode()), n)), n)
                   for n in PROBE_NAMES}
        self.out = memory.zeros((1024,), np.uint64)

    def grid(self, items: int, per_sm: int = 32) -> int:
        return max(1, min(-(-items // BLOCK), self.rt.sm_count * per_sm))

    def launch(self, name: str, grid: int, block: int, stream: int, *args) -> None:
        addr, keep = pack_args(*args)
        check(cu.cuLaunchKernel(self.fn[name], grid, 1, 1, block, 1, 1, 0, stream, addr, 0), name)
        del keep  # cuLaunchKernel copied the arguments

    def launch_packed(self, name: str, grid: int, block: int, stream: int, address: int) -> None:
        """Launch a baseline kernel with a kvcanary ``launch.Launch``'s packed pointer array."""
        check(cu.cuLaunchKernel(self.fn[name], grid, 1, 1, block, 1, 1, 0, stream, address, 0), name)

    def spin(self, ns: int, stream: int) -> None:
        self.launch("kvcp_spin", 1, 32, stream, i64(ns))

    def read(self, ptr: int, nbytes: int, stream: int) -> None:
        n16 = nbytes // 16
        self.launch("kvcp_read", self.grid(n16, 8), BLOCK, stream, u64(ptr), i64(n16), u64(KEY), u64(self.out.ptr))

    def fill(self, ptr: int, nbytes: int, seed: int, stream: int) -> None:
        n = nbytes // 8
        self.launch("kvcp_fill", self.grid(n, 8), BLOCK, stream, u64(ptr), i64(n), u64(seed))

    def chain(self, n: int, stream: int, vector: bool = False) -> None:
        self.launch("kvcp_chain_vector" if vector else "kvcp_chain", 1, 32, stream, i64(n), u64(KEY), u64(self.out.ptr))

    def resident_grid(self, name: str, items: int, block: int = BLOCK) -> int:
        """Blocks of one resident wave of kernel ``name`` (its occupancy at ``block`` threads on
        this device), no more than ``items`` work items need: a grid-stride kernel's blocks then
        all run at once, never a second wave of a few blocks per SM."""
        per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.fn[name], block, 0), f"occupancy({name})")
        return max(1, min(int(per_sm) * self.rt.sm_count, -(-items // block)))

    def verify_loads(self, stream: int, *, canary, n: int, plan, rpi=None, prefix_lens=None, rtt=None,
                     src=None, src_row_stride: int = 0, page_size: int = 1, bytes_per_token: int = 16,
                     hash_bytes: int = 0, coop: bool = False) -> None:
        """The loads of ``n`` verify entries of ``plan`` (a StepPlan build_plan filled): a
        materialised plan's four arrays, or the fused indexing, each entry's request found in
        ``plan.entry_offsets`` and its ``rpi``/``prefix_lens``/``rtt`` cells read (any request
        lengths); real-KV strips per lane or, with ``coop``, coalesced across the warp."""
        p = lambda a: u64(0 if a is None else a.ptr)  # noqa: E731
        fused = not plan.materialized
        planned = (None,) * 4 if fused else (plan.slot, plan.expected_token, plan.expected_position, plan.prev_slot)
        if fused and (rpi is None or prefix_lens is None or rtt is None):
            raise ValueError("perf: the fused probe reads the batch: pass rpi, prefix_lens and rtt")
        self.launch("kvcp_verify_loads", self.grid(n), BLOCK, stream,
                    p(canary), i64(canary.shape[1] // 8), *(p(a) for a in planned),
                    p(plan.entry_offsets if fused else None), i64(rpi.shape[0] if fused else 0),
                    p(rpi), p(prefix_lens), p(rtt), i64(rtt.shape[1] if rtt is not None else 0),
                    p(src), i64(src_row_stride), i64(page_size), i64(bytes_per_token), i64(hash_bytes),
                    ctypes.c_int32(int(coop)), i64(n), u64(KEY), u64(self.out.ptr))


class Bounds:
    """Bounds of this run, each measured once on first use (session-wide)."""

    def __init__(self, rt, probes: Probes, timer: GpuTimer):
        self.rt, self.probes, self.timer = rt, probes, timer
        self._chain: dict[int, float] = {}

    def copy_fn(self):
        """fn(stream) enqueueing a ``cuMemcpyDtoDAsync`` of COPY_BYTES between two buffers it
        keeps (4 GiB in all, freed with the fn)."""
        src, dst = memory.empty((COPY_BYTES,), np.uint8), memory.empty((COPY_BYTES,), np.uint8)
        self.probes.fill(src.ptr, COPY_BYTES, 3, self.timer.handle)
        self.timer.sync()

        def copy(s: int) -> None:
            check(cu.cuMemcpyDtoDAsync(dst.ptr, src.ptr, COPY_BYTES, s), "cuMemcpyDtoDAsync")
        copy.buffers = (src, dst)
        return copy

    @cached_property
    def copy_bandwidth(self) -> float:
        """Device-to-device copy, bytes read + written per second."""
        t = self.timer.gpu_time(self.copy_fn(), warmup=3, repeat=15, flush=False)
        self.timer.sync()
        return 2 * COPY_BYTES / t

    @cached_property
    def raw_launch(self) -> tuple[object, int, object]:
        """(function, pointer-array address, keep-alive) of a raw kvc_empty launch."""
        params = abi.ProbeParams()
        addr, keep = pack_args(params)
        return self.rt.functions["kvc_empty"], addr, keep

    def raw_launch_fn(self):
        fn, addr, _ = self.raw_launch
        h = self.timer.handle
        return lambda: cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, h, addr, 0)

    @cached_property
    def launch_floor(self) -> float:
        """Host seconds per raw cuLaunchKernel (prepacked pointer array, no checks)."""
        return self.timer.host_time({"raw": self.raw_launch_fn()})["raw"]

    @cached_property
    def python_speed(self) -> float:
        """Host seconds of :func:`~.timing.python_workload` (the calibration of host rows: lent hosts
        differ in Python speed more than in launch floor)."""
        return self.timer.host_time({"python": python_workload}, batch=20)["python"]

    @cached_property
    def gpu_launch_floor(self) -> float:
        """GPU seconds per empty kernel, EMPTY_LAUNCHES back to back on one stream (eager)."""
        return self.timer.gpu_time(self.empty_launches_fn(), flush=False, per=EMPTY_LAUNCHES)

    def empty_launches_fn(self):
        """fn(stream) enqueueing EMPTY_LAUNCHES raw empty launches back to back."""
        raw = self.raw_launch_fn()
        return lambda s: [raw() for _ in range(EMPTY_LAUNCHES)]

    def chain(self, n: int) -> float:
        """GPU seconds of the serial-chain probe over ``n`` mix3 steps."""
        if n not in self._chain:
            self._chain[n] = self.timer.gpu_time(lambda s: self.probes.chain(n, s), repeat=15, flush=False)
        return self._chain[n]

    def step(self, w, mode: str, chains: int = 2, halves: int = 1) -> tuple[float, str]:
        """(seconds, what) bounding one HEAD + TAIL step of ``w`` over ``halves`` halves: the bytes
        it must touch over the copy bandwidth, or, for long extends, the serial chains the step runs
        one after another (``chains``: 2 for two independent writes, 1 for the manager, whose HEAD
        halves run theirs side by side and whose TAIL takes the step's chain from HEAD)."""
        bound, name = w.step_bytes(mode, halves) / self.copy_bandwidth, "bytes it must touch / copy bw"
        if w.extend > 1:
            chain = chains * self.chain(w.extend)
            if chain > bound:
                bound, name = chain, f"{chains} x serial mix3 chain x{w.extend}" if chains > 1 else \
                    f"one serial mix3 chain x{w.extend}"
        return bound, name

    def verify_probe(self, w, mode: str, plan) -> tuple[float, dict[str, float]]:
        """GPU seconds of the same loads as a verify of workload ``w`` in ``mode`` (no hashing) with
        ``plan`` (built for ``w.batch``: a materialised plan's arrays, else the fused indexing through
        its entry offsets, on every slot layout), one entry per lane: the best of the per-lane and,
        for strips of 64 bytes or more, warp-coalesced strip loads (every pattern measured is in the
        returned dict)."""
        ctx = w.context(mode)
        hb = w.hash_bytes(mode)
        kv = dict(src=w.pool if hb else None, src_row_stride=w.bytes_per_token, page_size=1,
                  bytes_per_token=w.bytes_per_token, hash_bytes=hb)
        times = {}
        for coop in (False, True) if hb >= 64 else (False,):
            run = lambda s, coop=coop: self.probes.verify_loads(  # noqa: E731
                s, canary=ctx.buffer.array, n=w.entries, plan=plan, rpi=w.rpi, prefix_lens=w.batch.prefix_lens,
                rtt=w.rtt, coop=coop, **kv)
            times["coalesced" if coop else "per_lane"] = self.timer.gpu_time(run)
        return min(times.values()), times
