"""Fault-injection campaign: for each class x hash mode, N independent seeded injections in
randomized workloads of the simulated engine (the long clean runs for false positives are
:mod:`.clean`'s).

An injection is *detected* when the canary reported (mode "log" through the export callback,
or mode "raise" through CanaryViolationError) a violation that names one of the fault's
involved slots at or after the step the fault landed; *missed* when the fault was really read
(engine ground truth) and nothing was reported; *not exercised* when it never landed or was
never read. Class x mode pairs that FAULTS.md says a mode cannot see are "not covered" and not
run. Latency is counted in engine steps from the corruption to the first report, and from the
first read of the corrupted content to the first report (0: caught on the step that read it).

Injections are independent and fully determined by their seed, so ``jobs > 1`` runs them in
spawned worker processes (:mod:`.workers`) and gives the same records in the same order.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import asdict, replace

import numpy as np

from ..errors import ValidationError, ValidationTypeError
from .data import SimConfig
from .engine import Engine
from .faults import CLASSES, K1, K2, K3, K4, MODES, PARTIAL_NOTE, TITLES, coverage
from .faults_kv import K5, K6, K7, K10, K12
from .faults_step import K8, K9, K11, K13
from .faults_write import K14, K5b
from .workers import gather, pool, resolve_jobs

INJECTORS = {f.cls: f for f in (K1, K2, K3, K4, K5, K6, K7, K8, K9, K10, K11, K12, K13, K14, K5b)}


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

    with pool(min(jobs, total)) as workers:
        index = {workers.submit(run_injection, c, m, s, backend=backend, report=report): k
                 for k, (c, m, s) in enumerate(tasks)}
        gather(workers, {f: "injection {} {} seed {}".format(*tasks[k]) for f, k in index.items()}, collect)
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
