"""Hostile values for every kernel, in the CPU kernel emulator, on guard-paged memory (issue 11).

Every array a kernel reads or writes (batch, req_to_token, SWA map, expected pool and lengths,
plan arrays, entry offsets, write plan, token arrays, canary buffer, ring, counters, real-KV
sources) lies in memory of its own whose end touches a PROT_NONE page, or, in the other placement
hypothesis draws, whose start follows one (tests/support/guarded.py says what that cannot catch). Each
example runs in a forked child: an out-of-bounds access fails the test as "out-of-bounds access
in <kernel>" with the example, never pytest. Oracle, in every example: no fault, and wherever the
reference defines the outcome, byte equality with kvcanary.reference.canary / reference_plan (called
directly: tests/support/fuzz_model.py) of every plan array, the canary buffer, the counters, the write
index or claim, the skip counter and the ring rows (as a multiset). Where it does not (entry
offsets that are not non-decreasing; write requests that stamp each other's slots, docs/format.md §7)
only what must hold is checked and the kernel's result is adopted for the next launch.

kvc_snapshot is fixed-size: it copies ``n`` int64 the host chose from the status block, with no
index read from device memory, so it gets one guarded run rather than hostile values.

CPU tier: needs only g++ (skips with the reason without it). KVCANARY_FUZZ_SCALE multiplies the
example counts (e.g. 10 for a longer local run); runs are derandomized, so CI is reproducible.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcanary as kc
from kvcanary import abi, ops
from kvcanary.errors import ValidationError
from kvcanary.reference import plan as reference_plan
from kvcanary.runtime import devices, driver
from tests.support import fuzz_cases as fc
from tests.support import guarded
from tests.support.fuzz_model import (
    PLAN_ENTRIES,
    PLAN_WRITE,
    World,
    ref_expand,
    ref_fused,
    ref_verify,
    write_and_check,
)

SCALE = float(os.environ.get("KVCANARY_FUZZ_SCALE", "1"))


def fuzz(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                           HealthCheck.large_base_example], print_blob=False)


@pytest.fixture(scope="module")
def emulator():
    """The fake driver with the emulated kernels, loaded once in this process (children inherit
    it); each launch first notes its kernel name for the fork's report."""
    from tests import emu
    from tests.support import fake_cuda
    reason = emu.unavailable_reason()
    if reason:
        pytest.skip(f"kernel fuzz suite: {reason}")
    with pytest.MonkeyPatch.context() as mp:
        fake = fake_cuda.install(mp)
        kernels = emu.Kernels()
        run = kernels.launch
        kernels.launch = lambda kernel, *a: (guarded.note(kernel), run(kernel, *a))
        fake.kernels, fake.immediate = kernels, True
        devices.runtime(0)
        yield fake
        fake_cuda.release(fake)


def run(case, flow) -> None:
    guarded.run_forked(lambda: flow(case))


# ---- plan builder, fused verify, expand, verify and write over one engine batch ------------------------
@st.composite
def plan_cases(draw):
    eng = draw(fc.engines())
    max_batch, capacity = draw(fc.sizes(1, 8)), draw(st.sampled_from([80, 80, 16, 4, 1]))
    head = draw(fc.batches(eng, max_batch))
    rng = np.random.default_rng(draw(fc.seeds))
    if draw(st.booleans()):
        fc.stamp(eng, head, rng)
    return dict(placement=draw(st.sampled_from(guarded.PLACEMENTS)), engine=eng, sink=draw(fc.sinks()), head=head,
                max_batch=max_batch, capacity=capacity, materialize=draw(st.booleans()),
                poison=fc.plan_poison(rng, max_batch, capacity), tail=draw(fc.tails(head, max_batch)),
                check=draw(st.booleans()))


