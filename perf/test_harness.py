"""The harness itself, on the CPU: in a pytest session of its own (a subprocess with
perf/conftest.py as plugin), each measuring method of the ``report`` fixture runs its rounds under
pytest-benchmark, whose statistics in the JSON must then be the operation's time and equal the
row's measured value. The GPU method runs against a GpuTimer on a simulated stream: work items
of known GPU seconds, so the expected median is known exactly and the L2 flush and spin gate,
enqueued before each round's start event, must not be counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

INNER = '''
import pytest
from types import SimpleNamespace
from perf.clocks import GPU_CLOCK, gpu_timed, reported
from perf.timing import GpuTimer

GPU_WORK = [9e-3, 8e-3] + [1e-3, 5e-3, 2e-3, 4e-3, 3e-3]  # two warm-up calls, then five rounds


class SimulatedTimer(GpuTimer):
    """GpuTimer on a simulated stream: ``queue`` holds the GPU seconds of what was enqueued."""

    def __init__(self):
        self.queue, self.log, self.handle, self.last = [], [], 7, {}
        self.flush_buffer = SimpleNamespace(ptr=0)
        self.probes = SimpleNamespace(read=lambda ptr, n, s: self.enqueue("flush", 1e-4),
                                      spin=lambda ns, s: self.enqueue("spin", ns / 1e9))
        self.clock = GPU_CLOCK
        GPU_CLOCK.bind(self)

    def enqueue(self, what, seconds):
        self.log.append(what)
        self.queue.append(seconds)

    def sync(self):
        self.log.append("sync")

    def start(self):
        self.first = len(self.queue)

    def end(self):
        self.stop = len(self.queue)

    def elapsed(self):
        return sum(self.queue[self.first:self.stop])


@pytest.fixture
def timer():
    return SimulatedTimer()


@gpu_timed
def test_gpu(report, timer):
    work = iter(GPU_WORK)
    t = report.gpu(lambda s: timer.enqueue("work", next(work)), rounds=5, warmup=2, per=2)
    if not report.benchmark.disabled:
        assert t == pytest.approx(3e-3 / 2, rel=1e-9)
        assert [w for w in timer.log if w != "sync"] == ["work"] * 2 + ["flush", "spin", "work"] * 5
    report.row("gpu row", t, "s")


def test_gpu_needs_the_marker(report, timer):
    with pytest.raises(pytest.UsageError, match="@gpu_timed"):
        report.gpu(lambda s: None)


def test_host(report):
    calls, syncs, other = [0], [0], [0]
    t, bound = report.host(lambda: calls.__setitem__(0, calls[0] + 1), batch=50, rounds=4, warmup=2,
                           sync=lambda: syncs.__setitem__(0, syncs[0] + 1),
                           interleave=lambda: other.__setitem__(0, other[0] + 1))
    if not report.benchmark.disabled:
        assert calls[0] == 50 * (2 + 4) + 1  # warm-up and timed rounds, pytest-benchmark's final call
        assert other[0] == 50 * (1 + 2 + 4 + 1) and syncs[0] == 2 * (1 + 2 + 4 + 1)
        assert 0 < t < 1e-3 and 0 < bound < 1e-3
    report.row("host row", t, "s", bound=bound)


def test_cpu(report):
    t = report.cpu(lambda: sum(range(1000)), rounds=3)
    report.row("cpu row", t, "s")


@reported
def test_reported(report):
    durations, setups = iter([0.3, 0.1, 0.2]), []
    t = report.reported(lambda: next(durations), rounds=3, setup=lambda: setups.append(1))
    if not report.benchmark.disabled:
        assert t == pytest.approx(0.2, rel=1e-12) and len(setups) == 3
    report.row("reported row", t, "s")
'''


def run_inner(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "perf.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_benchmark_stats_are_the_operation_and_equal_the_rows(tmp_path):
    out = run_inner(tmp_path, f"--benchmark-json={tmp_path / 'run.json'}")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    benches = {b["name"]: b for b in json.loads((tmp_path / "run.json").read_text())["benchmarks"]}
    assert set(benches) == {"test_gpu", "test_host", "test_cpu", "test_reported"}
    gpu = benches["test_gpu"]
    assert gpu["stats"]["rounds"] == 5 and gpu["options"]["timer"] == "EventClock"
    assert sorted(gpu["stats"]["data"]) == pytest.approx([0.5e-3, 1e-3, 1.5e-3, 2e-3, 2.5e-3], rel=1e-9)
    assert gpu["stats"]["stddev"] > 0, "rounds must have their real spread"
    host = benches["test_host"]
    assert (host["stats"]["rounds"], host["stats"]["iterations"]) == (4, 50)
    assert benches["test_reported"]["stats"]["data"] == pytest.approx([0.3, 0.1, 0.2], rel=1e-12)
    for bench in benches.values():
        (row,) = bench["extra_info"]["rows"]
        assert row["measured"] == bench["stats"]["median"], "a row's measurement is its benchmark's median"
        assert bench["extra_info"]["harness"] == 2 and bench["extra_info"]["clock"]


def test_with_benchmarks_disabled_every_method_runs_once_and_reports_nan(tmp_path):
    out = run_inner(tmp_path, "--benchmark-disable", "-s")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("[perf] ")]
    assert len(rows) == 4 and all("nan" in line for line in rows), rows
