"""The programs of a cold compile in parallel. NVRTC holds the GIL, so the (arch, family) units
compile in worker processes, one per CPU (``python -m kvcanary.runtime.parallel_compile``: each answers
every request on its stdin with a cubin on its stdout, length-prefixed, until stdin closes),
largest program first, while this process only hands out units and collects cubins (a thread per
worker, waiting on its pipes). One unit, or one CPU, compiles here. A worker that cannot start,
fails or does not answer in time leaves its unit to this process (the same compile, whose error is
then raised here). Workers run ``import kvcanary`` with
:data:`~kvcanary.runtime.nvrtc_program.WORKER_ENV` set, which compiles nothing. A unit is compiled
by :func:`kvcanary.runtime.nvrtc_program.compile_cubin`, the module below this one; the families,
their sources and their cache are :mod:`~kvcanary.runtime.nvrtc_build`'s, which calls this one."""

from __future__ import annotations

import os
import queue
import struct
import subprocess
import sys
import threading
import time
from collections import Counter, deque

from . import nvrtc_program

WORKER_TIMEOUT_S = 300  # a worker that has not delivered a cubin by then is killed; its unit compiles here


def _send(stream, data: bytes) -> None:
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream) -> bytes | None:
    """One length-prefixed message, or None at the end of the stream (or a cut one)."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    size = struct.unpack("<Q", head)[0]
    data = stream.read(size)
    return data if len(data) == size else None


class _Pool:
    """Units waiting for a worker, and the results of the workers' threads."""

    def __init__(self, units, programs: dict[str, dict[str, str]], prelude: str):
        self.pending, self.programs, self.prelude = deque(units), programs, prelude
        self.lock, self.results, self.procs = threading.Lock(), queue.Queue(), []

    def next_unit(self):
        with self.lock:
            return self.pending.popleft() if self.pending else None

    def request(self, unit) -> bytes:
        arch, name = unit
        return repr((self.programs[name], self.prelude, arch, nvrtc_program.program_name(name))).encode()

    def drive(self) -> None:
        """One worker process compiling units taken from ``pending`` until none is left: puts
        (unit, cubin or None) for each unit it took, then None when it stops."""
        try:
            try:  # stderr discarded: a failed unit is compiled again here, where its log is raised
                proc = subprocess.Popen([sys.executable, "-m", "kvcanary.runtime.parallel_compile"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        env={**os.environ, nvrtc_program.WORKER_ENV: "1"})
            except OSError:  # no interpreter to start (an embedded Python): this process compiles
                return
            with self.lock:
                self.procs.append(proc)
            while (unit := self.next_unit()) is not None:
                timer = threading.Timer(WORKER_TIMEOUT_S, proc.kill)  # never wait forever on a worker
                timer.start()
                try:
                    _send(proc.stdin, self.request(unit))
                    cubin = _receive(proc.stdout)
                except (OSError, ValueError):  # a killed or dead worker: a closed pipe
                    cubin = None
                finally:
                    timer.cancel()
                self.results.put((unit, cubin))
                if not cubin:
                    proc.kill()
                    break
            try:
                proc.stdin.close()
            except OSError:
                pass
            proc.wait()
        finally:
            self.results.put(None)

    def stop(self) -> None:
        """No more units for the workers; kill those still running."""
        with self.lock:
            self.pending.clear()
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()


def _size(sources: dict[str, str]) -> int:
    return sum(len(s) for n, s in sources.items() if n.endswith(".cu"))


def compile_units(units, programs: dict[str, dict[str, str]], prelude: str):
    """Yield (arch, name, cubin) for every unit (arch, name) of ``units``, where ``programs[name]``
    is the sources of the program ``name``: compiled in parallel worker processes, up to one per
    CPU, largest programs first. Each arch whose last unit is done prints a progress line on
    stderr. A unit whose worker failed is compiled here (the same compile, its errors)."""
    t0 = time.perf_counter()
    units = sorted(units, key=lambda u: -_size(programs[u[1]]))
    left = Counter(a for a, _ in units)
    cpus = os.cpu_count() or 1
    workers = min(len(units), cpus) if len(units) > 1 and cpus > 1 else 0
    pool = _Pool(units, programs, prelude)
    for _ in range(workers):
        threading.Thread(target=pool.drive, name="kvcanary-compile", daemon=True).start()
    live, done = workers, 0
    try:
        while done < len(units):
            if live:
                item = pool.results.get()
                if item is None:  # a worker stopped: its units were answered before
                    live -= 1
                    continue
                (arch, name), cubin = item
            else:  # no worker left: the rest compiles here
                (arch, name), cubin = pool.next_unit(), None
            if not cubin:
                cubin = nvrtc_program.compile_cubin(programs[name], prelude, arch, program=nvrtc_program.program_name(name))
            done += 1
            left[arch] -= 1
            if not left[arch]:
                print(f"kvcanary: compiled sm_{arch} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
            yield arch, name, cubin
    finally:
        pool.stop()


def _worker() -> None:
    """``python -m kvcanary.runtime.parallel_compile``: each request (sources, prelude, arch, program) read
    from stdin answered with its cubin on stdout, until stdin closes."""
    import ast
    while (request := _receive(sys.stdin.buffer)) is not None:
        sources, prelude, arch, program = ast.literal_eval(request.decode())
        _send(sys.stdout.buffer, nvrtc_program.compile_cubin(sources, prelude, arch, program=program))


if __name__ == "__main__":
    _worker()
