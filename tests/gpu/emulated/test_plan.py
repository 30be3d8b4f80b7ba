"""GPU tier: plan builder kernels == reference; fused verify == build_plan + verify."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.reference import plan as reference_plan
from kvcanary.reference.canary import RefSource
from kvcanary.runtime import memory
from tests.support.session import host_plan

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]  # no GPU: kernels run in tests/emu


def random_batch(seed, *, bs=64, rows=100, max_len=512, num_slots=30000, swa=False, expected=False):
    rng = np.random.default_rng(seed)
    rtt = rng.integers(1, num_slots, (rows, max_len)).astype(np.int32)
    rtt[rng.random((rows, max_len)) < 0.01] = 0  # some predecessors are the padding slot
    rpi = rng.integers(1, rows, bs).astype(np.int64)
    rpi[-bs // 8:] = 0  # padding rows at the end
    prefix = rng.integers(0, max_len + 20, bs).astype(np.int64)  # some beyond max_len: rejected
    extend = rng.integers(0, 5, bs).astype(np.int64)
    rpi[0], prefix[1], extend[2] = rows + 3, max_len + 7, -2  # always one of each rejected value
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


def sink_rows(sink) -> list[tuple]:
    host = lambda a: a if isinstance(a, np.ndarray) else a.numpy()  # noqa: E731
    ring, wi = host(sink.arrays[0]), int(host(sink.arrays[1])[0])
    return sorted(map(tuple, ring[:wi].tolist()))


@pytest.mark.parametrize("seed,swa,expected,cap", [(0, False, False, 1 << 16), (1, True, False, 1 << 16),
                                                   (2, False, True, 1 << 16), (3, True, True, 1 << 16),
                                                   (4, False, False, 100)])
def test_plan_kernels_equal_reference(seed, swa, expected, cap):
    batch, kw = random_batch(seed, swa=swa, expected=expected)
    ref, ref_rows = host_plan(batch, kw, cap)
    assert ref_rows  # prefixes past max_len are rejected and reported
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
    np.testing.assert_array_equal(dev.entry_offsets.numpy()[:bs + 1], ref.entry_offsets[:bs + 1])
    assert sink_rows(dev.reject_sink) == ref_rows
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
        rows = sink_rows(sink)
        return rows, len(rows), sink.arrays[2].numpy()[0], sink.arrays[3].numpy()[0], sink_rows(plan.reject_sink)

    fused, plain = run(True), run(False)
    assert fused == plain
    assert fused[1] > 100
    # and the reference agrees with both: the plan path and the fused path of the reference
    ref, ref_rejects = host_plan(batch, kw, 1 << 16)
    assert ref_rejects == fused[4]
    sink = kc.ViolationSink.allocate(1 << 17)
    ctx = kc.VerifyContext(kc.CanaryBuffer(canary.copy()), sink, abi.LaunchTag.HEAD_V_SWA,
                           [kc.RealKvSource(pool, 1, 64, 48)], abi.HashMode.ALL)
    kc.verify(ctx, ref, check_expected_token=True)
    assert sink_rows(sink) == fused[0]
    q = reference_plan.requests(batch["req_pool_indices"], batch["prefix_lens"], batch["extend_lens"],
                                batch["req_to_token"].shape, kw.get("swa_window", 0))
    rows, active, skipped = reference_plan.fused_verify_rows(
        canary=canary, q=q, entry_offsets=ref.entry_offsets, num_valid=ref.num_valid, enable=ref.enable,
        capacity=1 << 16, req_to_token=batch["req_to_token"], sources=[RefSource(pool, 1, 64, 48)],
        tag=int(abi.LaunchTag.HEAD_V_SWA), check_expected_token=True, swa_map=kw.get("swa_map"),
        expected_pool=batch.get("expected_pool"), expected_valid_lens=batch.get("expected_valid_lens"),
        expected_token_offset=batch.get("expected_token_offset", 0))
    assert sorted(map(tuple, rows.tolist())) == fused[0] and skipped == 0 and active == fused[3]


def test_large_batch_16384_requests():
    batch, kw = random_batch(20, bs=16384, rows=2000, max_len=64)
    ref, _ = host_plan(batch, kw, 1 << 20, max_batch=16384)
    dev = kc.StepPlan.allocate(16384, 1 << 20, device=0, materialize=True)
    kc.build_plan(on(True, batch), dev)
    n = int(ref.num_valid[0])
    assert n > 100000
    np.testing.assert_array_equal(dev.slot.numpy()[:n], ref.slot[:n])
    np.testing.assert_array_equal(dev.offsets.numpy(), ref.offsets)


# ---- the warp-tiled verify kernels on clean, stamped engine state -------------------------------
def stamped_pools(rng, rtt, lens, num_slots: int, sources: list, stride: int, mode):
    """Random real-KV pools per ``sources`` ((page_size, bytes_per_token, read_bytes) each) and a
    canary buffer of ``stride`` bytes per slot in which the reference write stamped request r's
    ``lens[r]`` tokens (row r + 1 of ``rtt``), all new. Returns (canary, pools, srcs), ``srcs``
    making the sources over given pool arrays."""
    pools = [rng.integers(0, 256, (-(-num_slots // page), page * bpt), dtype=np.uint8) for page, bpt, _ in sources]
    srcs = lambda ps: [kc.RealKvSource(p, page, bpt, rb) for p, (page, bpt, rb) in zip(ps, sources)]  # noqa: E731
    canary = np.zeros((num_slots, stride), np.uint8)
    sink = kc.ViolationSink.allocate(1 << 16)
    ctx = kc.VerifyContext(kc.CanaryBuffer(canary), sink, abi.LaunchTag.TAIL_K_FULL, srcs(pools), mode)
    bs = len(lens)
    loc = np.concatenate([rtt[r + 1, :lens[r]] for r in range(bs)]).astype(np.int64)
    stamp = kc.Batch(req_pool_indices=np.arange(1, bs + 1, dtype=np.int64), prefix_lens=np.zeros(bs, np.int64),
                     extend_lens=lens, req_to_token=rtt, input_ids=rng.integers(0, 1 << 40, len(loc)).astype(np.int64),
                     positions=np.concatenate([np.arange(n) for n in lens]).astype(np.int64), out_cache_loc=loc)
    plan = kc.StepPlan.allocate(bs, 1)
    kc.build_plan(stamp, plan)
    kc.write(ctx, plan, stamp.input_ids, stamp.positions, stamp.out_cache_loc)
    assert int(sink.arrays[1][0]) == 0, "the stamping write must be clean"
    return canary, pools, srcs


def stamped_engine(seed, *, mode, stride, sources, swa, bs=300, lengths=(0, 0, 1, 2, 3, 33, 200, 700)):
    """A host engine state stamped by the reference write: ``bs`` requests of very uneven length
    (many empty or 1-3 tokens, so warp tiles span many requests), real-KV pools per ``sources``
    ((page_size, bytes_per_token, read_bytes) each), a canary buffer of ``stride`` bytes per slot,
    then a few corrupted records, KV bytes and req_to_token entries. Returns the host arrays and
    the verify batch (padding rows interleaved, prefixes at or below the stamped lengths)."""
    rng = np.random.default_rng(seed)
    lens = rng.choice(lengths, bs).astype(np.int64)
    lens[rng.choice(bs, 2, replace=False)] = max(lengths)  # two long requests to corrupt below
    max_len, num_slots = 720, int(lens.sum()) + 64
    rtt = np.zeros((bs + 1, max_len), np.int32)
    free = rng.permutation(np.arange(1, num_slots))
    at = 0
    for r in range(bs):
        rtt[r + 1, :lens[r]] = free[at:at + lens[r]]
        at += lens[r]
    canary, pools, srcs = stamped_pools(rng, rtt, lens, num_slots, sources, stride, mode)
    rpi = np.arange(1, bs + 1, dtype=np.int64)
    prefix = np.where(rng.random(bs) < 0.5, lens, np.minimum(lens, rng.integers(0, max_len, bs))).astype(np.int64)
    read = [r for r in range(bs) if prefix[r] > 0]
    for r in rng.choice(read, min(6, len(read)), replace=False):  # corrupt token, position, chain or fingerprint of a read slot
        slot = rtt[r + 1, prefix[r] - 1 - int(rng.integers(0, min(4, prefix[r])))]
        canary[slot, int(rng.integers(0, 32))] ^= 1 << int(rng.integers(0, 8))
    for p in pools:
        for _ in range(4):
            p[int(rng.integers(0, p.shape[0])), int(rng.integers(0, p.shape[1]))] ^= 0x40
    long = [r for r in range(bs) if prefix[r] > 100]
    rtt[long[0] + 1, prefix[long[0]] - 20] = num_slots + 3   # out of range (and a predecessor)
    rtt[long[1] + 1, prefix[long[1]] - 30] = 0               # the padding slot: reported, and as a predecessor
    rpi_v = rpi.copy()
    rpi_v[rng.random(bs) < 0.05] = 0       # padding rows anywhere: no verify entries (and reported)
    batch = dict(req_pool_indices=rpi_v, prefix_lens=prefix, extend_lens=np.ones(bs, np.int64), req_to_token=rtt)
    kw = dict(swa_window=int(rng.integers(100, 400)), swa_map=np.arange(num_slots + 7, dtype=np.int64)) if swa else {}
    return canary, pools, srcs, batch, kw


@pytest.mark.parametrize("seed,mode,stride,sources,swa", [
    (30, abi.HashMode.NONE, 32, [], False),
    (31, abi.HashMode.PARTIAL, 40, [(16, 64, 64)], True),
    (32, abi.HashMode.ALL, 32, [(1, 1024, 1024)], False),                  # the wide kernels
    (33, abi.HashMode.ALL, 40, [(16, 208, 208), (1, 48, 48)], True),       # wide, odd strips
    (34, abi.HashMode.ALL, 32, [(4, 48, 48)], False),                      # narrow ALL
    (35, abi.HashMode.PARTIAL, 32, [(1, 64, 64)] * 6 + [(16, 32, 32)] * 3, True),  # the *_many kernels
])
def test_tiled_verify_kernels_equal_reference_on_stamped_state(seed, mode, stride, sources, swa, engine=None):
    canary, pools, srcs, batch, kw = engine or stamped_engine(seed, mode=mode, stride=stride, sources=sources, swa=swa)
    bs = len(batch["req_pool_indices"])

    def host_run():
        sink = kc.ViolationSink.allocate(1 << 16)
        ctx = kc.VerifyContext(kc.CanaryBuffer(canary.copy()), sink, abi.LaunchTag.HEAD_K_FULL,
                               srcs([p.copy() for p in pools]), mode)
        plan, _ = host_plan(batch, kw, 1 << 17, max_batch=bs)  # padding rows anywhere: rejected on the host
        kc.verify(ctx, plan)
        return sink

    def gpu_run(fused):
        sink = kc.ViolationSink.allocate(1 << 16, device=0)
        ctx = kc.VerifyContext(kc.CanaryBuffer(memory.to_device(canary)), sink, abi.LaunchTag.HEAD_K_FULL,
                               srcs([memory.to_device(p) for p in pools]), mode)
        plan = kc.StepPlan.allocate(bs, 1 << 17, device=0, materialize=not fused)
        kwd = dict(kw, swa_map=memory.to_device(kw["swa_map"])) if swa else {}
        dbatch = on(True, batch)
        kc.build_plan(dbatch, plan, **kwd)
        if fused:
            kc.fused_verify(ctx, dbatch, plan, **kwd)
        else:
            kc.verify(ctx, plan)
        return sink

    def effects(sink):
        arrays = [a if isinstance(a, np.ndarray) else a.numpy() for a in sink.arrays]
        wi = int(arrays[1][0])
        return sorted(map(tuple, arrays[0][:wi].tolist())), wi, int(arrays[2][0]), int(arrays[3][0])

    want = effects(host_run())
    assert 0 < want[1] < 200, "a mostly clean state with a few corruptions"
    assert want[3] > (5000 if engine is None else 100), "enough verified entries to span several tiles"
    assert effects(gpu_run(fused=True)) == want
    assert effects(gpu_run(fused=False)) == want


@pytest.mark.parametrize("bs", [2, 32, 33, 95, 1024, 1025])
@pytest.mark.parametrize("swa", [False, True])
def test_verify_at_batch_edges(bs, swa):
    """Block tiles over many short and a few long requests: tiles that start and end mid-request,
    requests of 0..3 entries inside one tile, SWA windows that start mid-tile, batch sizes around
    warp and block multiples."""
    engine = stamped_engine(40 + bs, mode=abi.HashMode.PARTIAL, stride=32, sources=[(16, 64, 64)], swa=swa,
                            bs=bs, lengths=(0, 1, 2, 3, 7, 8, 9, 15, 17, 40, 130, 260))
    test_tiled_verify_kernels_equal_reference_on_stamped_state(None, abi.HashMode.PARTIAL, 32, [(16, 64, 64)],
                                                               swa, engine=engine)


def spread_tiles(active: int, sources: int, grid: int) -> int:
    """How a block of the fused *_many verify takes a step (verify.cu, written from the kernel's
    comment): the fewest tiles a block spreads its warps over, 1, 2 or 4, that cover the step's
    warp tiles in one round of the grid with tiles x sources strip folds fitting the stage; 0: a
    warp per tile."""
    tiles = -(-active // (32 * abi.VERIFY_LANE_ENTRIES - 1))
    for t in (1, 2, 4):
        if t * sources <= abi.MANY_SPREAD_STRIPS and tiles <= t * grid:
            return t
    return 0


def many_source_state(seed, requests: int, length: int, sources: list):
    """``requests`` requests of ``length`` cached tokens on random slots, stamped by the reference
    write over ``sources``, then a few record bits and KV bytes of read slots flipped."""
    rng = np.random.default_rng(seed)
    num_slots = requests * length + 64
    rtt = np.zeros((requests + 1, length), np.int32)
    rtt[1:] = rng.permutation(np.arange(1, num_slots))[:requests * length].reshape(requests, length)
    rpi, lens = np.arange(1, requests + 1, dtype=np.int64), np.full(requests, length, np.int64)
    canary, pools, srcs = stamped_pools(rng, rtt, lens, num_slots, sources, 32, abi.HashMode.PARTIAL)
    read = rtt[1:].reshape(-1)
    for slot in rng.choice(read, 5, replace=False):  # a record bit (token, position, chain or fingerprint)
        canary[slot, int(rng.integers(0, 32))] ^= 1 << int(rng.integers(0, 8))
    for slot in rng.choice(read, 3, replace=False):  # a byte of a source's strip (the first 16 bytes are read)
        k = int(rng.integers(0, len(sources)))
        page, bpt, _ = sources[k]
        pools[k][slot // page, (slot % page) * bpt + int(rng.integers(0, 16))] ^= 0x40
    batch = dict(req_pool_indices=rpi, prefix_lens=lens, extend_lens=np.ones(requests, np.int64), req_to_token=rtt)
    return canary, pools, srcs, batch, {}


EIGHT = [(1, 64, 16)] * 6 + [(16, 32, 32)] * 2  # PARTIAL reads 16 bytes of each


@pytest.mark.parametrize("sources,tiles,spread", [
    (EIGHT, lambda g: g, 1),              # one tile per block, its sources over all 8 warps
    (EIGHT, lambda g: 2 * g, 2),          # two tiles per block, 4 warps each
    (EIGHT, lambda g: 4 * g, 4),          # four tiles per block, 2 warps each
    (EIGHT, lambda g: 4 * g + 1, 0),      # more tiles than 4 per block: a warp per tile
    ([(1, 48, 16)] * 40, lambda g: g + 1, 0),  # 40 sources: two tiles' folds do not fit the stage
    ([(1, 48, 16)] * 40, lambda g: g, 1),
])
def test_many_source_fused_verify_spread_over_a_block_equals_reference(emulated_device, sources, tiles, spread):
    """The fused *_many verify at every spread of a block (chosen on the device from the step's
    entry count and the grid): byte-equal to the reference, at the tile counts where the choice
    changes. The grid is the launch's (the emulator runs at most tests.emu.MAX_BLOCKS blocks)."""
    from kvcanary.ops import bind as prepare
    from kvcanary.runtime import devices
    _, grid, _ = prepare._verify_shape(devices.runtime(0), "kvc_fused_verify", 1 << 17, (16,) * len(sources))
    if emulated_device is not None:
        from tests import emu
        grid = min(grid, emu.MAX_BLOCKS)
    n = tiles(grid)
    assert spread_tiles(n * 63, len(sources), grid) == spread, "the case takes the spread it names"
    engine = many_source_state(50 + n, n, 32 * abi.VERIFY_LANE_ENTRIES - 1, sources)
    test_tiled_verify_kernels_equal_reference_on_stamped_state(None, abi.HashMode.PARTIAL, 32, sources, False,
                                                               engine=engine)