def plan_flow(case) -> None:
    b, t, cap = case["head"], case["tail"], case["capacity"]
    w = World(case["placement"])
    ctx = w.context(case["engine"], case["sink"], abi.LaunchTag.HEAD_K_FULL)
    plan = w.plan(case["max_batch"], cap, case["materialize"], case["poison"])
    head = w.batch(b, "head.")
    swa_map = w.add("swa_map", b["swa_map"]) if "swa_map" in b else None
    window, offset, loc = b["swa_window"], b.get("expected_token_offset", 0), "swa_out_cache_loc" if swa_map else "out_cache_loc"
    kc.build_plan(head, plan, swa_window=window, swa_map=swa_map, ctx=ctx)
    hb = w.host_batch("head.")
    vref, wref = w.ref_plans()
    reference_plan.fill_plan(verify=vref, write=wref, **{k: hb[k] for k in ("req_pool_indices", "prefix_lens",
                             "extend_lens", "req_to_token", "expected_pool", "expected_valid_lens")},
                             swa_window=window, swa_map=w.ref.get("swa_map"), expected_token_offset=offset,
                             entry_offsets=w.ref["entry_offsets"], out_cache_loc=hb[loc], report=w.report, tag=w.tag)
    what = "kvc_prepare" + (" + kvc_expand" if case["materialize"] else "") + " (HEAD batch)"
    w.assert_equal(*PLAN_WRITE, *(PLAN_ENTRIES if case["materialize"] else ()), what=what)
    w.assert_sink(what)
    w.checkpoint()
    write_and_check(w, ctx, plan, "head.", loc, "kvc_write along the HEAD plan")

    tail = w.batch(t["batch"], "tail.")
    for k, v in (("entry_offsets", t["entry_offsets"]), *zip(("num_valid", "enable"), t["flags"] or ())):
        if v is not None:
            w.np[k][...] = v
            w.ref[k][...] = v
    tb = w.host_batch("tail.")
    # The reference defines the entries for non-decreasing offsets over the TAIL's requests (a
    # TAIL larger than HEAD also reads stale offsets past HEAD's batch).
    defined = bool(np.all(np.diff(w.ref["entry_offsets"][:len(tb["req_pool_indices"]) + 1]) >= 0))
    how = f"a TAIL batch ({', '.join(t['changes']) or 'unchanged'}; offsets {'' if defined else 'not '}non-decreasing)"
    kc.fused_verify(ctx, tail, plan, swa_window=window, swa_map=swa_map, check_expected_token=case["check"])
    ref_fused(w, tb, window, cap, case["check"], offset)
    w.assert_sink(f"fused verify of {how}", rows_defined=defined)
    w.checkpoint(*(() if defined else ("skips", "write_index", "claim")))
    if case["materialize"]:
        ops.prepare_build_plan(tail, plan, swa_window=window, swa_map=swa_map, ctx=ctx)[1]()  # kvc_expand alone
        ref_expand(w, tb, window, cap, offset)
        if defined:
            w.assert_equal(*PLAN_ENTRIES, what=f"kvc_expand over HEAD's offsets and {how}")
        w.checkpoint(*PLAN_ENTRIES)
        kc.verify(ctx, plan, check_expected_token=case["check"])
        ref_verify(w, case["check"])
        w.assert_sink("kvc_verify of the plan kvc_expand made")
        w.checkpoint()
    w.assert_untouched("after every launch")


@fuzz(300)
@given(case=plan_cases())
def test_plan_builder_fused_verify_expand_write(emulator, case):
    """kvc_prepare + kvc_expand on a hostile batch, kvc_write along the plan, then a TAIL batch the
    engine changed (other rows, longer prefixes, another size, a narrower req_to_token, entry
    offsets or flags overwritten) through kvc_fused_verify(_wide) and kvc_expand + kvc_verify(_wide)."""
    run(case, plan_flow)


