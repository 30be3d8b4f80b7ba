"""GPU tier: every kernel against the CPU reference, byte for byte, plus the ABI probes."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.runtime import devices, driver, memory
from tests.support import workloads

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]  # no GPU: kernels run in tests/emu

host = lambda a: a  # noqa: E731
to_host = lambda a: a.numpy() if hasattr(a, "numpy") and not isinstance(a, np.ndarray) else np.asarray(a)  # noqa: E731
to_dev = lambda a: memory.to_device(np.ascontiguousarray(a))  # noqa: E731


def test_abi_layout_as_the_device_compiler_sees_it():
    rt = devices.runtime(0)
    order = abi.layout_dump_order()
    out = memory.zeros(len(order), np.int64)
    p = abi.ProbeParams()
    p.out = out.ptr
    rt.launch_struct("kvc_abi_layout", 1, 32, p, driver.PER_THREAD_STREAM)
    got = out.numpy()
    for k, (struct, fname) in enumerate(order):
        decl = next(d for d in abi.STRUCTS if d.name == struct)
        want = abi.struct_size(decl) if not fname else abi.layout(decl)[fname]
        assert got[k] == want, f"{struct}.{fname or 'sizeof'}: device {got[k]}, abi.py {want}"
        if not fname:
            assert want == ctypes.sizeof(abi.CTYPES[struct])


@pytest.mark.parametrize("decl", abi.PARAMS_STRUCTS, ids=lambda d: d.name)
def test_params_struct_echo(decl):
    """Random bytes in every field reach the device unchanged: pass-by-value works field by field."""
    rt = devices.runtime(0)
    size = ctypes.sizeof(abi.CTYPES[decl.name])
    raw = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes()
    params = abi.CTYPES[decl.name].from_buffer_copy(raw)
    rt.launch_struct(f"kvc_echo_{decl.name}", 1, 256, params, driver.PER_THREAD_STREAM)
    ptr, nbytes = rt.global_address("kvc_echo_buffer")
    echoed = np.zeros(size, np.uint8)
    memory.copy_to_host_ptr(echoed, ptr, 0)
    assert nbytes == abi.ECHO_BYTES
    for name, off in abi.layout(decl).items():
        f = next(f for f in decl.fields if f.name == name)
        n = abi.field_size(f)
        assert echoed[off:off + n].tobytes() == raw[off:off + n], f"{decl.name}.{name}"


CASES = [(seed, page, mode, nsrc) for seed, (page, mode, nsrc) in enumerate(
    [(1, abi.HashMode.NONE, 0), (16, abi.HashMode.PARTIAL, 1), (64, abi.HashMode.ALL, 2),
     (16, abi.HashMode.ALL, 4), (1, abi.HashMode.PARTIAL, 64), (64, abi.HashMode.NONE, 3),
     (16, abi.HashMode.PARTIAL, 0), (1, abi.HashMode.ALL, 1)])]


@pytest.mark.parametrize("seed,page,mode,nsrc", CASES)
def test_write_verify_kernels_equal_reference(seed, page, mode, nsrc):
    w = workloads.make(seed, page_size=page, mode=mode, num_sources=nsrc,
                       num_reqs=40 if nsrc < 64 else 8, max_len=300)
    ref = workloads.run(w, host, to_host)
    gpu = workloads.run(w, to_dev, to_host)
    workloads.assert_same(ref, gpu)
    assert ref["write_index"] > 0  # the workload does exercise the violation paths


def _write_effects(w, B, canary, sources, mode, chain_from=None, head_change=None):
    """One kvc_write of workload ``w`` into a copy of ``canary`` (int64 words [num_slots, 4]) on
    backend ``B``: its buffer, ring rows and counters. ``chain_from``: ``(canary, change)`` of a
    HEAD buffer stamped first without sources, ``change(words, w)`` applied to it before this write."""
    def context(words, srcs, m, tag):
        buf = kc.CanaryBuffer(B(words.view(np.uint8).copy()))
        sink = kc.ViolationSink(B(np.zeros((w.ring_capacity, 8), np.int64)), B(np.zeros(1, np.int32)),
                                B(np.zeros(1, np.int64)), B(np.zeros(1, np.int64)))
        return kc.VerifyContext(buf, sink, tag, srcs, m, chain_position_assert=B(np.array([int(w.chain_assert)], np.int32)))

    plan = kc.StepPlan(len(w.seed), 8, None)
    plan.offsets, plan.seed, plan.num_valid_reqs = B(w.offsets), B(w.seed), B(np.array([w.num_valid_reqs], np.int32))
    arrays = [B(a) for a in (w.input_ids, w.positions, w.out_cache_loc, w.expected_input_ids, w.expected_positions)]
    head = None
    if chain_from is not None:
        head = context(canary, (), abi.HashMode.NONE, abi.LaunchTag.HEAD_K_FULL)
        plan.device = head.device
        kc.write(head, plan, *arrays[:3], expected_input_ids=arrays[3], expected_positions=arrays[4])
        if head_change is not None:
            words = to_host(head.buffer.array).view(np.int64).reshape(w.num_slots, -1).copy()
            head_change(words, w)
            head.buffer.array.copy_from_host(words.view(np.uint8)) if hasattr(head.buffer.array, "copy_from_host") \
                else np.copyto(head.buffer.array, words.view(np.uint8))
    ctx = context(canary, sources(B), mode, abi.LaunchTag.TAIL_K_FULL)
    plan.device = ctx.device
    kc.write(ctx, plan, *arrays[:3], expected_input_ids=arrays[3], expected_positions=arrays[4], chain_from=head)
    arrs = ctx.sink.arrays
    effects = {"ring": to_host(arrs[0]), "write_index": int(to_host(arrs[1])[0])}
    return (to_host(ctx.buffer.array).copy(), workloads.ring_rows(effects), effects["write_index"],
            int(to_host(arrs[2])[0]), int(to_host(arrs[3])[0]))


def _change_some_head_records(words, w):
    """Change a field of the HEAD records of a few written slots (between HEAD and TAIL)."""
    rng = np.random.default_rng(9)
    written = w.out_cache_loc[(w.out_cache_loc > 0) & (w.out_cache_loc < w.num_slots)]
    for slot in rng.choice(written, 6, replace=False):
        words[slot, int(rng.integers(0, 3))] ^= 1 << int(rng.integers(0, 63))


@pytest.mark.parametrize("mode,nsrc", [(abi.HashMode.PARTIAL, 1), (abi.HashMode.ALL, 22), (abi.HashMode.PARTIAL, 64)])
@pytest.mark.parametrize("change", [None, _change_some_head_records])
def test_write_with_a_chain_source_equals_the_serial_write(mode, nsrc, change):
    """The chain once per step (docs/format.md §7): a TAIL write that takes its chain from the HEAD
    buffer stamped first ends byte for byte as the reference's serial write (buffer, ring rows,
    counters): with HEAD's records as written, and with some changed before the TAIL write (those
    requests run the serial chain). Seeds: chain heads, out of range, and slots whose (random)
    records both buffers hold; requests of 1-3 and up to 300 entries with holes, repeated and
    out-of-range slots, expected inputs with mismatches. 22 and 64 sources spread a decode
    request's sources over a warp's lanes in the kernel."""
    w = workloads.make(31, num_slots=4096, page_size=16, mode=mode, num_sources=nsrc, num_reqs=40, max_len=300)
    rng = np.random.default_rng(5)
    written = set(w.out_cache_loc.tolist())
    spare = np.array([s for s in range(1, w.num_slots) if s not in written])
    w.seed = rng.choice(spare, len(w.seed)).astype(np.int64)
    w.seed[::5], w.seed[1::9] = -1, w.num_slots + 3
    n = len(w.out_cache_loc)
    w.out_cache_loc[rng.random(n) < 0.01] = w.num_slots + 1
    rep = rng.random(n) < 0.02
    rep[w.offsets[:-1][w.offsets[:-1] < n]] = False  # within a request (across requests: unspecified, §7)
    w.out_cache_loc[rep] = np.roll(w.out_cache_loc, 1)[rep]  # a slot repeated by its successor
    canary = rng.integers(-(1 << 62), 1 << 62, (w.num_slots, 4)).astype(np.int64)

    def sources(B):
        pools = [workloads.columns(B(big.copy()), col, w.page_size * b) for (big, col), b in zip(w.pools, w.bytes_per_token)]
        return [kc.RealKvSource(q, w.page_size, b, r) for q, b, r in zip(pools, w.bytes_per_token, w.read_bytes)]

    ref = _write_effects(w, host, canary, sources, mode)
    got = _write_effects(w, to_dev, canary, sources, mode, chain_from=True, head_change=change)
    np.testing.assert_array_equal(ref[0], got[0])
    assert ref[1:] == got[1:]
    assert ref[2] > 0  # the workload exercises the rows


@pytest.mark.parametrize("change", [None, _change_some_head_records])
def test_long_requests_take_their_chain_source_in_rounds(change):
    """The chain-source path of long requests (link checks and stores of many rounds of one
    block's threads) ends byte for byte as the serial write: requests 1 and 2 have no holes (their
    links can all hold: 2000-9000 entries), request 3 keeps its holes (it runs the serial chain),
    request 0 is decode-sized; with the HEAD records as written and with some changed."""
    w = workloads.make(77, num_slots=40000, page_size=16, mode=abi.HashMode.PARTIAL, num_sources=1, num_reqs=4,
                       max_len=9000)
    w.offsets[2:] = w.offsets[1] + np.cumsum([2000 + 7, 9000 - 1, 2500])  # lengths 2007, 8999, 2500
    n = int(w.offsets[-1])
    rng = np.random.default_rng(3)
    slots = rng.permutation(np.arange(8, w.num_slots))[:n].astype(np.int64)  # slot 5, a seed, is not written
    w.out_cache_loc = slots.copy()
    hole = rng.random(n) < 0.03
    hole[: w.offsets[3]] = False
    w.out_cache_loc[hole] = -1
    w.input_ids = rng.integers(0, 50_000, n).astype(np.int64)
    w.positions = np.concatenate([np.arange(b - a) for a, b in zip(w.offsets[:-1], w.offsets[1:])]).astype(np.int64)
    w.expected_input_ids, w.expected_positions = w.input_ids.copy(), w.positions.copy()
    w.expected_input_ids[rng.random(n) < 0.001] += 1
    w.seed = np.array([-1, 5, w.num_slots + 2, -1], np.int64)
    canary = rng.integers(-(1 << 62), 1 << 62, (w.num_slots, 4)).astype(np.int64)

    def sources(B):
        pools = [workloads.columns(B(big.copy()), col, w.page_size * b) for (big, col), b in zip(w.pools, w.bytes_per_token)]
        return [kc.RealKvSource(q, w.page_size, b, r) for q, b, r in zip(pools, w.bytes_per_token, w.read_bytes)]

    ref = _write_effects(w, host, canary, sources, w.mode)
    got = _write_effects(w, to_dev, canary, sources, w.mode, chain_from=True, head_change=change)
    np.testing.assert_array_equal(ref[0], got[0])
    assert ref[1:] == got[1:]
    assert ref[4] >= n * 0.9  # slot_run_counter: the long requests were stamped


def test_long_chain_single_request():
    w = workloads.make(123, num_slots=40000, page_size=64, num_reqs=1, max_len=2, mode=abi.HashMode.ALL)
    n = 33000
    w.offsets = np.array([0, n], np.int64)
    w.input_ids = np.random.default_rng(1).integers(0, 1 << 40, n).astype(np.int64)
    w.positions = np.arange(n, dtype=np.int64)
    w.out_cache_loc = np.random.default_rng(2).permutation(np.arange(1, 40000))[:n].astype(np.int64)
    w.expected_input_ids, w.expected_positions = w.input_ids.copy(), w.positions.copy()
    workloads.assert_same(workloads.run(w, host, to_host), workloads.run(w, to_dev, to_host))


def test_write_repeated_slots_last_occurrence_stores():
    """A request that writes a slot several times (within one 192-entry chunk and across chunks):
    the record of its last occurrence stays, as in the reference's in-order stores."""
    n = 1500
    w = workloads.repeated_slots(77, n)
    w.expected_input_ids, w.expected_positions = w.input_ids.copy(), w.positions.copy()
    ref = workloads.run(w, host, to_host)
    workloads.assert_same(ref, workloads.run(w, to_dev, to_host))
    assert len(np.unique(w.out_cache_loc[w.out_cache_loc > 0])) < n // 2


