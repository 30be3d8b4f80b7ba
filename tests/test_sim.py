"""The simulated serving engine (kvcanary.sim): a correct engine driving a KvCanary through the
public step API must report nothing while it exercises every feature the fault campaign needs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvcanary.sim import Engine, SimConfig
from kvcanary.sim.kvpool import content, scale_content
from kvcanary.sim.data import seq_keys

FEATURES = ("prefix_hit_tokens", "prefill_chunks", "drafts_accepted", "drafts_rejected", "finished",
            "offloads", "loads", "swept_slots")


def busy(**kw) -> SimConfig:
    """Small pool under pressure: sharing, chunked prefill, SWA, scales, drafts, offload, sweeps."""
    base = dict(num_slots=1024, page_size=16, layers=2, scales=True, swa_window=16, spec_k=3,
                offload=True, offload_prob=1.0, sweep_every=3, max_running=6, chunk=24, pad_rows=2,
                prompt_len=(16, 100), output_len=(4, 24), share_prob=0.8, cache_entries=8, seed=11)
    return SimConfig(**{**base, **kw})


@pytest.mark.parametrize("mode", ["none", "partial", "all"])
def test_engine_runs_clean_with_every_feature(mode):
    eng = Engine(busy(), hash_mode=mode)
    for _ in range(150):
        eng.step()
    eng.finish()
    assert eng.violations == []
    stats = eng.stats()
    assert stats["violations"] == 0 and stats["skipped_verifies"] == 0
    assert stats["self_tests"] == 150 // 5  # one HEAD verify per step, a self-test every 5th (SimConfig)
    eng.kv.health_check()
    assert stats["verified_slots"] > 10_000 and stats["protected_tokens"] > 1_000
    missing = [f for f in FEATURES if eng.counts[f] == 0]
    assert not missing, f"workload never exercised {missing}: {dict(eng.counts)}"
    assert eng.counts["prefill_chunks"] > eng.counts["requests"]  # prompts longer than a chunk


@pytest.mark.parametrize("kw", [dict(swa_window=0, spec_k=0, scales=False, pad_rows=0, page_size=1),
                                dict(layers=3, heads=2, head_bytes=32, page_size=4, spec_k=2),
                                dict(offload=False, sweep_every=0, swa_window=48)])
def test_engine_variants_run_clean(kw):
    eng = Engine(busy(**kw), hash_mode="all")
    for _ in range(60):
        eng.step()
    eng.finish()
    assert eng.violations == [] and eng.stats()["verified_slots"] > 0


def test_model_content_is_deterministic_and_sensitive():
    tok, pos = np.array([5, 5, 6]), np.array([0, 1, 0])
    a = content(tok, pos, 7, 64)
    assert a.shape == (3, 64) and a.dtype == np.uint8
    assert (a == content(tok, pos, 7, 64)).all()               # a shared prefix is reproducible
    assert (a[0] != a[1]).any() and (a[0] != a[2]).any()        # position and token matter
    assert (a != content(tok, pos, 8, 64)).any(axis=1).all()    # so does the layer / half
    s = scale_content(tok, pos, 3).view("<f4")
    assert np.isfinite(s).all() and (s > 0).all() and (s < 1).all()


def test_seq_keys_chain_positions_and_prefixes():
    a = seq_keys([1, 2, 3])
    assert (seq_keys([1, 2, 4])[:2] == a[:2]).all() and seq_keys([1, 2, 4])[2] != a[2]
    assert seq_keys([9, 2, 3])[2] != a[2]                        # the whole prefix counts
    assert seq_keys([3], int(a[1]), 2)[0] == a[2]                 # incremental == batch


def test_records_travel_with_offloaded_kv():
    eng = Engine(busy(offload_prob=0.0, sweep_every=1), hash_mode="all")
    while not [e for e in eng.cache.entries if e.users == 0]:
        eng.step()
    e = [e for e in eng.cache.entries if e.users == 0][0]
    before = eng.kv.export_records(e.slots, group="FULL").to_host().records
    eng.cache.offload(e)
    eng.cache.drop(e)
    hold = eng.cache.alloc(2 * len(e.slots))                      # the freed slots go to others
    loaded = eng.cache.load(eng.cache.host[-1], len(e.tokens))
    eng.release(hold)
    assert loaded is not None and not set(loaded.slots.tolist()) & set(e.slots.tolist())
    assert np.array_equal(before, eng.kv.export_records(loaded.slots, group="FULL").to_host().records)
    eng.cache.sweep()                                            # the moved prefix still verifies
    for _ in range(5):
        eng.step()
    assert eng.violations == []


def test_raise_mode_reports_through_the_exception():
    eng = Engine(busy(), hash_mode="partial", report="raise")
    for _ in range(20):
        eng.step()
    r = eng.running[0]
    eng.full.slots("K0")[r.slots[0], 0] ^= 0x10
    eng.full.dirty.add("K0")
    eng.step()
    assert any(v["slot"] == r.slots[0] and "verify_real_kv_hash" in v["reasons"] for v in eng.violations)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "all"])
def test_engine_runs_clean_on_the_gpu(mode):
    eng = Engine(busy(), hash_mode=mode, backend="gpu")
    for _ in range(80):
        eng.step()
    eng.finish()
    assert eng.violations == [] and eng.stats()["verified_slots"] > 10_000
    assert all(eng.counts[f] for f in ("prefix_hit_tokens", "drafts_rejected", "swept_slots"))


def test_a_sweeps_rows_count_in_the_engine_step_that_swept():
    # A sweep after step t's after_forward carries the kv step label of step t + 1; on the device
    # its rows arrive with step t + 1's snapshot. They belong to step t (the GPU campaign counted
    # them one step late: read latency 1 for K2 and K10).
    eng = Engine(busy(sweep_every=0), hash_mode="none")
    none = np.zeros(0, np.int64)
    eng.cache.sweep = lambda: eng._canary(eng.kv.sweep, none, none, none, group="FULL")
    eng.cfg = replace(eng.cfg, sweep_every=1)  # every step sweeps (nothing: the rows are fed below)
    for _ in range(3):
        eng.step()
    swept_at, label = eng.t - 1, eng.kv.step  # step 2 swept under the label of step 3
    eng.step()
    row = dict(type="violation", step=label, slot_idx=5, position=0, fail_reason=["verify_chain_hash"])
    eng._export(dict(row, launch_tag="SWEEP_K_FULL"))
    eng._export(dict(row, launch_tag="HEAD_K_FULL"))
    assert [v["step"] for v in eng.violations] == [swept_at, swept_at + 1]
