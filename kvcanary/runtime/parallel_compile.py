"""The archs of a cold compile in parallel: NVRTC holds the GIL, so each arch past the first is
compiled by a worker process (``python -m kvcanary.runtime.parallel_compile ARCH``, sources on stdin, the
cubin on stdout) while the importing process compiles the first. A worker that cannot start, fails
or does not answer in time leaves its arch to the importing process (the same compile, whose error
is then raised there). Workers run ``import kvcanary`` with :data:`WORKER_ENV` set, which compiles
nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from . import nvrtc_build as _compile

WORKER_ENV = _compile.WORKER_ENV
WORKER_TIMEOUT_S = 300  # a worker that has not delivered its cubin by then is killed; its arch compiles here


def compile_archs(archs, sources: dict[str, str], prelude: str):
    """Yield (arch, cubin) for every arch, compiled in parallel: NVRTC holds the GIL, so each arch
    past the first goes to a worker process while this process compiles the first, up to one per
    CPU at a time. Each finished arch prints a progress line on
    stderr. A worker that fails leaves its arch to this process (the same compile, its errors)."""
    t0, archs = time.perf_counter(), list(archs)
    slots = max(1, min(len(archs), os.cpu_count() or 1))
    payload = repr((sources, prelude)).encode()
    pending = list(archs[1:])
    running: list[tuple[int, subprocess.Popen]] = []

    def start() -> None:
        while pending and len(running) < slots - 1:
            a = pending.pop(0)
            try:  # stderr discarded: a failed arch is compiled again here, where its log is raised
                proc = subprocess.Popen([sys.executable, "-m", "kvcanary.runtime.parallel_compile", str(a)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        env={**os.environ, WORKER_ENV: "1"})
                proc.stdin.write(payload)
                proc.stdin.close()
                proc.stdin = None  # written: communicate() below only reads
            except OSError:  # no interpreter to start (an embedded Python): compile it here
                mine.append(a)
                continue
            running.append((a, proc))

    def done(a: int, cubin: bytes) -> tuple[int, bytes]:
        print(f"kvcanary: compiled sm_{a} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        return a, cubin

    mine = archs[:1]
    start()
    while mine or running or pending:
        if mine:
            a = mine.pop(0)
            yield done(a, _compile.compile_cubin(sources, prelude, a))
        if running:
            a, proc = running.pop(0)
            try:
                cubin, _ = proc.communicate(timeout=WORKER_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # never wait forever on a worker: compile it here instead
                proc.kill()
                proc.communicate()
                cubin = b""
            if proc.returncode == 0 and cubin:
                yield done(a, cubin)
            else:  # compile it here: the same compile, with its error if it fails
                mine.append(a)
        start()
        if not running and pending:
            mine.append(pending.pop(0))


def _worker() -> None:
    """``python -m kvcanary.runtime.parallel_compile ARCH``: the cubin of (sources, prelude) read from stdin."""
    import ast
    sources, prelude = ast.literal_eval(sys.stdin.buffer.read().decode())
    sys.stdout.buffer.write(_compile.compile_cubin(sources, prelude, int(sys.argv[1])))


if __name__ == "__main__":
    _worker()
