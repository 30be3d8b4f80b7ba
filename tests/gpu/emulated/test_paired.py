"""GPU tier: a paired launch (the K and V halves of a group in one launch, blockIdx.y the half,
docs/format.md §7) leaves each half exactly as its own launch does: buffers, ring rows, write
index and counters, for the write (each half running its chain, or both taking it from a chain
source) and for the fused verify (narrow, many-source and wide folds)."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi, ops
from kvcanary.runtime import memory
from kvcanary.runtime.launch import paired as paired_launch

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]  # no GPU: kernels run in tests/emu

NUM_SLOTS, MAX_LEN, BS = 3000, 160, 24


def batch(rng):
    """A batch over random records: cached prefixes (some past the table: rejected), new tokens
    (some slots out of range), padding rows. New tokens get distinct slots outside the cached ones:
    a launch whose requests stamp each other's seed slots stores an unspecified result (§7), which
    may differ between two launches and one."""
    rtt = rng.integers(1, NUM_SLOTS // 2, (BS + 2, MAX_LEN)).astype(np.int32)
    rpi = np.arange(1, BS + 1, dtype=np.int64)
    rpi[-3:] = 0
    prefix = rng.integers(0, MAX_LEN - 4, BS).astype(np.int64)
    prefix[2] = MAX_LEN + 5
    extend = rng.integers(0, 4, BS).astype(np.int64)
    n = int(extend.sum())
    positions = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix, extend)]).astype(np.int64)
    loc = rng.choice(np.arange(NUM_SLOTS // 2, NUM_SLOTS), n, replace=False).astype(np.int64)
    loc[rng.random(n) < 0.05] = NUM_SLOTS + 7
    ids = rng.integers(0, 1 << 20, n).astype(np.int64)
    return dict(req_pool_indices=rpi, prefix_lens=prefix, extend_lens=extend, req_to_token=rtt,
                input_ids=ids, positions=positions, out_cache_loc=loc)


def context(words, pools, mode, tag, hash_bytes):
    sources = [kc.RealKvSource(memory.to_device(p), 1, p.shape[1], hash_bytes) for p in pools]
    return kc.VerifyContext(kc.CanaryBuffer(memory.to_device(words.view(np.uint8).copy())),
                            kc.ViolationSink.allocate(1 << 14, device=0), tag, sources, mode)


def effects(ctx) -> tuple:
    ring, wi, runs, slots = (a.numpy() for a in ctx.sink.arrays)
    n = min(int(wi[0]), ring.shape[0])
    return ctx.buffer.array.numpy().tobytes(), sorted(map(tuple, ring[:n].tolist())), int(wi[0]), int(runs[0]), int(slots[0])


@pytest.mark.parametrize("mode,nsrc,hash_bytes", [(abi.HashMode.NONE, 0, 0), (abi.HashMode.PARTIAL, 1, 16),
                                                   (abi.HashMode.PARTIAL, 6, 16), (abi.HashMode.ALL, 2, 256)])
@pytest.mark.parametrize("stage", ["HEAD", "TAIL"])
def test_a_paired_launch_equals_the_two_launches(mode, nsrc, hash_bytes, stage):
    rng = np.random.default_rng(nsrc * 7 + hash_bytes + (stage == "TAIL"))
    b = batch(rng)
    words = {h: rng.integers(-(1 << 62), 1 << 62, (NUM_SLOTS, 4)).astype(np.int64) for h in "KV"}
    pools = {h: [rng.integers(0, 256, (NUM_SLOTS, max(hash_bytes, 16)), dtype=np.uint8) for _ in range(nsrc)]
             for h in "KV"}
    tags = {"K": abi.LaunchTag[f"{stage}_K_FULL"], "V": abi.LaunchTag[f"{stage}_V_FULL"]}
    db = kc.Batch(**{k: memory.to_device(v) for k, v in b.items()})
    plan = kc.StepPlan.allocate(BS + 4, 1 << 13, device=0)
    kc.build_plan(db, plan)

    def run(pair: bool):
        ctx = {h: context(words[h], pools[h], mode, tags[h], hash_bytes) for h in "KV"}
        head = None
        if stage == "TAIL":  # both halves take their chain from a HEAD K buffer stamped first
            head = context(words["K"], [], abi.HashMode.NONE, abi.LaunchTag.HEAD_K_FULL, 0)
            kc.write(head, plan, db.input_ids, db.positions, db.out_cache_loc)
        writes = [ops.prepare_write(ctx[h], plan, db.input_ids, db.positions, db.out_cache_loc, chain_from=head)
                  for h in "KV"]
        verifies = [ops.prepare_fused_verify(ctx[h], db, plan, check_expected_token=True) for h in "KV"]
        for launches in (writes, verifies):
            if pair:
                both = paired_launch(*launches)
                assert both is not None and both.grid_y == abi.HALVES and both.name == abi.PAIRED[launches[0].name]
                both()
            else:
                for launch in launches:
                    launch()
        return {h: effects(ctx[h]) for h in "KV"}

    single, paired = run(False), run(True)
    for h in "KV":
        assert paired[h] == single[h], h
    assert single["K"][2] > 0 and single["V"][2] > 0  # both halves report (random records)
    assert single["K"][1] != single["V"][1]  # and each its own rows: a half read as the other would differ


def test_launches_that_cannot_share_one_are_not_paired():
    rng = np.random.default_rng(3)
    db = kc.Batch(**{k: memory.to_device(v) for k, v in batch(rng).items()})
    plan = kc.StepPlan.allocate(BS + 4, 1 << 13, device=0)
    words = rng.integers(0, 1 << 40, (NUM_SLOTS, 4)).astype(np.int64)
    k = context(words, [], abi.HashMode.NONE, abi.LaunchTag.HEAD_K_FULL, 0)
    v = context(words, [], abi.HashMode.NONE, abi.LaunchTag.HEAD_V_FULL, 0)
    write = ops.prepare_write(k, plan, db.input_ids, db.positions, db.out_cache_loc)
    verify = ops.prepare_fused_verify(v, db, plan)
    assert paired_launch(write, verify) is None  # two kernels
    assert paired_launch(ops.prepare_build_plan(db, plan)[0], ops.prepare_build_plan(db, plan)[0]) is None  # no pair
