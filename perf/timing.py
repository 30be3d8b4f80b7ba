"""GPU time with CUDA events on a library-created non-blocking stream, and host-time loops.

:class:`GpuTimer` owns one ``CU_STREAM_NON_BLOCKING`` stream (never the legacy stream 0) and two
events. ``gpu_time(fn)`` calls ``fn(stream_handle)``, which must enqueue its work on that stream,
and returns the median GPU seconds between an event before and one after it. Before each timed
repetition it (1) streams a buffer of 4x the L2 through the cache, so the timed work starts cold
as it does after a model's forward, and (2) enqueues a spin kernel that keeps the GPU busy for
longer than the host takes to enqueue ``fn`` (measured in the warm-up): the timed region then
holds GPU work only, never Python launch gaps. Host-side costs are timed with ``host_time``.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from typing import Callable

import numpy as np
from cuda.bindings import driver as cu

from kvcanary import memory
from kvcanary.driver import check

FLUSH_BYTES = 256 << 20  # 4x the 60 MB L2 of an H200


class GpuTimer:
    """CUDA-event timing of work enqueued on :attr:`handle` (primary context current: see conftest)."""

    def __init__(self, rt, probes):
        self.rt, self.probes = rt, probes
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        self.handle = int(self.stream)
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT.value
        self.start = check(cu.cuEventCreate(flags), "cuEventCreate")
        self.end = check(cu.cuEventCreate(flags), "cuEventCreate")
        self.flush_buffer = memory.empty((FLUSH_BYTES,), np.uint8)
        probes.fill(self.flush_buffer.ptr, FLUSH_BYTES, 7, self.handle)
        self.sync()
        self.last: dict = {}

    def sync(self) -> None:
        check(cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def flush_l2(self) -> None:
        self.probes.read(self.flush_buffer.ptr, FLUSH_BYTES, self.handle)

    def gpu_time(self, fn: Callable[[int], object], warmup: int = 5, repeat: int = 30,
                 flush: bool = True) -> float:
        """Median GPU seconds of the work ``fn(stream)`` enqueues (details in the module doc)."""
        host = []
        for _ in range(max(1, warmup)):
            self.sync()
            t0 = time.perf_counter()
            fn(self.handle)
            host.append(time.perf_counter() - t0)
        self.sync()
        host_s = statistics.median(host)
        gate_ns = int(min(2.0 * max(host[1:] or host) * 1e9 + 30_000, 50e6))  # first call: one-time costs
        samples, late = [], 0
        for _ in range(repeat):
            if flush:
                self.flush_l2()
            self.probes.spin(gate_ns, self.handle)
            t0 = time.perf_counter()
            check(cu.cuEventRecord(self.start, self.stream), "cuEventRecord")
            fn(self.handle)
            check(cu.cuEventRecord(self.end, self.stream), "cuEventRecord")
            late += (time.perf_counter() - t0) * 1e9 > gate_ns  # the GPU may have waited on the host
            check(cu.cuEventSynchronize(self.end), "cuEventSynchronize")
            samples.append(float(check(cu.cuEventElapsedTime(self.start, self.end), "cuEventElapsedTime")) / 1e3)
        self.last = dict(samples_s=samples, host_enqueue_s=host_s, gate_ns=gate_ns, late=late)
        return statistics.median(samples)

    def host_time(self, fns: dict[str, Callable[[], object]], batch: int = 200, repeat: int = 30,
                  warmup: int = 3) -> dict[str, float]:
        """Median host seconds per call of each fn, the fns interleaved so drift hits all alike.

        Each sample is ``batch`` back-to-back calls from an idle stream, divided by ``batch``."""
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for rep in range(warmup + repeat):
            for name, fn in fns.items():
                self.sync()
                t0 = time.perf_counter()
                for _ in range(batch):
                    fn()
                dt = (time.perf_counter() - t0) / batch
                if rep >= warmup:
                    samples[name].append(dt)
        self.sync()
        return {k: statistics.median(v) for k, v in samples.items()}


class Graph:
    """A CUDA graph captured from ``fn(stream)`` on the timer's stream (raw driver; no torch)."""

    def __init__(self, timer: GpuTimer, fn: Callable[[int], object]):
        timer.sync()
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(timer.stream, mode), "cuStreamBeginCapture")
        try:
            fn(timer.handle)
        finally:
            self.graph = check(cu.cuStreamEndCapture(timer.stream), "cuStreamEndCapture")
        self.exec = check(cu.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")

    def launch(self, stream: int) -> None:
        check(cu.cuGraphLaunch(self.exec, stream), "cuGraphLaunch")

    def __del__(self):
        try:
            cu.cuGraphExecDestroy(self.exec)
            cu.cuGraphDestroy(self.graph)
        except Exception:  # interpreter shutdown
            pass


def pack_args(*values) -> tuple[int, object]:
    """(address of a void*[] pointing at each ctypes value, object to keep alive until launched)."""
    arr = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    return ctypes.addressof(arr), (arr, values)
