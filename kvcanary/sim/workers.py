"""Worker processes for the campaign and the clean runs: how many a ``jobs`` setting means, the
pool (spawned: the work is bound by host Python, not by the device, and a CUDA context does not
survive a fork) and gathering its results so that a failed task fails the whole run.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed

import numpy as np

from ..errors import ValidationError, ValidationTypeError


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def resolve_jobs(jobs: int | str = 1, backend: str = "cpu") -> int:
    """Worker processes for a ``jobs`` setting: ``"auto"`` is one per usable CPU on the CPU
    backend and 1 on the GPU (workers' CUDA contexts would time-slice the one device); 0 is one
    per usable CPU; 1 runs in this process; N > 1 is N workers. Raises ValidationError otherwise."""
    fix = "Fix: --jobs auto, 0 (one worker per CPU), 1 (run in this process) or a worker count"
    if isinstance(jobs, str):
        text = jobs.strip().lower()
        if text == "auto":
            return usable_cpus() if backend == "cpu" else 1
        try:
            jobs = int(text)
        except ValueError:
            raise ValidationError(f"kv-canary: --jobs expects auto or a worker count >= 0, got {jobs!r}. "
                                  f"{fix}") from None
    if isinstance(jobs, bool) or not isinstance(jobs, (int, np.integer)):
        raise ValidationTypeError(f"kv-canary: jobs must be an int or 'auto', got {type(jobs).__name__}. {fix}")
    if jobs < 0:
        raise ValidationError(f"kv-canary: --jobs expects a worker count >= 0, got {jobs}. {fix}")
    return usable_cpus() if jobs == 0 else int(jobs)


def pool(workers: int) -> ProcessPoolExecutor:
    # spawn: a forked child would inherit a CUDA context it cannot use
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


def gather(pool: ProcessPoolExecutor, futures: dict, on_result) -> None:
    """Wait for ``futures`` (future -> label) in completion order and hand each result to
    ``on_result(future, result)``. A task that raised (or a worker that died) aborts the whole
    run with that exception, its label noted, after cancelling what has not started."""
    try:
        for f in as_completed(futures):
            try:
                result = f.result()
            except Exception as exc:
                exc.add_note(f"kv-canary: raised in the worker process running {futures[f]}")
                raise
            on_result(f, result)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
