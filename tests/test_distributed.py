"""TensorParallelAggregator on the CPU: 3 spawned ranks in a gloo process group, each running its
own KvCanary on the reference backend (tests/support/session.py's engine over host numpy pools).

One spawn runs every scenario (each in a gloo group of its own, so a failing scenario cannot
block the next); the tests below assert on what each rank wrote. Expected values come from the
aggregator's contract (lag, stale_steps, rows_per_step) and from the source rank's own canary
records, never from the aggregator's output on another rank.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import subprocess
import sys
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest

WORLD = 3
TIMEOUT_S = 120


# ---- what each rank runs (in a spawned process) ----------------------------------------------------
def _flip_kv(sess, arrays):  # tests/test_manager.py's fault: a K byte of request B's position 2
    sess.k[0][int(sess.rtt[2, 2]), 5] ^= 0x40
    sess.sync_pools()


def _wrong_rtt(sess, arrays):  # B's cached position 3 points at A's slot: several rows in one step
    sess.rtt[2, 3] = sess.rtt[1, 0]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _session_run(rank, group, *, device=None, fault_rank=None, corrupt=None, fault_at=4, **agg_kw):
    """The scripted session with an exchange after every engine step; returns what this rank saw.
    ``device``: None (reference backend) or the rank's CUDA device."""
    from kvcanary.distributed import TensorParallelAggregator
    from kvcanary.errors import CanaryViolationError
    from tests.support.session import Session
    sess = Session(device)
    aggregated = []
    agg = TensorParallelAggregator(sess.canary, group, export=aggregated.append, **agg_kw)
    lines = _Lines()
    logging.getLogger("kvcanary.distributed").addHandler(lines)
    out = {"raised": None}

    def step(work, c):
        sess.step(work, corrupt=c if rank == fault_rank else None)
        t = time.perf_counter()
        agg.exchange()
        out.setdefault("exchange_s", []).append(time.perf_counter() - t)

    try:
        sess.play(fault_at, corrupt, step=step)
        agg.flush()
    except CanaryViolationError as exc:
        out["raised"] = {"at": agg.exchanges - 1, "lines": [str(v) for v in exc.violations],
                         "ranks": [v.source_rank for v in exc.violations]}
    finally:
        logging.getLogger("kvcanary.distributed").removeHandler(lines)
    local = [r for r in sess.records if r["type"] == "violation"]
    health = None
    try:
        agg.health_check()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        health = str(exc)
    return {**out, "local": local, "aggregated": aggregated, "lines": lines.lines, "health": health,
            "local_stats": sess.canary.stats(), "local_step": sess.canary.step, "agg_stats": agg.stats()}


def _stopped_run(rank, group, *, device=None, stop_rank=2, health_rank=1):
    """``stop_rank``'s canary stops after step 2 (the rank keeps exchanging); ``health_rank``'s own
    health check fails from exchange 8 on. Returns the unhealthy ranks seen after each exchange."""
    from kvcanary.distributed import TensorParallelAggregator
    from kvcanary.errors import KvCanaryError
    from tests.support.session import Session
    sess = Session(device)
    agg = TensorParallelAggregator(sess.canary, group, stale_steps=2)
    seen = []
    for k in range(11):
        if not (rank == stop_rank and k > 2):
            sess.step([(1, [100, 101, 102, 103])] if k == 0 else [(1, [104 + k])])
        if rank == health_rank and k == 8:
            def failing():
                raise KvCanaryError("kv-canary: health check failed (injected)")
            sess.canary.health_check = failing
        agg.exchange()
        seen.append(sorted(agg.unhealthy_ranks()))
    try:
        agg.health_check()
        health = None
    except KvCanaryError as exc:
        health = str(exc)
    return {"seen": seen, "health": health}


def _cost_run(rank, group, lag, steps=100, step_s=0.002):
    """Host time of exchange() per step, each after a 2 ms stand-in for the forward."""
    from kvcanary.distributed import TensorParallelAggregator
    from tests.support.session import Session
    agg = TensorParallelAggregator(Session().canary, group, lag=lag)
    times = []
    for _ in range(steps):
        time.sleep(step_s)
        t = time.perf_counter()
        agg.exchange()
        times.append(time.perf_counter() - t)
    agg.flush()
    return {"median_us": float(np.median(times) * 1e6), "mean_us": float(np.mean(times) * 1e6)}


