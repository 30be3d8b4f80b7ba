"""GPU tier, two or more devices: TensorParallelAggregator over NCCL, 2 spawned ranks, one GPU
each (rank r on cuda:r), each with its own KvCanary on its device (tests/support/session.py). The same
cases as tests/test_distributed.py (clean run, a fault on one rank logged and raised on every
rank in the same exchange, a rank that stops stepping flagged everywhere), then the aggregator's
cost per step, printed (run with -s): host time of exchange(), device time of the gather on its
side stream, and the step time of a GPU stand-in forward with and without the exchange.

NVLink multicast stays off in the ranks (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1), as the device machines require.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import timedelta

import numpy as np
import pytest

from tests.test_distributed import _flip_kv, _session_run, _stopped_run, collect, run_scenarios, scenario, strip

pytestmark = pytest.mark.gpu

WORLD = 2
TIMEOUT_S = 300
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _cost_run(rank, group, *, device, steps=200):
    """Per step: a stand-in forward (matmuls on the engine's stream, then the token read-back
    sync an engine does), timed without and with ``exchange()`` after it (lag 1 and 0)."""
    import torch
    from kvcanary.distributed import TensorParallelAggregator
    from tests.support.session import Session
    a = torch.randn(4096, 4096, device=f"cuda:{device}")

    def forward():
        for _ in range(4):
            a @ a
        torch.cuda.synchronize(device)

    out = {}
    for lag in (1, 0):
        agg = TensorParallelAggregator(Session(device).canary, group, lag=lag)
        gather, issue, events = agg._gather, agg._gather.issue, []

        def timed(slot, gather=gather, issue=issue, events=events):  # device time on the side stream
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(gather.stream)
            issue(slot)
            end.record(gather.stream)
            events.append((start, end))

        gather.issue = timed
        bare, full, host = [], [], []
        for _ in range(steps):
            t = time.perf_counter()
            forward()
            bare.append(time.perf_counter() - t)
        for _ in range(steps):
            t = time.perf_counter()
            forward()
            t1 = time.perf_counter()
            agg.exchange()
            host.append(time.perf_counter() - t1)
            full.append(time.perf_counter() - t)
        agg.flush()
        torch.cuda.synchronize(device)
        us = lambda xs: float(np.median(xs) * 1e6)  # noqa: E731
        out[f"lag{lag}"] = {"exchange_host_us": us(host), "gather_device_us": float(np.median(
            [s.elapsed_time(e) * 1e3 for s, e in events])), "step_bare_us": us(bare), "step_with_us": us(full)}
    return out


SCENARIOS = {
    "clean": lambda rank, g: _session_run(rank, g, device=rank),
    "fault_log": lambda rank, g: _session_run(rank, g, device=rank, fault_rank=1, corrupt=_flip_kv),
    "fault_raise": lambda rank, g: _session_run(rank, g, device=rank, fault_rank=1, corrupt=_flip_kv,
                                                mode="raise", lag=0),
    "stopped": lambda rank, g: _stopped_run(rank, g, device=rank, stop_rank=1, health_rank=0),
    "cost": lambda rank, g: _cost_run(rank, g, device=rank),
}


def _worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    os.environ.update(NO_MULTICAST)  # before NCCL creates a communicator
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    run_scenarios(rank, SCENARIOS, "nccl", 60, out_file)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices visible to torch")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    tmp = tmp_path_factory.mktemp("tp_gpu")
    ctx = multiprocessing.get_context("spawn")
    saved = {k: os.environ.get(k) for k in NO_MULTICAST}
    os.environ.update(NO_MULTICAST)  # the children's environment from their first instruction
    try:
        procs = [ctx.Process(target=_worker, args=(r, WORLD, str(tmp / "rendezvous"), str(tmp / f"rank{r}.json")))
                 for r in range(WORLD)]
        [p.start() for p in procs]
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return collect(procs, tmp, TIMEOUT_S)


def test_clean_nccl_run_reports_nothing_and_every_rank_sees_every_ranks_counters(ranks):
    out = scenario(ranks, "clean")
    for o in out:
        assert o["local"] == o["aggregated"] == o["lines"] == [] and o["raised"] is None and o["health"] is None
        for r, seen in enumerate(o["agg_stats"]["ranks"]):
            assert seen["step"] == out[r]["local_step"] == 7
            for key in ("protected_tokens", "verified_slots", "violations"):
                assert seen[key] == out[r]["local_stats"].get(key, 0), (r, key)
        assert o["agg_stats"]["verified_slots"] > 0


def test_a_fault_on_one_gpu_is_logged_on_every_rank_in_the_same_exchange(ranks):
    out = scenario(ranks, "fault_log")
    truth = out[1]["local"]
    assert truth and min(r["step"] for r in truth) == 4 and out[0]["local"] == []
    assert out[0]["aggregated"] == out[1]["aggregated"]  # same rows, same reported_at, on both ranks
    for o in out:
        assert strip(o["aggregated"]) == truth and {r["source_rank"] for r in o["aggregated"]} == {1}
        assert all(r["reported_at"] >= r["step"] + 1 for r in o["aggregated"])  # the pump, then lag 1
        assert len(o["lines"]) == len(truth)
        assert all(line.startswith("kv_canary violation: source_rank=1 step=") for line in o["lines"])


def test_a_fault_on_one_gpu_is_raised_on_every_rank_in_the_same_exchange(ranks):
    out = scenario(ranks, "fault_raise")
    assert out[0]["raised"] is not None and out[0]["raised"] == out[1]["raised"]
    assert set(out[0]["raised"]["ranks"]) == {1} and out[0]["raised"]["at"] >= 4


def test_a_gpu_rank_that_stops_stepping_fails_every_ranks_health_check(ranks):
    out = scenario(ranks, "stopped")
    want = [[]] * 6 + [[1]] * 3 + [[0, 1]] * 2  # as on the CPU: rank 1 stops after step 2, rank 0 fails at 8
    for o in out:
        assert o["seen"] == want
        assert "rank 1: its canary stopped stepping (step 3, 7 behind rank 0)" in o["health"]
        assert "rank 0: its own health check failed" in o["health"]


def test_aggregator_cost_per_step_is_printed(ranks):
    out = scenario(ranks, "cost")
    for lag in ("lag1", "lag0"):
        rows = [o[lag] for o in out]
        print(f"\nNCCL {WORLD} ranks, {lag}: " + ", ".join(
            f"{k} {np.median([r[k] for r in rows]):.1f}" for k in rows[0]))
        assert all(r["gather_device_us"] > 0 and r["exchange_host_us"] > 0 for r in rows)
