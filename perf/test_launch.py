"""Issue 2: host cost per launch of the empty params-struct kernel ``kvc_empty`` through kvcanary
(``DeviceRuntime.launch_struct``, and the lower-level prepacked ``DeviceRuntime.launch``) against a
raw ``cuLaunchKernel`` with a prepacked pointer array, measured interleaved in the same run.
Target: <= 1.3x the raw floor. Also reports the bounds of this run as rows of their own."""

from __future__ import annotations

import ctypes

from kvcanary import abi

TARGET = ("<=", 1.3)


def test_launch_overhead(report, gpu, timer, bounds):
    h = timer.handle
    params = abi.ProbeParams()
    ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    addr = ctypes.addressof(ptrs)
    fns = {
        "raw cuLaunchKernel": bounds.raw_launch_fn(),
        "launch_struct": lambda: gpu.launch_struct("kvc_empty", 1, 32, params, h),
        "launch (prepacked)": lambda: gpu.launch("kvc_empty", 1, 32, addr, h),
    }
    t = report.measure(lambda: timer.host_time(fns))
    raw = t.pop("raw cuLaunchKernel")
    for name, seconds in t.items():
        report.row(f"host time per launch: kvcanary {name}", seconds, "s", bound=raw,
                   bound_name="raw cuLaunchKernel", target=TARGET)


def test_bounds_of_this_run(report, gpu, bounds):
    """The bounds themselves, so RESULTS.md records what every ratio was taken against."""
    bw = report.measure(lambda: bounds.copy_bandwidth)
    report.row("bound: device-to-device copy (read + written)", bw, "B/s", **{"GB/s": bw / 1e9})
    report.row("bound: raw cuLaunchKernel host floor", bounds.launch_floor, "s")
    report.row("bound: empty kernel GPU time (eager, back to back)", bounds.gpu_launch_floor, "s")
    n = 32768
    chain = bounds.chain(n)
    report.row(f"bound: serial mix3 chain, {n} steps", chain, "s", ns_per_step=chain / n * 1e9)
