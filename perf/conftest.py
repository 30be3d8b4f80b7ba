"""Fixtures of the benchmark suite: GPU detection, the event timer, the probes, the bounds, and
the ``report`` fixture through which every benchmark measures its operation and reports rows.

GPU benchmarks take the ``gpu`` fixture (directly or through ``timer``/``bounds``/``workloads``)
and skip cleanly when no CUDA driver or device is found: the kvcanary error that
``kvcanary.runtime.driver.device_count()`` raises is caught, never propagated. CPU benchmarks (import
time, the reference backend, the probe compile) always run.

One benchmark times one operation, and pytest-benchmark's statistics are that operation's time:
``report.gpu(fn)`` (a ``@gpu_timed`` test: GPU seconds per round from CUDA events, see
perf/clocks.py), ``report.host(fn)`` (host seconds per call, ``batch`` calls per round, the stream
idle at each round's start), ``report.cpu(fn)`` (seconds per call) and ``report.reported(fn)``
(a ``@reported`` test: ``fn`` returns the seconds it measured itself). Each returns the median.
Bounds and comparisons are measured beside it with the session's ``timer``/``bounds`` and go into
the rows: ``report.row`` records measured value (the median, or derived from it: a rate, a
bandwidth), the bound, their ratio, the target and pass/fail in ``benchmark.extra_info["rows"]``
(the first row's numbers also as flat keys: ``bound``, ``ratio``, ``GB/s``, ``entries/s``),
prints it (``-s``) and lists it at the end of the session. With ``--benchmark-disable`` every
measurement runs once and returns NaN.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Callable

import pytest

from .clocks import GPU_CLOCK, REPORTED_CLOCK
from .results import HARNESS, fmt

ROWS: list[dict] = []


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    from kvcanary.runtime import driver
    return driver.unavailable_reason()


@pytest.fixture(scope="session")
def gpu():
    """kvcanary's runtime of device 0, or a clean skip without a CUDA driver/device."""
    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(f"needs a GPU: {reason}")
    from cuda.bindings import driver as cu

    from kvcanary.runtime import devices, driver
    rt = devices.runtime(0)
    # As in an engine, where the framework keeps the primary context current on its thread.
    driver.check(cu.cuCtxSetCurrent(cu.CUcontext(rt.context)), "cuCtxSetCurrent")
    return rt


@pytest.fixture(scope="session")
def probes(gpu):
    from .bounds import Probes
    return Probes(gpu)


@pytest.fixture(scope="session")
def timer(gpu, probes):
    from .timing import GpuTimer
    return GpuTimer(gpu, probes)


@pytest.fixture(scope="session")
def bounds(gpu, probes, timer):
    from .bounds import Bounds
    return Bounds(gpu, probes, timer)


@pytest.fixture(scope="session")
def workloads(gpu, probes, timer):
    from .workloads import Workloads
    return Workloads(probes, timer)


def check_target(ratio: float | None, target: tuple[str, float] | None) -> bool | None:
    if ratio is None or target is None or not math.isfinite(ratio):
        return None
    op, value = target
    return ratio <= value if op == "<=" else ratio >= value


