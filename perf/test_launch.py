"""Issue 2: host cost per launch of the empty params-struct kernel ``kvc_empty`` through kvcanary
(``DeviceRuntime.launch_struct``, and the lower-level prepacked ``DeviceRuntime.launch``) against a
raw ``cuLaunchKernel`` with a prepacked pointer array, the raw batch timed after every round of
the measured one. Target: <= 1.3x the raw floor. Also one benchmark per bound of this run, so
RESULTS.md records what every ratio was taken against."""

from __future__ import annotations

import ctypes

import pytest

from kvcanary import abi

from .bounds import COPY_BYTES, EMPTY_LAUNCHES
from .clocks import gpu_timed

TARGET = ("<=", 1.3)
CHAIN_STEPS = 32768


@pytest.mark.parametrize("variant", ["launch_struct", "launch (prepacked)"])
def test_launch_overhead(report, gpu, timer, bounds, variant):
    h = timer.handle
    params = abi.ProbeParams()
    ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    addr = ctypes.addressof(ptrs)
    fn = {"launch_struct": lambda: gpu.launch_struct("kvc_empty", 1, 32, params, h),
          "launch (prepacked)": lambda: gpu.launch("kvc_empty", 1, 32, addr, h)}[variant]
    seconds, raw = report.host(fn, sync=timer.sync, interleave=bounds.raw_launch_fn())
    report.row(f"host time per launch: kvcanary {variant}", seconds, "s", bound=raw,
               bound_name="raw cuLaunchKernel", target=TARGET)


@gpu_timed
def test_bound_copy_bandwidth(report, bounds):
    copy = bounds.copy_fn()
    t = report.gpu(copy, rounds=15, warmup=3, flush=False)
    bw = 2 * COPY_BYTES / t
    report.row("bound: device-to-device copy (read + written)", bw, "B/s", **{"GB/s": bw / 1e9},
               copy_s=t, session_bound_Bps=bounds.copy_bandwidth)


def test_bound_raw_launch_floor(report, timer, bounds):
    seconds = report.host(bounds.raw_launch_fn(), sync=timer.sync)
    report.row("bound: raw cuLaunchKernel host floor", seconds, "s", session_bound_s=bounds.launch_floor)


@gpu_timed
def test_bound_empty_kernel(report, bounds):
    seconds = report.gpu(bounds.empty_launches_fn(), flush=False, per=EMPTY_LAUNCHES)
    report.row("bound: empty kernel GPU time (eager, back to back)", seconds, "s",
               session_bound_s=bounds.gpu_launch_floor)


@gpu_timed
def test_bound_serial_chain(report, probes, bounds):
    seconds = report.gpu(lambda s: probes.chain(CHAIN_STEPS, s), rounds=15, flush=False)
    report.row(f"bound: serial mix3 chain, {CHAIN_STEPS} steps", seconds, "s",
               ns_per_step=seconds / CHAIN_STEPS * 1e9, session_bound_s=bounds.chain(CHAIN_STEPS))


@gpu_timed
def test_serial_chain_in_vector_registers(report, probes, bounds):
    """The serial chain with its running value in vector registers, against the bound's (uniform
    datapath): the floor a per-request chain loop in a kernel can reach (docs/performance.md)."""
    seconds = report.gpu(lambda s: probes.chain(CHAIN_STEPS, s, vector=True), rounds=15, flush=False)
    report.row(f"serial mix3 chain in vector registers, {CHAIN_STEPS} steps", seconds, "s",
               bound=bounds.chain(CHAIN_STEPS), bound_name="the serial chain bound (uniform datapath)",
               ns_per_step=seconds / CHAIN_STEPS * 1e9)
