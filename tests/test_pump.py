"""The asynchronous pump without a GPU: the host side of the snapshot FIFO over host numpy, then
the manager's device path against tests/support/fake_cuda.py (launches queued per stream, ``kvc_snapshot``
emulated from its params struct): one snapshot launch per step after the step's launches, FIFO
order, skip-when-full, attribution to the right step, drain, graph capture, the cached launches."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.reporting.pump import DEPTH, SnapshotFifo
from tests.support import fake_cuda


def device_write(fifo: SnapshotFifo, slot: int, values) -> None:
    """What kvc_snapshot does: the payload, then the completion word."""
    fifo.payload[slot] = values
    fifo.words[slot] = fifo.tickets[slot]


def make_fifo(n: int = 5, depth: int = 4) -> SnapshotFifo:
    return SnapshotFifo(np.zeros((depth, n), np.int64), np.zeros(depth, np.int64))


def test_fifo_takes_only_completed_snapshots_oldest_first():
    fifo = make_fifo()
    a, b, c = fifo.claim("a"), fifo.claim("b"), fifo.claim("c")
    assert len({a, b, c}) == 3 and fifo.tickets[a] < fifo.tickets[b] < fifo.tickets[c]
    assert fifo.completed() == []
    device_write(fifo, b, [2] * 5)          # b done before a: not taken yet
    assert fifo.completed() == [] and fifo.in_flight == 3
    device_write(fifo, a, [1] * 5)
    assert fifo.completed() == [([1] * 5, "a"), ([2] * 5, "b")]
    device_write(fifo, c, [3] * 5)
    assert fifo.completed() == [([3] * 5, "c")] and fifo.in_flight == 0


def test_fifo_skips_when_full_and_recovers():
    fifo = make_fifo(depth=4)
    slots = [fifo.claim(i) for i in range(4)]
    assert fifo.claim(4) == -1 and fifo.claim(5) == -1 and fifo.skipped == 2
    for k, slot in enumerate(slots):
        device_write(fifo, slot, [k] * 5)
    assert [m for _, m in fifo.completed()] == [0, 1, 2, 3]
    assert fifo.claim(6) >= 0 and fifo.skipped == 2


def test_fifo_clears_the_word_and_ignores_a_stale_one():
    fifo = make_fifo(depth=2)
    slot = fifo.claim("old")
    device_write(fifo, slot, [7] * 5)
    assert fifo.completed() == [([7] * 5, "old")]
    assert fifo.words[slot] != 0
    again = [fifo.claim("x"), fifo.claim("y")]
    assert slot in again and fifo.words[slot] == 0  # cleared before its launch is enqueued
    fifo.words[slot] = fifo.tickets[slot] - 1       # an older ticket is not completion
    assert fifo.completed() == []


def test_fifo_snapshot_is_a_copy_and_unclaim_returns_the_slot():
    fifo = make_fifo(depth=2)
    slot = fifo.claim("m")
    device_write(fifo, slot, [5] * 5)
    (snap, _), = fifo.completed()
    fifo.payload[slot] = 0
    assert snap == [5] * 5
    s2 = fifo.claim("n")
    fifo.unclaim(s2)
    assert fifo.in_flight == 0 and len(fifo.free) == 2


# ---- the manager's device path on the fake driver ------------------------------------------------
@pytest.fixture
def fake(monkeypatch):
    f = fake_cuda.install(monkeypatch)
    yield f
    fake_cuda.release(f)


def make_canary(**kw):
    from kvcanary.manager.canary import KvCanary, PoolGroup
    from kvcanary.runtime import memory
    records = []
    canary = KvCanary(PoolGroup(64, halves=("K",)), device=0, hash_mode="none", max_batch=2,
                      verify_capacity=256, export=records.append, **kw)
    D = memory.to_device
    batch = kc.Batch(D(np.array([1], np.int64)), D(np.array([3], np.int64)), D(np.array([1], np.int64)),
                     D(np.zeros((2, 8), np.int32)), D(np.array([7], np.int64)), D(np.array([3], np.int64)),
                     D(np.array([9], np.int64)))
    return canary, batch, records


def stream(fake) -> int:
    return fake.cuStreamCreate(0)[1]


def step(canary, batch, s):
    canary.before_forward(batch, stream=s)
    canary.after_forward(batch, stream=s)


def record_violation(canary, row: int, slot: int) -> None:
    """Write a ring row and bump the write index in fake device memory, as a kernel would."""
    wi = ctypes.c_int32.from_address(canary.status.ptr)
    ring = np.ctypeslib.as_array((ctypes.c_int64 * (canary.ring_capacity * abi.RING_COLS)).from_address(
        canary._ring.ptr)).reshape(-1, abi.RING_COLS)
    ring[row] = [int(abi.LaunchTag.TAIL_K_FULL), slot, 3, 7, 7, 0, 0, int(abi.FailReason.VERIFY_CHAIN_HASH_MISMATCH)]
    wi.value = row + 1


def test_the_steps_last_launch_takes_the_snapshot_and_no_other_driver_call(fake):
    """An eager step launches no kvc_snapshot: TAIL's last verify carries the claimed FIFO slot's
    snapshot params (its last block copies the status: kvc_step_end)."""
    canary, batch, _ = make_canary()
    s = stream(fake)
    step(canary, batch, s)
    fake.launched.clear()
    fake.calls.clear()
    n0 = canary.launch_count
    step(canary, batch, s)
    assert fake.launched == ["kvc_prepare", "kvc_write", "kvc_fused_verify", "kvc_write",
                             "kvc_fused_verify"]  # each stage stamps, then verifies
    assert canary.launch_count - n0 == canary.launches_per_step() == 5
    assert dict(fake.calls) == {"cuStreamIsCapturing": 2}        # no event query, no copy
    slot = canary.pump.fifo.queue[-1]
    last, head = (abi.FusedVerifyParams.from_buffer_copy(e[-1]) for e in (fake.pending[s][-1], fake.pending[s][2]))
    assert head.snap[0].done == 0  # only the step's last launch takes one
    p = last.snap[0]
    assert p.status == canary.status.ptr and p.n == canary.status.shape[0]
    assert p.payload == canary.pump.pinned.device_ptr + 8 * p.n * slot
    assert p.done == canary.pump.done.device_ptr + 8 * slot and p.ticket == canary.pump.fifo.tickets[slot]
    assert p.arrive == canary.pump.arrive.ptr + 8 * slot
    fake.run()
    canary.flush()
    assert canary.step == 2 and canary.pump.launches == 1  # flush's own snapshot only


@pytest.mark.parametrize("fused", [True, False])
def test_a_k_and_v_group_steps_in_paired_launches(fake, fused):
    """The K and V halves share each write and each fused verify launch (docs/format.md §7): a
    step of a K + V group is 6 launches, not 10; HEAD V takes no chain source (the same launch
    stamps HEAD K), TAIL's halves take HEAD K's."""
    from kvcanary.manager.canary import KvCanary, PoolGroup
    _, batch, _ = make_canary()
    canary = KvCanary(PoolGroup(64), device=0, hash_mode="none", max_batch=2, verify_capacity=256, fused=fused)
    s = stream(fake)
    step(canary, batch, s)
    fake.launched.clear()
    step(canary, batch, s)
    verify = ["kvc_fused_verify_pair"] if fused else ["kvc_verify", "kvc_verify"]  # no plan verify pair
    head = ["kvc_prepare", "kvc_write_pair", *verify] if fused else ["kvc_prepare", "kvc_expand", "kvc_write_pair", *verify]
    assert fake.launched == [*head, "kvc_write_pair", *verify]
    assert canary.launches_per_step() == len(fake.launched)
    writes = [(abi.PrepareWritePair if name.startswith("kvc_prepare_write") else abi.WritePair).from_buffer_copy(q)
              for name, _, _, _, q in fake.pending[s] if name in ("kvc_write_pair", "kvc_prepare_write_pair_warps")]
    head_k = canary.ctx[("HEAD", "FULL", "K", "write")].buffer.array.ptr
    assert [[h.chain_source for h in w.half] for w in writes[-2:]] == [[0, 0], [head_k, head_k]]
    assert [[h.tag for h in w.half] for w in writes[-2:]] == [
        [int(abi.LaunchTag.HEAD_K_FULL), int(abi.LaunchTag.HEAD_V_FULL)],
        [int(abi.LaunchTag.TAIL_K_FULL), int(abi.LaunchTag.TAIL_V_FULL)]]
    fake.run()
    canary.flush()
    canary.health_check()  # each half counted its own run


def test_snapshots_are_taken_in_order_and_skipped_when_the_device_lags(fake):
    canary, batch, _ = make_canary()
    s = stream(fake)
    for _ in range(DEPTH + 3):  # the device runs nothing: the FIFO fills, then snapshots are skipped
        step(canary, batch, s)
    assert canary.pump.skipped == 3 and canary.pump.folded == DEPTH and canary.monitor.last is None
    assert canary.pump.launches == 0  # each step's last launch took its snapshot
    fake.run()
    step(canary, batch, s)  # takes the DEPTH finished snapshots, oldest first
    assert canary.monitor.last[1][0] == DEPTH - 1
    assert canary.stats()["step"] == DEPTH + 4
    canary.flush()
    canary.health_check()


def test_a_violation_is_reported_in_the_step_whose_snapshot_first_shows_it(fake):
    canary, batch, records = make_canary()
    s = stream(fake)
    step(canary, batch, s)             # step 0
    fake.run()
    record_violation(canary, 0, 11)    # the device records during step 1
    step(canary, batch, s)             # step 1: reports step 0 (clean), snapshots step 1
    assert [r for r in records if r["type"] == "violation"] == []
    fake.run()
    step(canary, batch, s)             # step 2: takes step 1's snapshot
    (v,) = [r for r in records if r["type"] == "violation"]
    assert (v["step"], v["slot_idx"], v["launch_tag"]) == (1, 11, "TAIL_K_FULL")
    record_violation(canary, 1, 12)
    canary.flush()                     # drain synchronises and reports the rest
    assert fake.calls["cuCtxSynchronize"] >= 1
    assert [r["slot_idx"] for r in records if r["type"] == "violation"] == [11, 12]


def test_capture_launches_stages_but_no_snapshot_and_counts_nothing(fake):
    canary, batch, _ = make_canary()
    s = stream(fake)
    step(canary, batch, s)
    fake.run()
    n_snap, n_fold, step_no = canary.pump.launches, canary.pump.folded, canary.step
    fake.capturing.add(s)
    fake.launched.clear()
    step(canary, batch, s)
    assert "kvc_snapshot" not in fake.launched and len(fake.launched) == 5
    assert canary.pump.launches == n_snap and canary.pump.folded == n_fold and canary.step == step_no
    last = abi.FusedVerifyParams.from_buffer_copy(fake.captured[-1][-1])
    assert last.snap[0].done == 0  # a replayed graph writes no ticket: poll() snapshots after it
    canary.poll(s)                     # a poll during capture does nothing either
    assert canary.pump.launches == n_snap and canary.step == step_no
    fake.capturing.clear()
    for _ in range(3):                 # "replays": the captured stages run, the host says so
        step(canary, batch, s)
    fake.run()
    canary.flush()
    canary.health_check()              # the capture itself was not counted


def test_arrays_collected_during_a_capture_are_freed_after_it(fake):
    """Python collects garbage anywhere, also while an engine captures a CUDA graph: a kvcanary
    array (and a pinned buffer) dropped then must not call cuMemFree / cuMemFreeHost (CUDA refuses
    them and invalidates the engine's capture). Their frees run after the next allocation, and
    at flush, once no capture is running."""
    import gc

    from kvcanary.runtime import memory
    canary, batch, _ = make_canary()
    s = stream(fake)
    step(canary, batch, s)
    old_batch, held = batch, len(fake.memory)
    _, batch, _ = make_canary()  # another canary's arrays and two buffers, dropped during the capture
    dropped = [memory.zeros((16,), np.int64, 0), memory.PinnedBuffer((8,), np.int64, 0)]
    fake.capturing.add(s)
    step(canary, old_batch, s)
    del batch, dropped
    gc.collect()
    assert fake.unsafe_calls == [] and fake.invalidated == set(), "no free while a stream captures"
    fake.capturing.clear()
    canary.flush()
    assert fake.unsafe_calls == [] and len(fake.memory) == held, "flush frees what was collected"
    x = memory.zeros((4,), np.int64, 0)
    del x
    gc.collect()
    assert len(fake.memory) == held + 1, "a collected array waits for the next free point"
    memory.zeros((4,), np.int64, 0)
    assert len(fake.memory) == held + 1, "the next allocation frees it (the new one is held here)"


def test_health_check_sees_a_launch_that_never_ran(fake):
    canary, batch, _ = make_canary()
    s = stream(fake)
    step(canary, batch, s)
    fake.pending[s] = [e for e in fake.pending[s] if e[0] != "kvc_write"]  # lost on the device
    step(canary, batch, s)
    canary.flush()
    with pytest.raises(kc.KvCanaryError, match="TAIL_K_FULL write: ran 1 of 2"):
        canary.health_check()


class SameMemory:
    """Another object over the same device memory (a fresh engine tensor at a reused address)."""

    def __init__(self, array):
        self.__cuda_array_interface__ = dict(array.__cuda_array_interface__)


def test_launches_are_repacked_only_when_a_batch_layout_changes(fake):
    """New arrays of the same layout (an engine's fresh tensors every step) replay the packed
    launches with their addresses patched in; another shape, dtype, scalar or aliasing repacks."""
    from kvcanary.runtime import memory
    canary, batch, _ = make_canary()
    s = stream(fake)
    step(canary, batch, s)
    (packed,) = canary.stages.packed["HEAD"].values()
    step(canary, kc.Batch(**batch.__dict__), s)      # another Batch of the same arrays
    fresh = kc.Batch(**{k: SameMemory(v) if hasattr(v, "__cuda_array_interface__") else v
                        for k, v in batch.__dict__.items()})
    step(canary, fresh, s)                           # new objects, same addresses and layouts
    batch.out_cache_loc = memory.to_device(np.array([10], np.int64))  # same layout, another address
    step(canary, batch, s)
    assert list(canary.stages.packed["HEAD"].values()) == [packed]
    write = packed.launches[1]
    assert write.name == "kvc_write" and write.params.out_cache_loc == batch.out_cache_loc.ptr
    prepare = packed.launches[0]
    assert prepare.name == "kvc_prepare" and prepare.params.out_cache_loc == batch.out_cache_loc.ptr
    fake.run()
    assert canary.stats()["violations"] == 0
    batch.out_cache_loc = memory.to_device(np.array([10, -1], np.int64))  # another shape
    batch.input_ids = batch.positions = memory.to_device(np.array([7, 0], np.int64))  # aliased
    step(canary, batch, s)
    assert len(canary.stages.packed["HEAD"]) == 2
    batch.expected_token_offset = 1                  # a scalar field counts too
    step(canary, batch, s)
    assert len(canary.stages.packed["HEAD"]) == 3
    canary.stages.packed["HEAD"].kept = 8            # at most LAYOUTS_KEPT layouts are kept per stage
    for k in range(2, 2 + 8):
        batch.out_cache_loc = memory.to_device(np.array([10] + [-1] * k, np.int64))
        batch.input_ids = batch.positions = memory.to_device(np.zeros(k + 1, np.int64))
        step(canary, batch, s)
    assert len(canary.stages.packed["HEAD"]) == 8
    for entry in canary.stages.packed["HEAD"].values():    # a cached launch never keeps the batch alive
        assert all(not any(x is batch.out_cache_loc for x in launch.keep) for launch in entry.launches)


@pytest.mark.parametrize("hash_mode,read_bytes,tail_verify,block", [
    ("partial", 1024, "kvc_fused_verify", 256),       # 16 fingerprinted bytes: one lane per entry
    ("all", 48, "kvc_fused_verify", 256),             # short strips: still per lane
    ("all", 1024, "kvc_fused_verify_wide", 128),      # >= 64 bytes: warp-cooperative fetch
])
def test_verify_kernel_follows_the_fingerprinted_bytes(fake, hash_mode, read_bytes, tail_verify, block):
    from kvcanary.manager.canary import KvCanary, PoolGroup
    from kvcanary.runtime import memory
    pool = memory.zeros((64, 1024), np.uint8)
    canary = KvCanary(PoolGroup(64, k_sources=[kc.RealKvSource(pool, 1, 1024, read_bytes)], halves=("K",)),
                      device=0, hash_mode=hash_mode, max_batch=2, verify_capacity=4096)
    _, batch, _ = make_canary()
    step(canary, batch, stream(fake))
    verifies = [(fn, grid, bx) for fn, grid, bx in fake.shapes if "verify" in fn]
    assert [v[0] for v in verifies] == ["kvc_fused_verify", tail_verify]  # HEAD never fingerprints
    assert verifies[0][2] == 256 and verifies[1][2] == block
    from kvcanary.runtime import devices
    rt = devices.runtime(0)
    for (fn, grid, bx), hashed in zip(verifies, (False, True)):  # one resident wave, no block without a tile
        lanes = 1 if fn.endswith("_wide") else abi.HASHED_LANE_ENTRIES if hashed else abi.VERIFY_LANE_ENTRIES
        tile = (32 * lanes - 1) * (bx // 32)  # a block's warp tiles
        assert grid == min(rt.sm_count * (2048 // bx), -(-4096 // tile))  # fake occupancy: 2048 threads


@pytest.mark.parametrize("capacity,wide", [(1, False), (1000, False), (1 << 20, False), (1 << 20, True)])
def test_verify_grid_is_one_resident_wave_at_most(fake, capacity, wide):
    """The kernel follows the fingerprinted bytes only (no layout guessed from the batch size);
    the grid is the driver's occupancy x SMs, never more blocks than the plan has tiles."""
    from kvcanary.ops import bind as prepare
    from kvcanary.runtime import devices
    rt = devices.runtime(0)
    for hash_bytes in (((16, 1024),) if wide else ((16,), ())):
        for base in ("kvc_verify", "kvc_fused_verify"):
            name, grid, block = prepare._verify_shape(rt, base, capacity, hash_bytes)
            assert name == (f"{base}_wide" if wide else base) and block == (128 if wide else 256)
            # a warp tile: 32 entries a lane deep, one of them its predecessor's (1 deep when wide,
            # HASHED_LANE_ENTRIES when the narrow kernel fingerprints, VERIFY_LANE_ENTRIES when not)
            lanes = 1 if wide else abi.HASHED_LANE_ENTRIES if hash_bytes else abi.VERIFY_LANE_ENTRIES
            tile = (32 * lanes - 1) * (block // 32)
            assert grid == min(rt.sm_count * (2048 // block), -(-capacity // tile))  # fake occupancy: 2048 threads


def test_a_batch_size_that_cycles_through_many_values_is_packed_once_per_size(fake, monkeypatch):
    """An engine's decode batch size takes many values in turn (requests finish and join): each
    layout is validated and packed once, not again every time it comes back (up to LAYOUTS_KEPT)."""
    from kvcanary.manager import stages
    from kvcanary.manager.canary import KvCanary, PoolGroup
    from kvcanary.runtime import memory
    canary = KvCanary(PoolGroup(64, halves=("K",)), device=0, hash_mode="none", max_batch=40, verify_capacity=256)
    packs = []
    real_pack = stages.StageLaunches.pack
    monkeypatch.setattr(stages.StageLaunches, "pack", lambda self, *a: packs.append(1) or real_pack(self, *a))
    D, s = memory.to_device, stream(fake)
    sizes = list(range(1, 41))  # 40 batch sizes
    batches = {n: kc.Batch(D(np.arange(1, n + 1, dtype=np.int64)), D(np.full(n, 3, np.int64)),
                           D(np.ones(n, np.int64)), D(np.zeros((n + 1, 8), np.int32)), D(np.full(n, 7, np.int64)),
                           D(np.full(n, 3, np.int64)), D(np.arange(9, 9 + n, dtype=np.int64))) for n in sizes}
    for _ in range(2):
        for n in sizes:
            step(canary, batches[n], s)
    assert len(packs) == 2 * len(sizes) and 40 <= stages.LAYOUTS_KEPT  # each stage packs each size once
    fake.run()


def test_replayed_counts_a_whole_captured_step_and_snapshots_after_it(fake):
    """``KvCanary.replayed(stream)`` after each replay of a graph that captured a whole step (an
    engine's graph with the canary inside: the transformers client): one snapshot launch, one
    step, and both stages counted, so the health check holds, and fails for a replay reported
    that never ran."""
    canary, batch, _ = make_canary()
    s = stream(fake)
    step(canary, batch, s)
    fake.run()
    fake.capturing.add(s)
    start = len(fake.captured)
    step(canary, batch, s)
    fake.capturing.clear()
    graph = fake.captured[start:]
    n_snap, step_no = canary.pump.launches, canary.step
    for _ in range(3):
        fake.replay(graph, s)
        canary.replayed(s)
    assert canary.pump.launches == n_snap + 3 and canary.step == step_no + 3
    canary.flush()
    canary.health_check()
    canary.replayed(s)  # reported, but the graph did not run: its launches are missing
    canary.flush()
    with pytest.raises(Exception, match=r"HEAD_K_FULL .*ran \d+ of \d+"):
        canary.health_check()


@pytest.mark.parametrize("start", [0, 3, 7])
def test_a_full_ring_of_new_rows_from_any_start_is_read_in_claim_order(fake, start):
    """``ring_capacity`` new violations claimed from index ``start`` (the ring's rows wrap at
    ``start % capacity``): every one is read back, in claim order, and none counts as lost."""
    canary, batch, records = make_canary(ring_capacity=8)
    s = stream(fake)
    cap = canary.ring_capacity
    ring = np.ctypeslib.as_array((ctypes.c_int64 * (cap * abi.RING_COLS)).from_address(
        canary._ring.ptr)).reshape(-1, abi.RING_COLS)
    claim = ctypes.c_int64.from_address(canary.status.ptr)  # the 64-bit claim counter (STATUS_CLAIM)

    def claimed(indices):  # as kvc_record stores claim i: at i % capacity
        for i in indices:
            ring[i % cap] = [int(abi.LaunchTag.TAIL_K_FULL), 100 + i, 3, 7, 7, 0, 0, 1]
        claim.value = indices[-1] + 1
    if start:
        claimed(list(range(start)))
    step(canary, batch, s)
    fake.run()
    canary.flush()                   # the first rows taken: the host's consumed mark is `start`
    claimed(list(range(start, start + cap)))
    step(canary, batch, s)
    fake.run()
    canary.flush()
    got = [r["slot_idx"] for r in records if r["type"] == "violation"]
    assert got == [100 + i for i in range(start + cap)]
    assert canary.stats()["ring_overflow"] == 0 and canary.stats()["violations_recorded"] == start + cap


def test_a_snapshot_between_head_and_tail_never_hands_over_the_step_s_verdicts_early(monkeypatch):
    """The device path with the real kernels (tests/emu behind the fake driver). A HEAD captured into
    a graph that is never replayed, then that step's TAIL run eagerly: the device has run one TAIL
    more than HEADs, so in every later step its HEAD and TAIL counts agree between HEAD and TAIL. A
    snapshot there (a poll) must not hand over the step's verdicts (before the fix it did, as HEAD
    left them: request A only, and marked that HEAD run reported, so request B, which only TAIL
    finds, was never failed); after TAIL, both are."""
    from tests import emu
    from tests.support.session import Session
    if emu.unavailable_reason() is not None:
        pytest.skip(f"the kernel emulator: {emu.unavailable_reason()}")
    fake = fake_cuda.install(monkeypatch)
    fake.kernels, fake.immediate = emu.Kernels(), True
    try:
        s = Session(device=0, mode="fail_request")
        st = stream(fake)
        s.play(stop_after=2)

        def batch(arrays):
            D = s._dev
            return kc.Batch(D(arrays["rows"]), D(arrays["prefix"]), D(arrays["extend"]), D(s.rtt.copy()),
                            D(arrays["ids"]), D(arrays["pos"]), D(arrays["loc"]), swa_out_cache_loc=D(arrays["loc"]))
        arrays = s.plan_step([(3, [300, 301])])    # a new request C alone, never scheduled again
        b = batch(arrays)
        fake.capturing.add(st)
        s.canary.before_forward(b, stream=st)      # captured, never replayed: this HEAD never runs
        fake.capturing.discard(st)
        s.forward(arrays)
        s.canary.after_forward(b, stream=st)       # ... and its TAIL runs now
        s.canary.flush()
        s.canary.failed_requests()                 # that odd step's own reports: not this test's
        s.rtt[1, 3] = 0                            # A's cached position 3 on the padding slot: HEAD finds it
        s.k[0][int(s.rtt[2, 2]), 5] ^= 0x40       # B's cached KV: only TAIL (real KV) finds it
        s.sync_pools()
        arrays = s.plan_step([(1, [114]), (2, [214])])
        b = batch(arrays)
        s.canary.before_forward(b, stream=st)
        s.canary.poll(st)                          # a snapshot between the step's HEAD and its TAIL
        fake.run()
        assert s.canary.failed_requests() == []
        s.forward(arrays)
        s.canary.after_forward(b, stream=st)
        s.canary.flush()
        got = {f.batch_index: f.reasons for f in s.canary.failed_requests()}
        assert got == {0: abi.FailReason.PADDING_SLOT_READ, 1: abi.FailReason.VERIFY_REAL_KV_HASH_MISMATCH}
    finally:
        fake_cuda.release(fake)