class Reporter:
    """Measures one benchmark's operation and collects its rows; see the module docstring."""

    def __init__(self, benchmark, request):
        self.benchmark, self.request, self.nodeid, self.rows = benchmark, request, request.node.nodeid, []

    # ---- the measured operation (one per benchmark) ------------------------------------------
    def gpu(self, fn: Callable[[int], object], *, rounds: int = 30, warmup: int = 5, flush: bool = True,
            per: int = 1) -> float:
        """Median GPU seconds of ``fn(stream)``'s work (per ``per`` operations it enqueues)."""
        self._require_timer(GPU_CLOCK, "@gpu_timed")
        timer = self.request.getfixturevalue("timer")  # binds GPU_CLOCK to the session's GpuTimer
        setup = timer.prepare(fn, warmup, flush, per)
        self.benchmark.pedantic(fn, args=(timer.handle,), setup=setup, rounds=rounds)
        self._info(f"CUDA events, {'L2 flushed, ' if flush else ''}spin-gated"
                   + (f", per {per} operations" if per > 1 else ""),
                   late_rounds=timer.clock.late, **timer.last)
        return self._median()

    def host(self, fn: Callable[[], object], *, batch: int = 200, rounds: int = 30, warmup: int = 3,
             sync: Callable[[], None] | None = None, interleave: Callable[[], object] | None = None):
        """Median host seconds per call of ``fn``: rounds of ``batch`` back-to-back calls, ``sync``
        (untimed) after each so every round starts with an idle stream. With ``interleave``, after
        each round the same batch of that fn is timed too (a bound measured alternately with the
        operation, so drift hits both alike): returns (median, its median)."""
        self._require_timer(None, "no clock marker")
        others: list[float] = []

        def teardown() -> None:
            if sync is not None:
                sync()
            if interleave is not None:
                t0 = time.perf_counter()
                for _ in range(batch):
                    interleave()
                others.append((time.perf_counter() - t0) / batch)
                if sync is not None:
                    sync()

        teardown()
        self.benchmark.pedantic(fn, rounds=rounds, warmup_rounds=warmup, iterations=batch, teardown=teardown)
        self._info(f"perf_counter, {batch} calls per round")
        if interleave is None:
            return self._median()
        timed = others[1 + warmup:1 + warmup + rounds]  # not the first, warm-up or final calls
        return self._median(), statistics.median(timed) if timed else math.nan

    def cpu(self, fn: Callable[[], object], *, rounds: int = 5, warmup: int = 1) -> float:
        """Median host seconds of one call of ``fn``."""
        self._require_timer(None, "no clock marker")
        self.benchmark.pedantic(fn, rounds=rounds, warmup_rounds=warmup)
        self._info("perf_counter, 1 call per round")
        return self._median()

    def reported(self, fn: Callable[[], float], *, rounds: int, setup: Callable[[], None] | None = None) -> float:
        """Median of the seconds ``fn`` returns (it times the operation itself); ``setup`` runs
        before each round, untimed."""
        self._require_timer(REPORTED_CLOCK, "@reported")
        self.benchmark.pedantic(lambda: REPORTED_CLOCK.add(fn()), setup=setup, rounds=rounds)
        self._info("reported by the operation")
        return self._median()

    def _require_timer(self, clock, marker: str) -> None:
        mark = self.request.node.get_closest_marker("benchmark")
        have = mark.kwargs.get("timer") if mark else None
        if have is not clock:
            raise pytest.UsageError(f"perf: {self.nodeid} measures with a method that needs {marker} on the test, "
                                    f"got benchmark timer {have!r}")

    def _info(self, clock: str, **extra) -> None:
        self.benchmark.extra_info.update(harness=HARNESS, clock=clock, **extra)

    def _median(self) -> float:
        stats = getattr(self.benchmark, "stats", None)
        if self.benchmark.disabled or not stats:
            return math.nan
        return float(stats.stats.median)

    # ---- rows ---------------------------------------------------------------------------------
    def row(self, name: str, measured: float, unit: str, *, bound: float | None = None,
            bound_name: str = "", ratio: float | None = None, target: tuple[str, float] | None = None,
            ok: bool | None = None, target_text: str | None = None, **extra) -> dict:
        """One result row. ``ratio`` defaults to measured / bound; ``ok`` to the target check
        (``target`` is ("<=" or ">=", value) on the ratio; ``target_text`` describes any other)."""
        if ratio is None and bound:
            ratio = measured / bound
        row = dict(name=name, measured=measured, unit=unit, bound=bound, bound_name=bound_name,
                   ratio=ratio, target=target_text or (None if target is None else f"{target[0]} {target[1]:g}x"),
                   ok=check_target(ratio, target) if ok is None else ok, nodeid=self.nodeid, **extra)
        self.rows.append(row)
        ROWS.append(row)
        info = self.benchmark.extra_info
        info["rows"] = self.rows
        if len(self.rows) == 1:
            info.update(measured=measured, unit=unit, bound=bound, ratio=ratio, target=row["target"])
            for key in ("GB/s", "entries/s"):
                if key in extra:
                    info[key] = extra[key]
        print("\n[perf] " + format_row(row), end="")
        return row


@pytest.fixture
def report(benchmark, request) -> Reporter:
    return Reporter(benchmark, request)


def format_row(row: dict) -> str:
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3g}x"
    verdict = {True: "PASS", False: "FAIL", None: ""}[row["ok"]]
    what = f" ({row['bound_name']})" if row["bound_name"] else ""
    return (f"{row['name']:<60} {fmt(row['measured'], row['unit']):>13}  bound "
            f"{fmt(row['bound'], row['unit']):>13}{what}  ratio {ratio:>8}  "
            f"target {row['target'] or '-':>7}  {verdict}")


def pytest_configure(config):
    """``--benchmark-json=perf/out/run.json`` works on a fresh clone: its directory is created."""
    path = config.getoption("benchmark_json", None)
    if hasattr(path, "parent"):  # pytest-benchmark 5.3 passes a Path; 5.2 an open file (its folder exists)
        path.parent.mkdir(parents=True, exist_ok=True)


def gpu_name() -> str | None:
    if gpu_unavailable_reason():
        return None
    from cuda.bindings import driver as cu
    try:
        err, name = cu.cuDeviceGetName(256, cu.CUdevice(0))
    except Exception:  # never let the machine info break saving the run
        return None
    return name.split(b"\0", 1)[0].decode(errors="replace") if int(err) == 0 else None


def pytest_benchmark_update_machine_info(config, machine_info):
    """Which harness and which GPU (None: no GPU answered) took the numbers: perf/results.py
    refuses to let a run without a GPU replace the committed H200 results."""
    machine_info["kvcanary_perf"] = {"harness": HARNESS, "gpu": gpu_name(),
                                     "no_gpu_reason": gpu_unavailable_reason()}


def pytest_terminal_summary(terminalreporter):
    if ROWS:
        terminalreporter.section("kvcanary perf rows")
        for row in ROWS:
            terminalreporter.write_line(format_row(row))
