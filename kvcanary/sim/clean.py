"""Long clean runs of the simulated engine: no fault is injected, so every violation the canary
reports is a false positive (``python -m kvcanary demo --clean-slots N``).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from .data import SimConfig
from .engine import Engine
from .workers import gather, pool, resolve_jobs


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
    with pool(jobs) as workers:
        index = {workers.submit(clean_run, each, hash_mode=hash_mode, backend=backend, seed=seed + i,
                             max_steps=max_steps, **overrides): i for i in range(jobs)}
        gather(workers, {f: f"clean run seed {seed + i}" for f, i in index.items()}, collect)
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
