"""GPU tier: plan builder kernels == reference; fused verify == build_plan + verify."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi, memory

pytestmark = pytest.mark.gpu


def random_batch(seed, *, bs=64, rows=100, max_len=512, num_slots=30000, swa=False, expected=False):
    rng = np.random.default_rng(seed)
    rtt = rng.integers(1, num_slots, (rows, max_len)).astype(np.int32)
    rtt[rng.random((rows, max_len)) < 0.01] = 0  # some predecessors are the padding slot
    rpi = rng.integers(1, rows, bs).astype(np.int64)
    rpi[-bs // 8:] = 0  # padding rows at the end
    prefix = rng.integers(0, max_len + 20, bs).astype(np.int64)  # some beyond max_len: clamped
    extend = rng.integers(0, 5, bs).astype(np.int64)
    batch = dict(req_pool_indices=rpi, prefix_lens=prefix, extend_lens=extend, req_to_token=rtt)
    kw = {}
    if swa:
        kw["swa_window"] = int(rng.integers(1, 100))
        kw["swa_map"] = rng.integers(1, 20000, num_slots + 10).astype(np.int64)
    if expected:
        batch["expected_pool"] = rng.integers(0, 1000, (rows, max_len + 4)).astype(np.int64)
        batch["expected_valid_lens"] = rng.integers(0, max_len, bs).astype(np.int64)
        batch["expected_token_offset"] = int(rng.integers(0, 2))
    return batch, kw


def on(dev, batch):
    return kc.Batch(**{k: (memory.to_device(v) if isinstance(v, np.ndarray) and dev else v) for k, v in batch.items()})


@pytest.mark.parametrize("seed,swa,expected,cap", [(0, False, False, 1 << 16), (1, True, False, 1 << 16),
                                                   (2, False, True, 1 << 16), (3, True, True, 1 << 16),
                                                   (4, False, False, 100)])
def test_plan_kernels_equal_reference(seed, swa, expected, cap):
    batch, kw = random_batch(seed, swa=swa, expected=expected)
    ref = kc.StepPlan.allocate(80, cap)
    kc.build_plan(on(False, batch), ref, **kw)
    dev = kc.StepPlan.allocate(80, cap, device=0, materialize=True)
    kw_dev = dict(kw)
    if "swa_map" in kw:
        kw_dev["swa_map"] = memory.to_device(kw["swa_map"])
    # poison entries so stale values could not pass as correct
    for name in ("slot", "expected_token", "expected_position", "prev_slot"):
        getattr(dev, name).copy_from_host(np.full(cap, -77, np.int64))
    kc.build_plan(on(True, batch), dev, **kw_dev)
    bs = len(batch["req_pool_indices"])
    assert dev.enable.numpy()[0] == ref.enable[0]
    assert dev.num_valid.numpy()[0] == ref.num_valid[0]
    n = int(ref.num_valid[0]) if ref.enable[0] else 0
    for name in ("slot", "expected_token", "expected_position", "prev_slot"):
        np.testing.assert_array_equal(getattr(dev, name).numpy()[:n], getattr(ref, name)[:n], err_msg=name)
    np.testing.assert_array_equal(dev.offsets.numpy()[:bs + 1], ref.offsets[:bs + 1])
    np.testing.assert_array_equal(dev.seed.numpy()[:bs], ref.seed[:bs])
    assert dev.num_valid_reqs.numpy()[0] == ref.num_valid_reqs[0] == bs
    if cap == 100:
        assert ref.enable[0] == 0


@pytest.mark.parametrize("seed,swa,expected", [(10, False, False), (11, True, True), (12, False, True)])
def test_fused_verify_equals_plan_plus_verify(seed, swa, expected):
    batch, kw = random_batch(seed, swa=swa, expected=expected, num_slots=30000)
    rng = np.random.default_rng(seed)
    canary = rng.integers(0, 256, (30000, 32), dtype=np.uint8)  # random records: many violations
    pool = rng.integers(0, 256, (30000, 64), dtype=np.uint8)

    def run(fused: bool):
        dbatch = on(True, batch)
        kwd = dict(kw)
        if "swa_map" in kw:
            kwd["swa_map"] = memory.to_device(kw["swa_map"])
        sink = kc.ViolationSink.allocate(1 << 17, device=0)
        ctx = kc.VerifyContext(kc.CanaryBuffer(memory.to_device(canary)), sink, abi.LaunchTag.HEAD_V_SWA,
                               [kc.RealKvSource(memory.to_device(pool), 1, 64, 48)], abi.HashMode.ALL)
        plan = kc.StepPlan.allocate(80, 1 << 16, device=0, materialize=not fused)
        kc.build_plan(dbatch, plan, **kwd)
        if fused:
            kc.fused_verify(ctx, dbatch, plan, check_expected_token=True, **kwd)
        else:
            kc.verify(ctx, plan, check_expected_token=True)
        ring, wi = sink.arrays[0].numpy(), int(sink.arrays[1].numpy()[0])
        return sorted(map(tuple, ring[:wi].tolist())), wi, sink.arrays[2].numpy()[0], sink.arrays[3].numpy()[0]

    fused, plain = run(True), run(False)
    assert fused == plain
    assert fused[1] > 100
    # and the reference agrees with both
    host_plan = kc.StepPlan.allocate(80, 1 << 16)
    kc.build_plan(on(False, batch), host_plan, **kw)
    sink = kc.ViolationSink.allocate(1 << 17)
    ctx = kc.VerifyContext(kc.CanaryBuffer(canary.copy()), sink, abi.LaunchTag.HEAD_V_SWA,
                           [kc.RealKvSource(pool, 1, 64, 48)], abi.HashMode.ALL)
    kc.verify(ctx, host_plan, check_expected_token=True)
    wi = int(sink.arrays[1][0])
    assert sorted(map(tuple, sink.arrays[0][:wi].tolist())) == fused[0]


def test_large_batch_16384_requests():
    batch, kw = random_batch(20, bs=16384, rows=2000, max_len=64)
    ref = kc.StepPlan.allocate(16384, 1 << 20)
    kc.build_plan(on(False, batch), ref)
    dev = kc.StepPlan.allocate(16384, 1 << 20, device=0, materialize=True)
    kc.build_plan(on(True, batch), dev)
    n = int(ref.num_valid[0])
    assert n > 100000
    np.testing.assert_array_equal(dev.slot.numpy()[:n], ref.slot[:n])
    np.testing.assert_array_equal(dev.offsets.numpy(), ref.offsets)
