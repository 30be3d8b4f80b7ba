"""Fixtures of the benchmark suite: GPU detection, the event timer, the probes, the bounds, and
the row reporter that attaches results to pytest-benchmark.

GPU benchmarks take the ``gpu`` fixture (directly or through ``timer``/``bounds``/``workloads``)
and skip cleanly when no CUDA driver or device is found: the kvcanary error that
``kvcanary.driver.device_count()`` raises is caught, never propagated. CPU benchmarks (import
time, the reference backend, the probe compile) always run.

Each benchmark reports one or more rows through the ``report`` fixture: measured value, the bound
measured in the same run, their ratio, the target and pass/fail. Rows go to
``benchmark.extra_info["rows"]`` (the first row's numbers also as flat keys: ``bound``, ``ratio``,
``GB/s``, ``entries/s``), are printed (``-s``) and summarised at the end of the session.
pytest-benchmark's own timing columns only time the whole measurement (``pedantic``, 1 round):
the numbers that matter are the rows.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import pytest

from .report import fmt

ROWS: list[dict] = []


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    from kvcanary import driver
    return driver.unavailable_reason()


@pytest.fixture(scope="session")
def gpu():
    """kvcanary's runtime of device 0, or a clean skip without a CUDA driver/device."""
    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(f"needs a GPU: {reason}")
    from cuda.bindings import driver as cu
    from kvcanary import driver
    rt = driver.runtime(0)
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
    """Collects the rows of one benchmark; see the module docstring."""

    def __init__(self, benchmark, nodeid: str):
        self.benchmark, self.nodeid, self.rows = benchmark, nodeid, []

    def measure(self, fn: Callable[[], object]):
        """Run ``fn`` (the whole measurement) once under pytest-benchmark; return its result."""
        return self.benchmark.pedantic(fn, rounds=1, iterations=1, warmup_rounds=0)

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
    return Reporter(benchmark, request.node.nodeid)


def format_row(row: dict) -> str:
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3g}x"
    verdict = {True: "PASS", False: "FAIL", None: ""}[row["ok"]]
    what = f" ({row['bound_name']})" if row["bound_name"] else ""
    return (f"{row['name']:<60} {fmt(row['measured'], row['unit']):>13}  bound "
            f"{fmt(row['bound'], row['unit']):>13}{what}  ratio {ratio:>8}  "
            f"target {row['target'] or '-':>7}  {verdict}")


def pytest_terminal_summary(terminalreporter):
    if ROWS:
        terminalreporter.section("kvcanary perf rows")
        for row in ROWS:
            terminalreporter.write_line(format_row(row))