@pytest.mark.parametrize("mode", [abi.HashMode.NONE, abi.HashMode.PARTIAL, abi.HashMode.ALL])
def test_write_short_and_long_requests_seeds_repeats_and_holes(mode):
    """Requests of 0..33 and a few hundred entries: seeds that are chain heads, untouched slots or
    out of range, slots repeated within a request, holes, out-of-range slots, expected inputs
    with mismatches. Requests write disjoint slot ranges and seed from slots nobody writes in
    the launch (requests are independent, docs/format.md §7: blocks run them in any order)."""
    w = workloads.make(78, num_slots=40000, page_size=16, num_reqs=96, max_len=2, mode=mode)
    rng = np.random.default_rng(4)
    lens = rng.integers(0, 34, 96)
    lens[::7], lens[::11], lens[::13] = 32, 33, 300
    n = int(lens.sum())
    w.offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    w.seed = rng.choice([-1, 39990, 39999, 40000 + 4], 96).astype(np.int64)
    w.input_ids = rng.integers(0, 1 << 30, n).astype(np.int64)
    w.positions = np.concatenate([np.arange(k) + int(rng.integers(0, 9)) for k in lens]).astype(np.int64)
    base = np.repeat(1 + 400 * np.arange(96), lens)  # request r writes slots [1 + 400 r, 1 + 400 r + 200)
    w.out_cache_loc = (base + rng.integers(0, 200, n)).astype(np.int64)
    w.out_cache_loc[rng.random(n) < 0.05] = -1
    w.out_cache_loc[rng.random(n) < 0.01] = 40000 + 7
    w.expected_input_ids, w.expected_positions = w.input_ids.copy(), w.positions.copy()
    w.expected_input_ids[rng.random(n) < 0.03] += 1
    ref = workloads.run(w, host, to_host)
    workloads.assert_same(ref, workloads.run(w, to_dev, to_host))
    assert ref["write_index"] > 0


