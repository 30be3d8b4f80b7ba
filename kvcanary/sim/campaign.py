"""Fault-injection campaign: for each class x hash mode, N independent seeded injections in
randomized workloads of the simulated engine; plus long clean runs for false positives.

An injection is *detected* when the canary reported (mode "log" through the export callback,
or mode "raise" through CanaryViolationError) a violation that names one of the fault's
involved slots at or after the step the fault landed; *missed* when the fault was really read
(engine ground truth) and nothing was reported; *not exercised* when it never landed or was
never read. Class x mode pairs that FAULTS.md says a mode cannot see are "not covered" and not
run. Latency is counted in engine steps from the corruption to the first report, and from the
first read of the corrupted content to the first report (0: caught on the step that read it).

Injections are independent and fully determined by their seed, so ``jobs > 1`` runs them in
spawned worker processes (the campaign is bound by host Python, not by the device; spawn, not
fork, because a CUDA context does not survive a fork) and gives the same records in the same order.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace

import numpy as np

from ..errors import ValidationError, ValidationTypeError
from .engine import Engine
from .faults import CLASSES, K1, K2, K3, K4, MODES, PARTIAL_NOTE, TITLES, coverage
from .faults_kv import K5, K6, K7, K10, K12
from .faults_step import K8, K9, K11, K13
from .data import SimConfig

INJECTORS = {f.cls: f for f in (K1, K2, K3, K4, K5, K6, K7, K8, K9, K10, K11, K12, K13)}


@contextlib.contextmanager
def quiet():
    """Keep the canary's per-violation log lines off the terminal while faults are injected."""
    log = logging.getLogger("kvcanary")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def random_config(rng: np.random.Generator, needs: dict) -> SimConfig:
    """A randomized small workload, then the fault's needs (values or functions of the config)."""
    pick = lambda *xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    cfg = SimConfig(num_slots=pick(2048, 4096), page_size=pick(1, 4, 16), layers=pick(1, 2, 3),
                    heads=pick(2, 4), head_bytes=pick(16, 32), scales=bool(rng.random() < 0.5),
                    swa_window=pick(0, 0, 16, 32), spec_k=pick(0, 0, 2, 3), offload=bool(rng.random() < 0.7),
                    sweep_every=pick(2, 3, 4, 5), max_running=pick(3, 4, 6, 8), chunk=pick(16, 32, 64),
                    pad_rows=pick(0, 1, 2, 3), prompt_len=(8, pick(64, 120)), seed=int(rng.integers(1 << 31)))
    return replace(cfg, **{k: v(cfg) if callable(v) else v for k, v in needs.items()})


def run_injection(cls: str, mode: str, seed: int, *, backend: str = "cpu", report: str = "log",
                  max_steps: int = 90) -> dict:
    """One seeded injection of ``cls`` under hash ``mode``; a dict with its outcome and evidence."""
    rng = np.random.default_rng(seed)
    fault = INJECTORS[cls](rng, mode)
    cfg = random_config(rng, fault.needs)
    eng = Engine(cfg, hash_mode=mode, backend=backend, report=report, fault=fault)
    warm, error = int(rng.integers(8, 16)), None
    try:
        with quiet():
            while eng.t < max_steps:
                fault.active = fault.active or (eng.t >= warm and fault.injected is None)
                eng.step()
                if fault.injected is None:
                    continue
                since_read = None if fault.read is None else eng.t - fault.read
                if since_read is not None and (_caught(eng, fault) or since_read > cfg.sweep_every + 2):
                    break
                if fault.read is None and eng.t - fault.injected > 3 * cfg.sweep_every + 12:
                    break
            eng.finish()
    except Exception as exc:  # a corrupted engine may trip over itself after the fact
        error = f"{type(exc).__name__}: {exc}"
    hits = _caught(eng, fault)
    early = [v for v in eng.violations if fault.injected is None or v["step"] < fault.injected]
    if fault.injected is None or fault.read is None:
        outcome = "not_exercised"
        reason = "never injected" if fault.injected is None else "corruption never read"
    else:
        outcome, reason = ("detected", "") if hits else ("missed", "")
    return dict(cls=cls, mode=mode, seed=seed, backend=backend, outcome=outcome, reason=reason,
                variant=fault.evidence.get("variant", ""), injected_step=fault.injected,
                read_step=fault.read, report_step=hits[0]["step"] if hits else None,
                latency=hits[0]["step"] - fault.injected if hits else None,
                read_latency=max(0, hits[0]["step"] - fault.read) if hits and fault.read is not None else None,
                violations=len(eng.violations), clean_violations=len(early), error=error,
                first_report=hits[0] if hits else None, evidence=_jsonable(fault.evidence),
                workload=dict(steps=eng.t, **eng.counts), config=asdict(cfg))


def _caught(eng, fault) -> list[dict]:
    return [v for v in eng.violations if fault.injected is not None and v["step"] >= fault.injected
            and v["slot"] in fault.involved.get(v["group"], ())]


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x.item() if isinstance(x, np.generic) else x