SCENARIOS = {
    "clean": lambda rank, g: _session_run(rank, g),
    "fault_log": lambda rank, g: _session_run(rank, g, fault_rank=1, corrupt=_flip_kv),
    "fault_raise": lambda rank, g: _session_run(rank, g, fault_rank=2, corrupt=_flip_kv, mode="raise", lag=0),
    "backlog": lambda rank, g: _session_run(rank, g, fault_rank=0, corrupt=_wrong_rtt, fault_at=3, rows_per_step=1),
    "stopped": _stopped_run,
    "cost_lag1": lambda rank, g: _cost_run(rank, g, 1),
    "cost_lag0": lambda rank, g: _cost_run(rank, g, 0),
}


def run_scenarios(rank: int, scenarios: dict, backend: str, timeout_s: int, out_file: str) -> None:
    """A rank's side of a distributed tier: each scenario on a group of its own (all created first,
    in the same order on every rank), its result or its traceback written to ``out_file`` for the
    parent (:func:`collect`); then the process group is destroyed."""
    import torch.distributed as dist
    groups = {name: dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s)) for name in scenarios}
    results = {}
    for name, run in scenarios.items():
        try:
            results[name] = run(rank, groups[name])
        except BaseException:  # noqa: BLE001 - reported to the test
            results[name] = {"error": traceback.format_exc()}
    with open(out_file, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    run_scenarios(rank, SCENARIOS, "gloo", 30, out_file)


# ---- the parent: spawn once, then assert per scenario ----------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("torch.distributed")
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    tmp = tmp_path_factory.mktemp("tp")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, WORLD, str(tmp / "rendezvous"), str(tmp / f"rank{r}.json")))
             for r in range(WORLD)]
    [p.start() for p in procs]
    return collect(procs, tmp, TIMEOUT_S)


def collect(procs, tmp, timeout_s: float) -> list[dict]:
    """Each rank's results (rank{r}.json in ``tmp``) once every process ended cleanly within
    ``timeout_s`` (a hung rank is killed and fails the run)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, f"{len(hung)} rank(s) still running after {timeout_s} s"
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(len(procs))]


def strip(records):
    """Aggregated records without the keys the aggregator adds: the source rank's records."""
    return [{k: v for k, v in r.items() if k not in ("source_rank", "reported_at")} for r in records]


def scenario(ranks, name):
    out = [r[name] for r in ranks]
    for rank, o in enumerate(out):
        assert "error" not in o, f"rank {rank}:\n{o['error']}"
    return out


def test_clean_run_reports_nothing_and_every_rank_sees_every_ranks_counters(ranks):
    out = scenario(ranks, "clean")
    for o in out:
        assert o["local"] == [] and o["aggregated"] == [] and o["lines"] == [] and o["raised"] is None
        assert o["health"] is None
        assert o["agg_stats"]["world_size"] == WORLD and o["agg_stats"]["reported"] == 0
        for r, seen in enumerate(o["agg_stats"]["ranks"]):  # rank r's counters as rank r's canary has them
            assert seen["rank"] == r and seen["step"] == out[r]["local_step"] == 7
            for key in ("protected_tokens", "verified_slots", "violations"):
                assert seen[key] == out[r]["local_stats"].get(key, 0), (r, key)
        assert o["agg_stats"]["verified_slots"] == sum(x["local_stats"]["verified_slots"] for x in out) > 0
    cost = {name: scenario(ranks, name) for name in ("cost_lag1", "cost_lag0")}
    print(f"\ngloo exchange() per step, {WORLD} ranks, 2 ms steps: "
          + ", ".join(f"{name}: median {np.median([o['median_us'] for o in c]):.0f} us, mean "
                      f"{np.mean([o['mean_us'] for o in c]):.0f} us" for name, c in cost.items()))


def test_a_fault_on_one_rank_is_logged_on_every_rank_in_the_same_step_with_its_rank(ranks):
    out = scenario(ranks, "fault_log")
    truth = out[1]["local"]  # what rank 1's own canary reported
    assert truth and {r["step"] for r in truth} >= {4} and out[0]["local"] == out[2]["local"] == []
    for o in out:
        assert strip(o["aggregated"]) == truth
        assert {r["source_rank"] for r in o["aggregated"]} == {1}
        assert [r["reported_at"] for r in o["aggregated"]] == [r["step"] + 1 for r in truth]  # lag 1
        assert len(o["lines"]) == len(truth)
        assert all(line.startswith("kv_canary violation: source_rank=1 step=") for line in o["lines"])
        assert "launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash" in o["lines"][0]
        assert o["raised"] is None and o["health"] is None
    assert out[0]["aggregated"] == out[1]["aggregated"] == out[2]["aggregated"]


