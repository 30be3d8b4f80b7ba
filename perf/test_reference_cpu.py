"""Issue 3/6: the CPU reference backend's verify throughput (no GPU needed).

Decode bs 256 x context 4096 = 1M verify entries, identity-only (and PARTIAL for information),
through the public ``kvcanary.verify`` on host (numpy) arrays: the path the embedded CPU default
takes. The buffer is stamped by the reference ``kvcanary.write`` first, so the verify is clean.
Target: >= 5M entries/s identity-only on one core. pytest-benchmark times one verify per round;
the row's rate is entries / its median.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi

from .workloads import MODES

BS, CTX = 256, 4096
TARGET_ENTRIES_PER_S = 5e6


def host_workload(mode: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    num_slots = BS * CTX + 1
    slots = (rng.permutation(num_slots - 1) + 1).reshape(BS, CTX)
    rtt = np.zeros((BS + 1, CTX), np.int32)
    rtt[1:] = slots
    rpi = np.arange(1, BS + 1, dtype=np.int64)
    tokens = rng.integers(0, 1 << 17, (BS, CTX)).astype(np.int64)
    sources = []
    if mode != "identity":
        pool = rng.integers(0, 256, (num_slots, 64), dtype=np.uint8)
        sources = [kc.RealKvSource(pool, 1, 64, 64)]
    ctx = kc.VerifyContext(kc.CanaryBuffer.allocate(num_slots), kc.ViolationSink.allocate(),
                           abi.LaunchTag.TAIL_K_FULL, sources, MODES[mode])
    stamp = kc.Batch(req_pool_indices=rpi, prefix_lens=np.zeros(BS, np.int64),
                     extend_lens=np.full(BS, CTX, np.int64), req_to_token=rtt)
    plan = kc.StepPlan.allocate(BS, 1)
    kc.build_plan(stamp, plan)
    kc.write(ctx, plan, tokens.reshape(-1), np.tile(np.arange(CTX, dtype=np.int64), BS),
             slots.reshape(-1).astype(np.int64))
    step = kc.Batch(req_pool_indices=rpi, prefix_lens=np.full(BS, CTX, np.int64),
                    extend_lens=np.zeros(BS, np.int64), req_to_token=rtt)
    vplan = kc.StepPlan.allocate(BS, BS * CTX)
    kc.build_plan(step, vplan)
    return ctx, vplan


@pytest.mark.parametrize("mode", ["identity", "partial"])
def test_reference_verify(report, mode):
    ctx, plan = host_workload(mode)
    entries = int(plan.num_valid[0])
    assert entries == BS * CTX and int(ctx.sink.write_index_view.host[0]) == 0

    seconds = report.cpu(lambda: kc.verify(ctx, plan), rounds=5, warmup=1)
    assert int(ctx.sink.write_index_view.host[0]) == 0, "the benchmark workload must verify clean"
    rate = entries / seconds
    report.row(f"reference verify {mode}, 1M entries (CPU)", rate, "entries/s",
               bound=TARGET_ENTRIES_PER_S if mode == "identity" else None,
               bound_name="target rate" if mode == "identity" else "",
               target=(">=", 1.0) if mode == "identity" else None, seconds=seconds,
               **{"entries/s": rate}, series="reference CPU", size=entries)