def seed_for(seed: int, cls: str, mode: str, i: int) -> int:
    return int(np.random.SeedSequence([seed, CLASSES.index(cls), MODES.index(mode), i]).generate_state(1)[0])


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


def _pool(workers: int) -> ProcessPoolExecutor:
    # spawn: a forked child would inherit a CUDA context it cannot use
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


def _gather(pool: ProcessPoolExecutor, futures: dict, on_result) -> None:
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


def _run_tasks(tasks: list[tuple[str, str, int]], *, backend: str, report: str, jobs: int,
               progress) -> list[dict]:
    """``run_injection`` for each ``(cls, mode, seed)``, records in task order."""
    total = len(tasks)
    if jobs <= 1 or total <= 1:
        records = []
        for c, m, s in tasks:
            records.append(run_injection(c, m, s, backend=backend, report=report))
            if progress:
                progress(len(records), total, f"{c} {m}")
        return records
    # One task per injection: the pool's cost per task (well under a millisecond) is small next to
    # an injection's (tenths of a second), and cells differ in cost, so fine-grained tasks keep
    # every worker busy up to the end. Only ~jobs tasks are in the pipe to the workers at a time.
    records: list = [None] * total
    done = 0

    def collect(f, record):
        nonlocal done
        k = index[f]
        records[k], done = record, done + 1
        if progress:
            progress(done, total, f"{tasks[k][0]} {tasks[k][1]}")

    with _pool(min(jobs, total)) as pool:
        index = {pool.submit(run_injection, c, m, s, backend=backend, report=report): k
                 for k, (c, m, s) in enumerate(tasks)}
        _gather(pool, {f: "injection {} {} seed {}".format(*tasks[k]) for f, k in index.items()}, collect)
    missing = [tasks[k] for k, r in enumerate(records) if r is None]
    if missing:  # cannot happen unless a future was lost; never report a short campaign as complete
        raise RuntimeError(f"kv-canary: {len(missing)} injection(s) returned no record, e.g. {missing[0]}")
    return records


def check_injections(injections) -> int:
    """``injections`` if it is a count >= 1; else ValidationError / ValidationTypeError (a campaign
    that injects nothing proves nothing and must not report success)."""
    if isinstance(injections, bool) or not isinstance(injections, (int, np.integer)):
        raise ValidationTypeError(f"kv-canary: injections must be an int, got {type(injections).__name__}. "
                                  f"Fix: pass a count such as 5")
    if injections < 1:
        raise ValidationError(f"kv-canary: --injections must be >= 1, got {injections} (a campaign that "
                              f"injects nothing proves nothing). Fix: --injections 5")
    return int(injections)


def run_campaign(classes=CLASSES, modes=MODES, injections: int = 3, *, backend: str = "cpu",
                 seed: int = 0, report: str = "log", progress=None, jobs: int = 1) -> dict:
    """Every class x mode: ``injections`` seeded injections (covered pairs only); returns a dict
    with one cell per pair (counts, rate, latency, variants) and every injection's record.

    ``jobs`` > 1 runs the injections in that many spawned worker processes (0: one per CPU); the
    result is the same as with ``jobs=1``. A worker re-imports the ``__main__`` module, so a script
    calling this with ``jobs`` > 1 needs an ``if __name__ == "__main__":`` guard."""
    check_injections(injections)
    jobs = resolve_jobs(jobs, backend)
    pairs = [(c, m) for c in classes for m in modes if coverage(c, m)[0]]
    tasks = [(c, m, seed_for(seed, c, m, i)) for c, m in pairs for i in range(injections)]
    t0 = time.perf_counter()
    records = iter(_run_tasks(tasks, backend=backend, report=report, jobs=jobs, progress=progress))
    cells, runs = {}, []
    for c in classes:
        for m in modes:
            rs = [next(records) for _ in range(injections)] if coverage(c, m)[0] else []
            cells[f"{c}/{m}"] = cell(c, m, rs)
            runs += rs
    return dict(backend=backend, seed=seed, injections=injections, classes=list(classes), modes=list(modes),
                titles={c: TITLES[c] for c in classes}, partial_note=PARTIAL_NOTE, cells=cells, runs=runs,
                seconds=round(time.perf_counter() - t0, 2))


def cell(cls: str, mode: str, rs: list[dict]) -> dict:
    """The table cell of ``cls`` x ``mode`` from its injections' records ``rs`` (none when the mode
    cannot see the class)."""
    covered, why = coverage(cls, mode)
    return dict(covered=covered, note=why, **(_summary(rs) if covered else {}))


def _summary(rs: list[dict]) -> dict:
    n = Counter(r["outcome"] for r in rs)
    lat = [r["latency"] for r in rs if r["outcome"] == "detected"]
    exercised = n["detected"] + n["missed"]
    return dict(injections=len(rs), detected=n["detected"], missed=n["missed"],
                not_exercised=n["not_exercised"], rate=(n["detected"] / exercised) if exercised else None,
                latency_max=max(lat) if lat else None, latency_mean=float(np.mean(lat)) if lat else None,
                read_latency_max=max((r["read_latency"] for r in rs if r["outcome"] == "detected"), default=None),
                clean_violations=sum(r["clean_violations"] for r in rs),
                errors=sum(r["error"] is not None for r in rs),
                variants=dict(Counter(r["variant"] for r in rs if r["variant"])))


