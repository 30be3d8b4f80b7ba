"""GPU time with CUDA events on a library-created non-blocking stream, and host-time loops.

:class:`GpuTimer` owns one ``CU_STREAM_NON_BLOCKING`` stream (never the legacy stream 0) and two
events, and is the backend of the suite's GPU clock (perf/clocks.py): ``start``/``end`` record
the events on the stream, ``elapsed`` waits for the end event and returns the GPU seconds
between them. Every GPU measurement, whether pytest-benchmark runs its rounds (the ``report``
fixture's ``gpu()``) or :meth:`GpuTimer.gpu_time` does (bounds and side measurements), is the
same: ``prepare(fn)`` calls ``fn(stream)`` a few times (warm-up) to learn the host's enqueue time,
then before each timed round (untimed) the round setup (1) streams a buffer of 4x the L2 through
the cache, so the timed work starts cold as it does after a model's forward, and (2) enqueues a
spin kernel that keeps the GPU busy for twice the host's enqueue time: the timed region then holds
GPU work only, never Python launch gaps. The round is the clock's start reading, ``fn(stream)``,
its end reading. Host-side costs are timed with ``host_time`` (bounds) or the report's ``host()``.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from typing import Callable

import numpy as np
from cuda.bindings import driver as cu

from kvcanary.runtime import memory
from kvcanary.runtime.driver import check

from .clocks import GPU_CLOCK, EventClock

FLUSH_BYTES = 256 << 20  # 4x the 60 MB L2 of an H200


class GpuTimer:
    """CUDA-event timing of work enqueued on :attr:`handle` (primary context current: see conftest)."""

    def __init__(self, rt, probes, clock: EventClock = GPU_CLOCK):
        self.rt, self.probes = rt, probes
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        self.handle = int(self.stream)
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT.value
        self.start_event = check(cu.cuEventCreate(flags), "cuEventCreate")
        self.end_event = check(cu.cuEventCreate(flags), "cuEventCreate")
        self.flush_buffer = memory.empty((FLUSH_BYTES,), np.uint8)
        probes.fill(self.flush_buffer.ptr, FLUSH_BYTES, 7, self.handle)
        self.sync()
        self.clock = clock
        clock.bind(self)
        self.last: dict = {}

    # ---- the clock's backend ------------------------------------------------------------------
    def start(self) -> None:
        check(cu.cuEventRecord(self.start_event, self.stream), "cuEventRecord")

    def end(self) -> None:
        check(cu.cuEventRecord(self.end_event, self.stream), "cuEventRecord")

    def elapsed(self) -> float:
        check(cu.cuEventSynchronize(self.end_event), "cuEventSynchronize")
        return float(check(cu.cuEventElapsedTime(self.start_event, self.end_event), "cuEventElapsedTime")) / 1e3

    # ---- rounds ---------------------------------------------------------------------------------
    def sync(self) -> None:
        check(cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def flush_l2(self) -> None:
        self.probes.read(self.flush_buffer.ptr, FLUSH_BYTES, self.handle)

    def prepare(self, fn: Callable[[int], object], warmup: int = 5, flush: bool = True,
                per: int = 1) -> Callable[[], None]:
        """Warm ``fn`` up, configure the clock (``per`` operations per round, the gate) and return
        the untimed setup of each round: the L2 flush (unless ``flush`` is false) and the spin gate."""
        host = []
        for _ in range(max(1, warmup)):
            self.sync()
            t0 = time.perf_counter()
            fn(self.handle)
            host.append(time.perf_counter() - t0)
        self.sync()
        gate_ns = int(min(2.0 * max(host[1:] or host) * 1e9 + 30_000, 50e6))  # first call: one-time costs
        self.clock.configure(per=per, gate_ns=gate_ns)
        self.last = dict(host_enqueue_s=statistics.median(host), gate_ns=gate_ns)

        def setup() -> None:
            if flush:
                self.flush_l2()
            self.probes.spin(gate_ns, self.handle)

        return setup

    def gpu_time(self, fn: Callable[[int], object], warmup: int = 5, repeat: int = 30,
                 flush: bool = True, per: int = 1) -> float:
        """Median GPU seconds (per ``per`` operations) of the work ``fn(stream)`` enqueues: the
        rounds pytest-benchmark runs in ``report.gpu()``, run here (bounds, side measurements)."""
        setup = self.prepare(fn, warmup, flush, per)
        samples = []
        for _ in range(repeat):
            setup()
            t0 = self.clock()
            fn(self.handle)
            samples.append(self.clock() - t0)
        self.last.update(samples_s=samples, late=self.clock.late)
        return statistics.median(samples)

    def gpu_time_interleaved(self, fns: dict[str, Callable[[int], object]], warmup: int = 3, repeat: int = 20,
                             flush: bool = True) -> dict[str, float]:
        """Median GPU seconds of each fn's work, the fns' rounds interleaved so that clock and
        thermal drift hits all alike: for a small difference of two long times (a canary's
        overhead in a model step), which rounds timed one fn after the other skew."""
        gate = 0
        for fn in fns.values():
            self.prepare(fn, warmup, flush)
            gate = max(gate, self.last["gate_ns"])
        self.clock.configure(per=1, gate_ns=gate)
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeat):
            for name, fn in fns.items():
                if flush:
                    self.flush_l2()
                self.probes.spin(gate, self.handle)
                t0 = self.clock()
                fn(self.handle)
                samples[name].append(self.clock() - t0)
        self.last.update(samples_s=samples, late=self.clock.late, gate_ns=gate)
        return {k: statistics.median(v) for k, v in samples.items()}

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


class _Arg:
    """A stand-in argument with the attributes a packed launch's keying reads."""

    __slots__ = ("shape", "strides", "dtype", "ptr")

    def __init__(self, i: int):
        self.shape, self.strides, self.dtype, self.ptr = (i + 1, 64), (512, 8), "<i8", 4096 * (i + 1)


_ARGS = [_Arg(i) for i in range(13)]


def python_workload() -> int:
    """A fixed pure-Python workload shaped like a step's host path (attribute reads, tuples, a dict
    lookup, a list per argument; no numpy, no driver): the calibration of host rows, whose time on
    a host says how fast that host runs kvcanary's own Python."""
    seen: dict = {}
    total = 0
    for _ in range(20):
        keys, ptrs = [], []
        for a in _ARGS:
            keys.append((a.shape, a.strides, a.dtype))
            ptrs.append(a.ptr)
        key = tuple(keys)
        hit = seen.get(key)
        if hit is None:
            seen[key] = hit = len(seen)
        total += hit + len(set(ptrs))
    return total