def test_fused_verify_on_the_benchmark_shape():
    """Decode bs 256 x 4096 (1M entries) with a decoding allocator's slots (slot(r, p) = 1 + p * bs
    + r, perf/workloads.py's default), PARTIAL, a few flipped record bits and one KV byte: the
    fused verify reports exactly what the reference does."""
    bs, n = 256, 4096
    rng = np.random.default_rng(5)
    num_slots = bs * n + 1
    slots = (1 + np.arange(n)[None, :] * bs + np.arange(bs)[:, None]).astype(np.int32)
    rtt = np.zeros((bs + 1, n + 1), np.int32)
    rtt[1:, :n] = slots
    rpi = np.arange(1, bs + 1, dtype=np.int64)
    pool = rng.integers(0, 256, (num_slots, 64), dtype=np.uint8)
    canary = np.zeros((num_slots, 32), np.uint8)
    stamp_ctx = kc.VerifyContext(kc.CanaryBuffer(canary), kc.ViolationSink.allocate(16), abi.LaunchTag.TAIL_K_FULL,
                                 [kc.RealKvSource(pool, 1, 64, 64)], abi.HashMode.PARTIAL)
    stamp = kc.Batch(req_pool_indices=rpi, prefix_lens=np.zeros(bs, np.int64), extend_lens=np.full(bs, n, np.int64),
                     req_to_token=rtt, input_ids=rng.integers(0, 1 << 40, bs * n).astype(np.int64),
                     positions=np.tile(np.arange(n), bs).astype(np.int64),
                     out_cache_loc=slots.reshape(-1).astype(np.int64))
    plan = kc.StepPlan.allocate(bs, 1)
    kc.build_plan(stamp, plan)
    kc.write(stamp_ctx, plan, stamp.input_ids, stamp.positions, stamp.out_cache_loc)
    for s in rng.choice(np.arange(1, num_slots), 5, replace=False):
        canary[s, int(rng.integers(0, 32))] ^= 4
    pool[int(rng.integers(1, num_slots)), 3] ^= 1
    batch = dict(req_pool_indices=rpi, prefix_lens=np.full(bs, n, np.int64), extend_lens=np.ones(bs, np.int64),
                 req_to_token=rtt)

    def run(dev):
        put = memory.to_device if dev else np.copy
        sink = kc.ViolationSink.allocate(1 << 12, device=0 if dev else None)
        ctx = kc.VerifyContext(kc.CanaryBuffer(put(canary)), sink, abi.LaunchTag.HEAD_K_FULL,
                               [kc.RealKvSource(put(pool), 1, 64, 16)], abi.HashMode.PARTIAL)
        plan = kc.StepPlan.allocate(bs, 1 << 21, device=0 if dev else None)
        b = on(dev, batch)
        kc.build_plan(b, plan)
        (kc.fused_verify if dev else lambda c, b, p: kc.verify(c, p))(ctx, b, plan)
        arrays = [a if isinstance(a, np.ndarray) else a.numpy() for a in sink.arrays]
        wi = int(arrays[1][0])
        return sorted(map(tuple, arrays[0][:wi].tolist())), wi, int(arrays[2][0]), int(arrays[3][0])

    want = run(False)
    assert 6 <= want[1] <= 12 and want[3] == bs * n
    assert run(True) == want