def test_a_fault_on_one_rank_is_raised_on_every_rank_in_the_same_step(ranks):
    out = scenario(ranks, "fault_raise")
    first_step = min(r["step"] for r in out[2]["local"])
    assert first_step == 4
    for o in out:
        raised = o["raised"]
        assert raised is not None and raised["at"] == first_step  # lag 0: the exchange of that step
        assert set(raised["ranks"]) == {2}
        assert all(line.startswith("kv_canary violation: source_rank=2 step=4 ") for line in raised["lines"])
    assert out[0]["raised"] == out[1]["raised"] == out[2]["raised"]


def test_rows_beyond_rows_per_step_follow_in_later_exchanges_in_order(ranks):
    out = scenario(ranks, "backlog")
    truth = out[0]["local"]
    per_step = {s: sum(r["step"] == s for r in truth) for s in {r["step"] for r in truth}}
    assert per_step[3] > 1  # more rows in one step than rows_per_step=1 ships
    for o in out:
        got = o["aggregated"]
        assert strip(got) == truth
        at = [r["reported_at"] for r in got]
        assert at[:3] == [4, 5, 6] and at == sorted(at)  # one per exchange, then the flush drains the rest
        assert o["agg_stats"]["violations"] == out[0]["local_stats"]["violations"]
        assert [r["pending"] for r in o["agg_stats"]["ranks"]] == [0] * WORLD
    assert out[0]["aggregated"] == out[1]["aggregated"] == out[2]["aggregated"]


def test_a_rank_that_stops_stepping_fails_every_ranks_health_check(ranks):
    out = scenario(ranks, "stopped")
    # rank 2 stays at step 3; at exchange j the others are at step j + 1: more than stale_steps=2
    # behind from j = 5, seen one exchange later (lag 1). Rank 1 fails from exchange 8, seen at 9.
    want = [[]] * 6 + [[2]] * 3 + [[1, 2]] * 2
    for o in out:
        assert o["seen"] == want
        assert "rank 2: its canary stopped stepping (step 3, 7 behind rank 0)" in o["health"]
        assert "rank 1: its own health check failed" in o["health"] and "rank 0:" not in o["health"]
    assert "(injected)" in out[1]["health"] and "(see that rank's log)" in out[0]["health"]


# ---- in this process -------------------------------------------------------------------------------
def test_importing_kvcanary_and_the_module_does_not_import_torch():
    code = "import sys, kvcanary, kvcanary.distributed; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_violation_rows_round_trip_the_source_ranks_records():
    from kvcanary import abi
    from kvcanary.distributed import RankViolation, pack_row
    from tests.support.session import Session
    records = [r for r in Session().script(3, _wrong_rtt) if r["type"] == "violation"]
    assert records and any(int(r["stored_chain_hash"], 16) >> 63 for r in records)  # hashes above 2^63
    for r in records:
        rv = RankViolation.from_row(np.array(pack_row(r), np.int64), 5)
        assert rv.to_dict() == {**r, "source_rank": 5}
        assert str(rv).startswith(f"kv_canary violation: source_rank=5 step={r['step']} launch_tag={r['launch_tag']} ")
    odd = {**records[0], "launch_tag": "UNKNOWN_77"}
    assert RankViolation.from_row(pack_row(odd), 0).to_dict()["launch_tag"] == "UNKNOWN_77"
    assert pack_row({**records[0], "launch_tag": "TAIL_V_SWA"})[0] == int(abi.LaunchTag.TAIL_V_SWA)


def test_construction_errors_say_what_was_expected_and_how_to_fix_it():
    pytest.importorskip("torch.distributed")
    from kvcanary.distributed import TensorParallelAggregator
    from kvcanary.errors import ValidationError
    from tests.support.session import Session
    with pytest.raises(ValidationError, match=r"^kv-canary: .*mode 'log', got mode 'raise'.*Fix: "):
        TensorParallelAggregator(Session(mode="raise").canary)
    canary = Session().canary
    with pytest.raises(ValidationError, match=r"^kv-canary: .*mode must be 'log' or 'raise', got 'warn'. Fix: "):
        TensorParallelAggregator(canary, mode="warn")
    with pytest.raises(ValidationError, match=r"^kv-canary: .*lag=2.*Fix: "):
        TensorParallelAggregator(canary, lag=2)
    import torch.distributed as dist
    if not dist.is_initialized():
        with pytest.raises(ValidationError, match=r"^kv-canary: .*initialised torch.distributed process group, "
                                                  r"got none. Fix: "):
            TensorParallelAggregator(canary)
