"""Seeded random canary workloads, runnable on any backend through the public ops.

A workload is plain numpy data. :func:`run` replays it through kvcanary's ops with arrays made by
``to_backend`` (identity for the CPU reference; a device upload for the GPU) and returns every
effect as host numpy (canary bytes, ring rows, write index, counters), so two backends can be
compared byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import kvcanary as kc
from kvcanary import abi


@dataclass
class Workload:
    num_slots: int
    page_size: int
    mode: abi.HashMode
    pools: list  # (host uint8 buffer, first column): source k is buffer[:, col:col + page*bpt[k]]
    bytes_per_token: list
    read_bytes: list
    ring_capacity: int
    # write phase
    offsets: np.ndarray
    seed: np.ndarray
    num_valid_reqs: int
    input_ids: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray
    expected_input_ids: np.ndarray | None
    expected_positions: np.ndarray | None
    chain_assert: bool
    # verify phase
    plan: dict = field(default_factory=dict)
    num_valid: int = 0
    enable: int = 1
    check_expected_token: bool = False
    corrupt_canary: list = field(default_factory=list)  # (slot, byte offset, xor)
    corrupt_kv: list = field(default_factory=list)      # (pool, row, byte, xor)


def make(seed: int, *, num_slots=2048, page_size=16, mode=abi.HashMode.PARTIAL, num_sources=2,
         num_reqs=24, max_len=200, ring_capacity=4096, strided=True, kv_dtype_bytes=16) -> Workload:
    rng = np.random.default_rng(seed)
    rows = -(-num_slots // page_size)
    pools, bpt, rb = [], [], []
    for _ in range(num_sources):
        per_token = int(rng.choice([16, 32, 64, 128]))
        row_bytes = page_size * per_token
        if strided:  # a per-layer slice of a [rows, layers * row_bytes] buffer
            big = rng.integers(0, 256, (rows, row_bytes * 2 + 16), dtype=np.uint8)
            pools.append((big, row_bytes))
        else:
            pools.append((rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8), 0))
        bpt.append(per_token)
        rb.append(int(rng.choice([16 * k for k in range(1, per_token // 16 + 1)])))
    free = rng.permutation(np.arange(1, num_slots))
    lens = rng.integers(0, max_len, num_reqs)
    lens[: num_reqs // 4] = rng.integers(1, 4, num_reqs // 4)  # some decode-sized requests
    if lens.sum() > num_slots - 1:  # every written token gets its own slot
        lens = (lens * (num_slots - 1) // lens.sum()).astype(lens.dtype)
    total = int(lens.sum())
    slots = free[:total].astype(np.int64)
    offsets = np.zeros(num_reqs + 1, np.int64)
    offsets[1:] = np.cumsum(lens)
    input_ids = rng.integers(0, 50_000, total).astype(np.int64)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64) if total else np.zeros(0, np.int64)
    loc = slots.copy()
    holes = rng.random(total) < 0.03
    loc[holes] = -1
    exp_ids, exp_pos = input_ids.copy(), positions.copy()
    bad = rng.random(total) < 0.02
    exp_ids[bad] += 1
    bad = rng.random(total) < 0.02
    exp_pos[bad] += 7
    w = Workload(num_slots, page_size, abi.HashMode(mode), pools, bpt, rb, ring_capacity, offsets,
                 np.full(num_reqs, -1, np.int64), num_reqs, input_ids, positions, loc, exp_ids,
                 exp_pos, chain_assert=bool(rng.random() < 0.5))
    # Verify every written entry (and a few odd ones): its slot, predecessor, position, token.
    slot_l, tok_l, pos_l, prev_l = [], [], [], []
    for r in range(num_reqs):
        prev = -1
        for i in range(offsets[r], offsets[r + 1]):
            if loc[i] < 0:
                continue
            slot_l.append(loc[i]); tok_l.append(input_ids[i]); pos_l.append(positions[i]); prev_l.append(prev)
            prev = loc[i]
    slot_l += [0, num_slots + 5, int(slots[0]) if total else 1]
    tok_l += [-1, -1, 3]
    pos_l += [0, 1, 0]
    prev_l += [0, -1, num_slots + 9]
    cap = len(slot_l) + 8
    w.plan = {k: np.asarray(v + [0] * (cap - len(v)), np.int64) for k, v in
              (("slot", slot_l), ("expected_token", tok_l), ("expected_position", pos_l), ("prev_slot", prev_l))}
    w.num_valid = len(slot_l)
    w.check_expected_token = bool(rng.random() < 0.7)
    for _ in range(3):
        w.corrupt_canary.append((int(rng.choice(slots)) if total else 1, int(rng.integers(0, 32)), 1 << int(rng.integers(0, 8))))
    for _ in range(3 if num_sources else 0):
        k = int(rng.integers(0, num_sources))
        w.corrupt_kv.append((k, int(rng.integers(0, rows)), int(rng.integers(0, page_size * bpt[k])), 0x10))
    return w


def repeated_slots(seed: int, n: int = 1500, slots: int = 300) -> Workload:
    """One request of ``n`` entries over slots [1, ``slots``): slots repeat within and across the
    write's 192-entry chunks, and about 5 % of the entries are skipped (-1)."""
    w = make(seed, num_slots=4000, page_size=16, num_reqs=1, max_len=2, mode=abi.HashMode.PARTIAL)
    rng = np.random.default_rng(3)
    w.offsets = np.array([0, n], np.int64)
    w.input_ids = rng.integers(0, 1 << 30, n).astype(np.int64)
    w.positions = np.arange(n, dtype=np.int64)
    w.out_cache_loc = rng.integers(1, slots, n).astype(np.int64)
    w.out_cache_loc[rng.random(n) < 0.05] = -1
    return w