def clean_config(seed: int = 0, **overrides) -> SimConfig:
    """A busy clean workload: long shared contexts, big batches, SWA, drafts, offload, sweeps."""
    cfg = SimConfig(num_slots=1 << 14, page_size=16, layers=2, max_running=32, max_len=2048,
                    prompt_len=(600, 1500), output_len=(4, 16), chunk=512, share_prob=0.6,
                    swa_window=64, spec_k=2, sweep_every=4, cache_entries=48, host_entries=8,
                    admit_per_step=32, verify_capacity=1 << 17, sweep_capacity=1 << 15, seed=seed)
    return replace(cfg, **overrides)


def clean_run(min_verified: int = 10**6, *, hash_mode: str = "all", backend: str = "cpu", seed: int = 0,
              max_steps: int = 10_000, progress=None, jobs: int = 1, **overrides) -> dict:
    """Run a clean engine until the canary verified ``min_verified`` slots; every violation is a
    false positive.

    ``jobs`` > 1 (0: one per CPU) instead runs that many clean engines with seeds ``seed``,
    ``seed + 1``, ... in spawned worker processes, each until ceil(min_verified / jobs) verified
    slots, and merges them (see ``merge_clean_runs``)."""
    jobs = resolve_jobs(jobs, backend)
    if jobs > 1:
        return _parallel_clean_run(min_verified, jobs, hash_mode=hash_mode, backend=backend, seed=seed,
                                   max_steps=max_steps, progress=progress, **overrides)
    eng = Engine(clean_config(seed, **overrides), hash_mode=hash_mode, backend=backend)
    t0 = time.perf_counter()
    while eng.t < max_steps:
        eng.step()
        verified = eng.stats()["verified_slots"]
        if progress:
            progress(min(verified, min_verified), min_verified, f"clean {hash_mode}")
        if verified >= min_verified:
            break
    eng.finish()
    eng.kv.health_check()  # a clean engine's canary ran every launch and delivered every self-test
    s = eng.stats()
    return dict(hash_mode=hash_mode, backend=backend, steps=eng.t, verified_slots=s["verified_slots"],
                protected_tokens=s["protected_tokens"], false_positives=len(eng.violations),
                first_false_positives=eng.violations[:5], workload=dict(eng.counts),
                seconds=round(time.perf_counter() - t0, 2))


def _parallel_clean_run(min_verified: int, jobs: int, *, hash_mode: str, backend: str, seed: int,
                        max_steps: int, progress, **overrides) -> dict:
    each = math.ceil(min_verified / jobs)
    results: list = [None] * jobs
    verified = 0
    t0 = time.perf_counter()

    def collect(f, r):
        nonlocal verified
        results[index[f]] = r
        verified += r["verified_slots"]
        if progress:
            progress(min(verified, min_verified), min_verified, f"clean {hash_mode}")

    if progress:
        progress(0, min_verified, f"clean {hash_mode}")
    with _pool(jobs) as pool:
        index = {pool.submit(clean_run, each, hash_mode=hash_mode, backend=backend, seed=seed + i,
                             max_steps=max_steps, **overrides): i for i in range(jobs)}
        _gather(pool, {f: f"clean run seed {seed + i}" for f, i in index.items()}, collect)
    merged = merge_clean_runs(results, seeds=[seed + i for i in range(jobs)])
    merged["seconds"] = round(time.perf_counter() - t0, 2)
    return merged


def merge_clean_runs(runs: list[dict], seeds: list[int] | None = None) -> dict:
    """One clean-run dict from several (same keys as ``clean_run`` plus ``runs``): counts summed,
    the first five false positives kept in run order (each tagged with its run's seed when
    ``seeds`` is given, so it can be replayed), workload counters added up, ``seconds`` the
    longest run's (the caller overwrites it with the wall time)."""
    first, workload = [], {}
    for i, r in enumerate(runs):
        for v in r["first_false_positives"]:
            if len(first) < 5:
                first.append(v if seeds is None else {**v, "run_seed": seeds[i]})
        for k, n in r["workload"].items():
            workload[k] = workload.get(k, 0) + n
    keys = ("steps", "verified_slots", "protected_tokens", "false_positives")
    sums = {k: sum(r[k] for r in runs) for k in keys}
    return dict(hash_mode=runs[0]["hash_mode"], backend=runs[0]["backend"], steps=sums["steps"],
                verified_slots=sums["verified_slots"], protected_tokens=sums["protected_tokens"],
                false_positives=sums["false_positives"], first_false_positives=first, workload=workload,
                seconds=max(r["seconds"] for r in runs), runs=len(runs))