# ---- kvc_verify on garbage plans -------------------------------------------------------------------------
@st.composite
def verify_cases(draw, capacity: int | None = None):
    eng = draw(fc.engines(swa=False))
    ns, cap = eng["num_slots"], capacity or draw(st.sampled_from([1, 8, 40, 300]))
    rng, rate = np.random.default_rng(draw(fc.seeds)), draw(fc.rates)
    chain = rng.permutation(np.arange(1, max(ns, 2)))[:cap]  # a stamped chain, then garbled
    fc.stamp(eng, {"req_to_token": chain.astype(np.int32)[None, :]}, rng)
    n = len(chain)
    poison = fc.plan_poison(rng, 1, cap)
    words = eng["canary"].view(np.int64)
    poison["slot"][:n] = chain
    poison["prev_slot"][:n] = np.concatenate([[abi.CHAIN_HEAD], chain[:-1]])
    poison["expected_position"][:n] = np.arange(n)
    poison["expected_token"][:n] = words[np.minimum(chain, ns - 1), abi.FIELD_TOKEN]
    for k, lo, hi in (("slot", 1, ns - 1), ("prev_slot", -1, ns - 1), ("expected_position", 0, 12),
                      ("expected_token", -1, 1000)):
        mask = rng.random(cap) < rate
        poison[k][mask] = fc.bulk(rng, int(mask.sum()), lo, hi, fc.slot_pool(ns), 0.5)
    poison["num_valid"][0] = draw(st.sampled_from(2 * [n, cap, cap + 1, fc.I32_MAX, n // 2] + [0, -1, fc.I32_MIN]))
    poison["enable"][0] = draw(st.sampled_from([1, 1, 1, -1, 2, 0]))
    return dict(placement=draw(st.sampled_from(guarded.PLACEMENTS)), engine=eng, sink=draw(fc.sinks(capacity=None)),
                capacity=cap, poison=poison, check=draw(st.booleans()))


def verify_flow(case) -> None:
    w = World(case["placement"])
    ctx = w.context(case["engine"], case["sink"], abi.LaunchTag.TAIL_V_FULL)
    plan = w.plan(1, case["capacity"], True, case["poison"])
    kc.verify(ctx, plan, check_expected_token=case["check"])
    ref_verify(w, case["check"])
    w.assert_sink(f"kvc_verify{'_wide' if max(ctx.hash_bytes, default=0) >= abi.WIDE_HASH_BYTES else ''}")
    w.checkpoint()
    w.assert_untouched("after kvc_verify")


@fuzz(200)
@given(case=verify_cases())
def test_verify_on_garbage_plans(emulator, case):
    """kvc_verify(_wide): slots, predecessors, positions and tokens garbled (negative, 0, past the
    buffer, markers, extremes), num_valid past the capacity or negative, enable garbage."""
    run(case, verify_flow)


# ---- kvc_write on garbage write plans ----------------------------------------------------------------------
@st.composite
def write_cases(draw):
    eng = draw(fc.engines(swa=False))
    ns, max_batch = eng["num_slots"], draw(fc.sizes(1, 8))
    rng, rate = np.random.default_rng(draw(fc.seeds)), draw(fc.rates)
    T = draw(st.sampled_from([*range(1, 31), 0]))
    poison = fc.plan_poison(rng, max_batch, 1)
    if draw(st.sampled_from([True, True, True, False])):  # consecutive ranges, a few values garbled below
        poison["offsets"] = np.concatenate([[0], np.cumsum(rng.integers(0, 6, max_batch))]).astype(np.int64)
    n_poke = draw(fc.sizes(0, 3))
    for i, v in zip(draw(st.lists(fc.sizes(0, max_batch), min_size=n_poke, max_size=n_poke)),
                    draw(st.lists(fc.hostile(0, T, T), min_size=n_poke, max_size=n_poke))):
        poison["offsets"][i] = v
    poison["seed"] = np.array(draw(st.lists(fc.hostile(-1, ns - 1, ns, fc.MARKERS), min_size=max_batch,
                                            max_size=max_batch)), np.int64)
    poison["num_valid_reqs"][0] = draw(st.sampled_from(2 * [max_batch, max_batch + 1, fc.I32_MAX, max_batch // 2]
                                                       + [0, -1, fc.I32_MIN]))
    tokens = {"input_ids": fc.bulk(rng, T, 0, 1000, fc.extremes(0), rate),
              "positions": fc.bulk(rng, T, 0, 20, fc.extremes(20), rate),
              "out_cache_loc": fc.bulk(rng, T, 1, ns - 1, fc.slot_pool(ns), rate)}
    if draw(st.booleans()):  # distinct slots where the buffer has enough: requests then rarely overlap
        loc = np.resize(rng.permutation(np.arange(1, max(ns, 2))), T)
        tokens["out_cache_loc"] = np.where(rng.random(T) < rate, tokens["out_cache_loc"], loc)
    if draw(st.booleans()):
        tokens["expected_input_ids"] = np.where(rng.random(T) < 0.2, ~tokens["input_ids"], tokens["input_ids"])
        tokens["expected_positions"] = np.where(rng.random(T) < 0.2, tokens["positions"] + 1, tokens["positions"])
    return dict(placement=draw(st.sampled_from(guarded.PLACEMENTS)), engine=eng, sink=draw(fc.sinks()),
                max_batch=max_batch, poison=poison, tokens=tokens)


def write_flow(case) -> None:
    w = World(case["placement"])
    ctx = w.context(case["engine"], case["sink"], abi.LaunchTag.TAIL_K_FULL)
    plan = w.plan(case["max_batch"], 1, False, case["poison"])
    for k, v in case["tokens"].items():
        w.add("t." + k, v)
    write_and_check(w, ctx, plan, "t.", "out_cache_loc", "kvc_write on a garbage write plan")
    w.assert_untouched("after kvc_write")


@fuzz(200)
@given(case=write_cases())
def test_write_on_garbage_write_plans(emulator, case):
    """kvc_write: offsets garbled or hostile, seeds hostile (incl. slot 0, -2, -3, SEED_INVALID +
    field, past the buffer, extremes), num_valid_reqs past the capacity or negative, slots and
    tokens hostile, the assert flag garbage."""
    run(case, write_flow)


def ring_of_one(case: dict) -> dict:
    """A verify case with a ring of one row and every entry of its 60 active."""
    case["sink"]["ring"] = case["sink"]["ring"][:1].copy()
    case["poison"]["num_valid"][0], case["poison"]["enable"][0] = 60, 1
    return case


@fuzz(40)
@given(case=verify_cases(capacity=60).map(ring_of_one))
def test_ring_capacity_one_many_violations(emulator, case):
    """Capacity 1 and up to 60 violations in one launch: every one is counted (write index or
    claim), one row is kept and it is one of the rows found."""
    run(case, verify_flow)


@pytest.mark.parametrize("placement,index", [("end", 5), ("start", -1)])
def test_guard_pages_turn_a_stray_access_into_a_failure(placement, index):
    """The harness itself: in-bounds accesses run, one element past the end ("end") or before the
    start ("start") faults in the child and fails in the parent as an out-of-bounds access."""
    def touch(i):
        arena = guarded.Arena(placement)
        view, array = arena.put(np.arange(5, dtype=np.int64))
        assert array.tolist() == [0, 1, 2, 3, 4]
        guarded.note("touch")
        ctypes.c_int64.from_address(view.ptr + 8 * i).value += 1
    guarded.run_forked(lambda: touch(4 if index > 0 else 0))
    with pytest.raises(AssertionError, match="out-of-bounds access in touch"):
        guarded.run_forked(lambda: touch(index))


def test_snapshot_fixed_size(emulator):
    """kvc_snapshot copies exactly the n status words the host chose into the slot and then the
    ticket (no index comes from device memory, so a guarded run is all there is to fuzz)."""
    def flow():
        w = World("end")
        for n, block in ((1, 32), (7, 32), (300, 256)):
            status = w.add(f"status{n}", np.arange(n, dtype=np.int64) * 3 - 5)
            payload, done = w.add(f"payload{n}", np.zeros(n, np.int64)), w.add(f"done{n}", np.zeros(1, np.int64))
            p = abi.SnapshotParams(status=status.ptr, payload=payload.ptr, done=done.ptr, n=n, ticket=41)
            devices.runtime(0).launch_struct("kvc_snapshot", 1, block, p, driver.PER_THREAD_STREAM)
            assert w.np[f"payload{n}"].tolist() == w.ref[f"status{n}"].tolist() and w.np[f"done{n}"][0] == 41
    guarded.run_forked(flow)


# ---- bugs this suite found (minimal examples, kept as regression tests; both are fixed) ------------------
def _one_request_flow(placement, rtt, rpi, prefix, extend, **extra):
    def flow():
        w = World(placement)
        eng = dict(canary=np.zeros((4, 32), np.uint8), sources=[], mode=abi.HashMode.NONE, assert_flag=0)
        ctx = w.context(eng, dict(ring=np.zeros((4, 8), np.int64), window=False, start=0, kernel_runs=0,
                                  slot_runs=0), abi.LaunchTag.HEAD_K_FULL)
        plan = w.plan(1, 4, True, fc.plan_poison(np.random.default_rng(0), 1, 4))
        b = dict(req_pool_indices=np.array(rpi, np.int64), prefix_lens=np.array(prefix, np.int64),
                 extend_lens=np.array(extend, np.int64), req_to_token=np.array(rtt, np.int32), **extra)
        batch = w.batch(b)
        try:
            kc.build_plan(batch, plan, ctx=ctx)
            kc.fused_verify(ctx, batch, plan)
        except ValidationError:
            pass  # rejected on the host before any launch: a fix
    return flow


# Was: an expected_pool with fewer rows than req_to_token was read out of bounds (kvc_expected_token trusted
# row < rtt_rows <= the pool's rows). Now the host rejects such a pool before any launch.
def test_regression_expected_pool_shorter_than_req_to_token(emulator):
    guarded.run_forked(_one_request_flow("end", [[1], [1]], [1], [1], [0],
                                         expected_pool=np.zeros((1, 1), np.int64)))


# Was: kvc_prepare summed extend_lens in int64 unchecked; a huge extend wrapped the sum and the TOKENS_UNOWNED
# scan indexed out_cache_loc out of bounds. Now each length is clamped to MAX_REQUEST_TOKENS.
def test_regression_extend_lens_sum_overflows(emulator):
    guarded.run_forked(_one_request_flow("end", [[1], [1]], [1], [0], [fc.I64_MAX],
                                         out_cache_loc=np.array([-1], np.int64)))