def test_ring_overflow_counts_every_row():
    w = workloads.make(5, ring_capacity=4)
    ref, gpu = workloads.run(w, host, to_host), workloads.run(w, to_dev, to_host)
    assert ref["write_index"] == gpu["write_index"] > 4
    full = workloads.make(5, ring_capacity=4096)
    all_rows = {row[:abi.RING_COLS] for row in workloads.ring_rows(workloads.run(full, host, to_host))}
    assert set(map(tuple, gpu["ring"].tolist())) <= all_rows  # fill once: rows kept, none torn


def test_two_threads_launch_concurrently():
    ws = [workloads.make(100 + i) for i in range(2)]
    refs = [workloads.run(w, host, to_host) for w in ws]
    out = [None, None]

    def work(i):
        out[i] = [workloads.run(ws[i], to_dev, to_host) for _ in range(3)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for i in range(2):
        for got in out[i]:
            workloads.assert_same(refs[i], got)


def _oob_verify(ctx, n):
    """A plan verify of n entries on slots past the buffer: one SLOT_OUT_OF_RANGE row each."""
    plan = kc.StepPlan.allocate(1, n, device=0, materialize=True)
    plan.slot.copy_from_host(np.full(n, 1 << 20, np.int64))
    plan.num_valid.copy_from_host(np.array([n], np.int32))
    plan.enable.copy_from_host(np.array([1], np.int32))
    kc.verify(ctx, plan)


def test_ring_fills_once_across_launches():
    """Format v1: rows past capacity are dropped, never stored over earlier ones: after a launch
    that fills the ring, a later launch's rows appear nowhere (a ring that wraps would hold them)."""
    sink = kc.ViolationSink.allocate(4, device=0)
    a, b = (kc.VerifyContext(kc.CanaryBuffer.allocate(8, device=0), sink, tag) for tag in
            (abi.LaunchTag.HEAD_K_FULL, abi.LaunchTag.TAIL_V_SWA))
    _oob_verify(a, 6)
    _oob_verify(b, 5)
    ring, wi = sink.arrays[0].numpy(), int(sink.arrays[1].numpy()[0])
    assert wi == 11 and set(ring[:, abi.COL_KERNEL_KIND].tolist()) == {int(abi.LaunchTag.HEAD_K_FULL)}


def test_ring_window_after_the_consumed_mark():
    """The manager's window: with a 64-bit claim and a consumed mark, row i lands at i % capacity
    iff i - consumed < capacity; rows before the mark may be reused, unread ones never are."""
    from kvcanary.runtime import memory
    base = kc.ViolationSink.allocate(4, device=0)
    claim, consumed = memory.zeros((1,), np.int64), memory.zeros((1,), np.int64)
    sink = kc.ViolationSink(*base.arrays, claim=claim, consumed=consumed)
    a, b = (kc.VerifyContext(kc.CanaryBuffer.allocate(8, device=0), sink, tag) for tag in
            (abi.LaunchTag.HEAD_K_FULL, abi.LaunchTag.TAIL_V_SWA))
    _oob_verify(a, 6)  # claims 0..5: 0..3 stored, 4 and 5 dropped (consumed 0)
    assert int(claim.numpy()[0]) == 6 and int(sink.arrays[1].numpy()[0]) == 0  # the v1 index is untouched
    consumed.copy_from_host(np.array([6], np.int64))  # the host took everything up to 6
    _oob_verify(b, 5)  # claims 6..10: 6..9 stored at 2, 3, 0, 1; 10 dropped
    kinds = sink.arrays[0].numpy()[:, abi.COL_KERNEL_KIND].tolist()
    assert int(claim.numpy()[0]) == 11 and kinds == [int(abi.LaunchTag.TAIL_V_SWA)] * 4
