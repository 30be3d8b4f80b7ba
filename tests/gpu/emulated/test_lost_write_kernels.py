"""GPU tier (emulated without a GPU): the lost-write check (docs/format.md §7.1, K14) of the write
kernel against the CPU reference, byte for byte, on seeded workloads with lost stores mixed into
clean traffic: the serial chunked path, the chain-source path and long requests, every hash mode
that reads KV bytes. The slots whose store was lost are known by construction; the reference must
report exactly those, and the kernel whatever the reference does."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.runtime import memory
from tests.support import workloads

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]

LOST = int(abi.FailReason.LOST_WRITE)
host = lambda a: a  # noqa: E731
to_host = lambda a: a.numpy() if hasattr(a, "numpy") and not isinstance(a, np.ndarray) else np.asarray(a)  # noqa: E731
to_dev = lambda a: memory.to_device(np.ascontiguousarray(a))  # noqa: E731


def _second_step(w, rng, lost_fraction):
    """Step 2 of workload ``w``: every slot step 1 wrote gets a new token (other than its old one)
    at a new position, and new KV bytes (the engine's store) except a ``lost_fraction`` of them.
    Returns (step-2 ids, positions, pools after the stores, the slots whose store was lost)."""
    ids = w.input_ids + 1 + rng.integers(0, 1000, len(w.input_ids))
    positions = w.positions + 1000
    pools = [big.copy() for big, _ in w.pools]
    written = np.unique(w.out_cache_loc[w.out_cache_loc > 0])
    lost = set(rng.choice(written, max(1, int(len(written) * lost_fraction)), replace=False).tolist())
    for k, ((_, col), bpt) in enumerate(zip(w.pools, w.bytes_per_token)):
        for s in written.tolist():
            if s in lost:
                continue
            row, off = divmod(s, w.page_size)
            start = col + off * bpt
            pools[k][row, start:start + bpt] = rng.integers(0, 256, bpt, dtype=np.uint8)
    return ids, positions, pools, lost


def _two_steps(w, B, ids2, pos2, pools2, chain_source):
    """Step 1 stamps ``w`` into a zeroed TAIL buffer over ``w.pools``; step 2 stamps (ids2, pos2)
    over ``pools2`` (with ``chain_source``: taking its chain from a HEAD buffer stamped first without
    sources). Returns the TAIL buffer, its ring rows (sorted, with requests) and counters."""
    def context(buf, pools, mode, tag, ring):
        srcs = [] if mode == abi.HashMode.NONE else [
            kc.RealKvSource(workloads.columns(B(big.copy()), col, w.page_size * b), w.page_size, b, r)
            for big, (_, col), b, r in zip(pools, w.pools, w.bytes_per_token, w.read_bytes)]
        return kc.VerifyContext(buf, ring, tag, srcs, mode)

    def sink():
        return kc.ViolationSink(B(np.zeros((w.ring_capacity, 8), np.int64)), B(np.zeros(1, np.int32)),
                                B(np.zeros(1, np.int64)), B(np.zeros(1, np.int64)),
                                verdicts=B(np.zeros(len(w.seed), np.int64)), failed_requests=B(np.zeros(1, np.int64)),
                                ring_requests=B(np.full(w.ring_capacity, -7, np.int64)))

    plan = kc.StepPlan(len(w.seed), 8, None)
    plan.offsets, plan.seed, plan.num_valid_reqs = B(w.offsets), B(w.seed), B(np.array([w.num_valid_reqs], np.int32))
    tail_buf = kc.CanaryBuffer(B(np.zeros((w.num_slots, 32), np.uint8)))
    first = context(tail_buf, [big for big, _ in w.pools], w.mode, abi.LaunchTag.TAIL_K_FULL, sink())
    plan.device = first.device
    kc.write(first, plan, B(w.input_ids), B(w.positions), B(w.out_cache_loc))
    head = None
    if chain_source:
        head = context(kc.CanaryBuffer(B(np.zeros((w.num_slots, 32), np.uint8))), pools2, abi.HashMode.NONE,
                       abi.LaunchTag.HEAD_K_FULL, sink())
        kc.write(head, plan, B(ids2), B(pos2), B(w.out_cache_loc))
    second = context(tail_buf, pools2, w.mode, abi.LaunchTag.TAIL_K_FULL, sink())
    kc.write(second, plan, B(ids2), B(pos2), B(w.out_cache_loc), chain_from=head)
    arrs, v = second.sink.arrays, second.sink.verdict_arrays
    effects = {"ring": to_host(arrs[0]), "write_index": int(to_host(arrs[1])[0]),
               "ring_requests": to_host(v[2])}
    return (to_host(tail_buf.array).copy(), workloads.ring_rows(effects), effects["write_index"],
            int(to_host(arrs[3])[0]), to_host(v[0]).tolist(), int(to_host(v[1])[0]))


CASES = [(abi.HashMode.PARTIAL, 1, False), (abi.HashMode.ALL, 2, False), (abi.HashMode.PARTIAL, 22, True),
         (abi.HashMode.ALL, 4, True), (abi.HashMode.PARTIAL, 64, True), (abi.HashMode.PARTIAL, 64, False)]


@pytest.mark.parametrize("mode,nsrc,chain_source", CASES)
def test_lost_writes_mixed_into_clean_traffic_equal_the_reference(mode, nsrc, chain_source):
    """Requests of 1-3 and up to 300 tokens (decode and prefill, several 192-entry chunks), holes,
    10 % of the stores lost: reference == kernel (buffer, rows with their requests, counters,
    verdicts), and the reference's LOST_WRITE rows name exactly the lost slots."""
    w = workloads.make(430 + nsrc, num_slots=4096, page_size=16, mode=mode, num_sources=nsrc,
                       num_reqs=40 if nsrc < 64 else 8, max_len=300)
    ids2, pos2, pools2, lost = _second_step(w, np.random.default_rng(nsrc), 0.1)
    ref = _two_steps(w, host, ids2, pos2, pools2, False)
    got = _two_steps(w, to_dev, ids2, pos2, pools2, chain_source)
    np.testing.assert_array_equal(ref[0], got[0])
    assert ref[1:] == got[1:]
    assert {row[1] for row in ref[1] if row[7] & LOST} == lost
    assert all(row[7] == LOST for row in ref[1]) and ref[5] > 0  # nothing else fires; requests fail


def test_clean_second_step_reports_nothing_on_either_backend():
    w = workloads.make(440, num_slots=4096, page_size=16, mode=abi.HashMode.PARTIAL, num_sources=3, max_len=300)
    ids2, pos2, pools2, _ = _second_step(w, np.random.default_rng(1), 0.0)
    pools2 = [p.copy() for p in pools2]
    rng = np.random.default_rng(2)
    for k, ((_, col), bpt) in enumerate(zip(w.pools, w.bytes_per_token)):  # every store happens
        for s in np.unique(w.out_cache_loc[w.out_cache_loc > 0]).tolist():
            row, off = divmod(s, w.page_size)
            pools2[k][row, col + off * bpt:col + (off + 1) * bpt] = rng.integers(0, 256, bpt, dtype=np.uint8)
    for B in (host, to_dev):
        assert _two_steps(w, B, ids2, pos2, pools2, B is to_dev)[2] == 0


def test_repeated_slots_across_chunks_check_in_entry_order():
    """One request of 1500 entries over 300 slots (repeats within and across 192-entry chunks, over
    unchanged bytes): each later occurrence finds the previous occurrence's record, as the
    reference checks entries in order; the kernel's last occurrence per chunk checks them."""
    n = 1500
    w = workloads.repeated_slots(441, n)
    ref = _two_steps(w, host, w.input_ids[::-1].copy(), w.positions, [big for big, _ in w.pools], False)
    got = _two_steps(w, to_dev, w.input_ids[::-1].copy(), w.positions, [big for big, _ in w.pools], False)
    np.testing.assert_array_equal(ref[0], got[0])
    assert ref[1:] == got[1:]
    assert ref[2] > n // 2


def _fold_step(lens, rng, *, fold: bool):
    """One HEAD-style step of a K and a V buffer with sources (PARTIAL), launched as the plan build
    then the paired writes, or (``fold``) as kvc_prepare_write_pair(_warps): buffers, sorted rows
    with their requests, counters. Records before it: random identities whose REAL_KV_HASH is the
    fingerprint of the slot's bytes for half of the slots (their bytes unchanged since: a lost
    store if the token differs); requests repeat a few slots."""
    from kvcanary.ops import _run, prepare_build_plan, prepare_write
    from kvcanary.reference.canary import RefSource, fingerprint
    from kvcanary.runtime.launch import folded, paired
    n, R = 512, len(lens)
    pools = [rng.integers(0, 256, (n, 32), dtype=np.uint8) for _ in range(2)]
    records = []
    for pool in pools:
        words = rng.integers(-(1 << 62), 1 << 62, (n, 4)).astype(np.int64)
        same = rng.random(n) < 0.5
        fp = fingerprint(np.arange(n), [RefSource(pool, 1, 32, 16)]).view(np.int64)
        words[same, abi.FIELD_REAL_KV_HASH] = fp[same]
        records.append(words)
    total = int(sum(lens))
    loc = rng.permutation(np.arange(1, n))[:total].astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    for r in range(R):  # a slot repeated later in its request
        if lens[r] >= 3:
            loc[offsets[r] + lens[r] - 1] = loc[offsets[r]]
    ids = rng.integers(0, 1000, total).astype(np.int64)
    positions = np.concatenate([np.arange(k) for k in lens]).astype(np.int64)
    rtt = np.zeros((R + 1, 64), np.int32)
    for r in range(R):
        rtt[r + 1, :lens[r]] = loc[offsets[r]:offsets[r + 1]]
    d = to_dev
    batch = kc.Batch(d(np.arange(1, R + 1, dtype=np.int64)), d(np.zeros(R, np.int64)), d(np.asarray(lens, np.int64)),
                     d(rtt), d(ids), d(positions), d(loc))
    plan = kc.StepPlan.allocate(R, 64, device=0)
    ctxs = []
    for h, (pool, words) in enumerate(zip(pools, records)):
        sink = kc.ViolationSink(d(np.zeros((4096, 8), np.int64)), d(np.zeros(1, np.int32)), d(np.zeros(1, np.int64)),
                                d(np.zeros(1, np.int64)), verdicts=d(np.zeros(R, np.int64)),
                                failed_requests=d(np.zeros(1, np.int64)), ring_requests=d(np.full(4096, -7, np.int64)))
        ctxs.append(kc.VerifyContext(kc.CanaryBuffer(d(words.view(np.uint8).copy())), sink,
                                     abi.LaunchTag(abi.LaunchTag.TAIL_K_FULL + h), [kc.source_from_slots(d(pool))],
                                     abi.HashMode.PARTIAL))
    build = prepare_build_plan(batch, plan, ctx=ctxs[0])
    pair = paired(*(prepare_write(c, plan, batch.input_ids, batch.positions, batch.out_cache_loc) for c in ctxs))
    launches = [folded(build[0], pair)] if fold else [*build, pair]
    assert launches[0] is not None and (launches[0].name.startswith("kvc_prepare_write_pair") == fold)
    _run(launches)
    out = []
    for c in ctxs:
        arrs, v = c.sink.arrays, c.sink.verdict_arrays
        effects = {"ring": to_host(arrs[0]), "write_index": int(to_host(arrs[1])[0]), "ring_requests": to_host(v[2])}
        out.append((to_host(c.buffer.array).copy(), workloads.ring_rows(effects), to_host(v[0]).tolist()))
    return out


@pytest.mark.parametrize("lens", [[1, 3, 1, 5, 2], [20, 3, 40, 1, 60]], ids=["warps", "block"])
def test_the_folded_write_checks_lost_writes_like_the_write_kernel(lens):
    """HEAD's folded launch (kvc_prepare_write_pair: its warp path and, past 32 tokens, its block
    path) with sources reports the same lost writes as the plan build then kvc_write_pair (== the
    reference, above): the fold's stores, rows and verdicts, slots repeated within a request."""
    apart = _fold_step(lens, np.random.default_rng(7), fold=False)
    together = _fold_step(lens, np.random.default_rng(7), fold=True)
    for a, b in zip(apart, together):
        np.testing.assert_array_equal(a[0], b[0])
        assert a[1:] == b[1:]
    assert any(row[7] & LOST for half in apart for row in half[1])


def test_unknown_tokens_match_any_on_both_backends():
    """Tokens stamped as unknown (-1, the vLLM connector's decode tokens under async scheduling) in
    either step: no row for those entries; the kernel as the reference."""
    w = workloads.make(442, num_slots=4096, page_size=16, mode=abi.HashMode.PARTIAL, num_sources=2, max_len=300)
    rng = np.random.default_rng(6)
    ids2, pos2, pools2, lost = _second_step(w, rng, 0.3)
    w.input_ids[rng.random(len(w.input_ids)) < 0.2] = -1
    ids2[rng.random(len(ids2)) < 0.2] = -1
    ref = _two_steps(w, host, ids2, pos2, pools2, False)
    got = _two_steps(w, to_dev, ids2, pos2, pools2, True)
    np.testing.assert_array_equal(ref[0], got[0])
    assert ref[1:] == got[1:]
    by_slot = {}
    for i, s in enumerate(w.out_cache_loc.tolist()):
        by_slot.setdefault(s, []).append(i)
    known = {s for s in lost if all(w.input_ids[i] >= 0 and ids2[i] >= 0 for i in by_slot[s])}
    assert {row[1] for row in ref[1] if row[7] & LOST} == known and known and known != lost