def run(w: Workload, to_backend, to_host, *, stream=None, to_state=None) -> dict:
    """Write, corrupt, verify; return every effect as host numpy arrays. ``to_state`` makes the
    request verdict arrays the kernels write (default ``to_backend``; a backend whose 1-D int64
    arrays are read-only inputs passes a writable one)."""
    B = to_backend
    S = to_state or B
    dev_pools = [columns(B(big.copy()), col, w.page_size * n) for (big, col), n in zip(w.pools, w.bytes_per_token)]
    sources = [kc.RealKvSource(p, w.page_size, n, r) for p, n, r in zip(dev_pools, w.bytes_per_token, w.read_bytes)]
    buf = kc.CanaryBuffer(B(np.zeros((w.num_slots, 32), np.uint8)))
    bs = len(w.seed)
    # request verdicts (docs/format.md §5.7): the write attributes its rows, the plan's verify does not
    sink = kc.ViolationSink(B(np.zeros((w.ring_capacity, 8), np.int64)), B(np.zeros(1, np.int32)),
                            B(np.zeros(1, np.int64)), B(np.zeros(1, np.int64)), verdicts=S(np.zeros(bs, np.int64)),
                            failed_requests=S(np.zeros(1, np.int64)),
                            ring_requests=S(np.full(w.ring_capacity, -7, np.int64)))
    flag = B(np.array([1 if w.chain_assert else 0], np.int32))
    ctx = kc.VerifyContext(buf, sink, abi.LaunchTag.TAIL_K_FULL, sources, w.mode, chain_position_assert=flag)
    plan = kc.StepPlan(bs, len(w.plan["slot"]), None)
    plan.offsets, plan.seed, plan.num_valid_reqs = B(w.offsets), B(w.seed), B(np.array([w.num_valid_reqs], np.int32))
    plan.device = ctx.device
    kc.write(ctx, plan, B(w.input_ids), B(w.positions), B(w.out_cache_loc),
             expected_input_ids=B(w.expected_input_ids), expected_positions=B(w.expected_positions), stream=stream)
    after_write = to_host(buf.array).copy()
    return {"canary_after_write": after_write, **_verify_phase(w, ctx, plan, B, to_host, stream)}


def columns(array, start: int, width: int):
    """array[:, start:start + width] without copying, for any backend (raw views for kvcanary's)."""
    if hasattr(array, "__getitem__") and not isinstance(array, kc.ArrayView):
        return array[:, start:start + width]
    v = kc.as_view(array, name="pool")
    return kc.from_pointer(v.ptr + start, (v.shape[0], width), np.uint8, device=v.device,
                           strides=(v.strides[0], 1), owner=array)


def _verify_phase(w, ctx, plan, B, to_host, stream):
    canary = to_host(ctx.buffer.array).copy()
    for slot, byte, x in w.corrupt_canary:
        canary[slot, byte] ^= x
    ctx2 = _recontext(ctx, B(canary), w, B, to_host)
    plan.slot, plan.expected_token = B(w.plan["slot"]), B(w.plan["expected_token"])
    plan.expected_position, plan.prev_slot = B(w.plan["expected_position"]), B(w.plan["prev_slot"])
    plan.num_valid, plan.enable = B(np.array([w.num_valid], np.int32)), B(np.array([w.enable], np.int32))
    kc.verify(ctx2, plan, check_expected_token=w.check_expected_token, stream=stream)
    s = ctx2.sink
    return {"canary_after_verify": to_host(ctx2.buffer.array), "ring": to_host(s.arrays[0]),
            "write_index": int(to_host(s.arrays[1])[0]), "kernel_runs": int(to_host(s.arrays[2])[0]),
            "slot_runs": int(to_host(s.arrays[3])[0]), "verdicts": to_host(s.verdict_arrays[0]).copy(),
            "failed_requests": int(to_host(s.verdict_arrays[1])[0]), "ring_requests": to_host(s.verdict_arrays[2])}


def _recontext(ctx, canary_array, w, B, to_host):
    pools = []
    for k, ((big, col), n) in enumerate(zip(w.pools, w.bytes_per_token)):
        host = big.copy()
        for pk, row, byte, x in w.corrupt_kv:
            if pk == k:
                host[row, col + byte] ^= x
        pools.append(columns(B(host), col, w.page_size * n))
    sources = [kc.RealKvSource(p, w.page_size, n, r) for p, n, r in zip(pools, w.bytes_per_token, w.read_bytes)]
    return kc.VerifyContext(kc.CanaryBuffer(canary_array), ctx.sink, ctx.tag, sources, ctx.hash_mode,
                            chain_position_assert=ctx.chain_position_assert)


def ring_rows(effects: dict) -> list[tuple]:
    """Recorded rows as a sorted list (the GPU records in a nondeterministic order), each with the
    request it is attributed to appended when the effects carry them."""
    n = min(effects["write_index"], effects["ring"].shape[0])
    rows = effects["ring"][:n].tolist()
    if "ring_requests" in effects:
        rows = [row + [int(r)] for row, r in zip(rows, effects["ring_requests"][:n])]
    return sorted(map(tuple, rows))


def assert_same(a: dict, b: dict) -> None:
    np.testing.assert_array_equal(a["canary_after_write"], b["canary_after_write"])
    np.testing.assert_array_equal(a["canary_after_verify"], b["canary_after_verify"])
    assert a["write_index"] == b["write_index"]
    assert a["kernel_runs"] == b["kernel_runs"] and a["slot_runs"] == b["slot_runs"]
    np.testing.assert_array_equal(a["verdicts"], b["verdicts"])
    assert a["failed_requests"] == b["failed_requests"]
    if a["write_index"] <= a["ring"].shape[0]:
        assert ring_rows(a) == ring_rows(b)
