"""Hypothesis strategies of hostile kernel inputs for tests/test_fuzz_kernels.py (tests only).

Sizes stay small (a few dozen slots, batches up to 8, rows of up to 10 positions) so that one
example costs a few emulated launches; values are what an engine bug could leave in device
memory: rows 0, -1, past the table, INT64 extremes; lengths negative, past max_len, huge; slots
negative, 0, past the buffer, INT32 extremes, kvcanary's own markers (-1 chain head, -2 unmapped,
-3 predecessor on padding, SEED_INVALID + field); expected-token offsets up to +-2**62 (what the
host allows). Bulk arrays (req_to_token, maps, slots, tokens) come from a numpy generator seeded
by hypothesis, at a hostility rate hypothesis picks; the batch itself is drawn value by value, so
a failing example shrinks to the request that breaks.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvcanary import abi
from kvcanary.abi import HashMode
from kvcanary.reference import canary as reference
from kvcanary.reference import plan as reference_plan

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
FIELD_MAX = int(max(abi.BatchField))
MARKERS = [abi.CHAIN_HEAD, abi.SWA_UNMAPPED, abi.PREV_ON_PADDING, abi.SEED_INVALID, abi.SEED_INVALID + 1,
           abi.SEED_INVALID + FIELD_MAX, abi.SEED_INVALID + FIELD_MAX + 1]


def extremes(bound: int) -> list[int]:
    """Values around a bound and at the ends of int32 and int64."""
    return sorted({I64_MIN, I64_MIN + 1, -(1 << 62), I32_MIN, -3, -2, -1, 0, 1, bound - 1, bound, bound + 1,
                   I32_MAX, 1 << 32, 1 << 62, I64_MAX - 1, I64_MAX})


def hostile(lo: int, hi: int, bound: int, extra=()) -> st.SearchStrategy[int]:
    """Two times in three a plausible value in [lo, hi], else an extreme around ``bound`` (or ``extra``)."""
    plausible = sizes(lo, hi)
    return st.one_of(plausible, plausible, st.sampled_from(extremes(bound) + list(extra)))


def sizes(lo: int, hi: int) -> st.SearchStrategy[int]:
    """A size in [lo, hi], about uniform (st.integers favours the ends; shrinks to lo)."""
    return st.sampled_from(range(lo, max(lo, hi) + 1))


def bulk(rng, shape, lo: int, hi: int, pool, rate: float, dtype=np.int64) -> np.ndarray:
    """Values in [lo, hi] with a fraction ``rate`` replaced by picks from ``pool``."""
    out = rng.integers(lo, max(lo, hi) + 1, shape).astype(dtype)
    mask = rng.random(shape) < rate
    out[mask] = rng.choice(np.asarray(pool, dtype), int(mask.sum()))
    return out


def slot_pool(n: int) -> list[int]:
    """Hostile int64 slots for a buffer of n: the padding slot, the first past the end and the
    markers weigh more (the checks that separate them from real slots are the ones to break)."""
    return extremes(n) + 2 * MARKERS + [0, 0, -1, n, n]


def rtt_pool(n: int) -> list[int]:
    """Hostile int32 entries of req_to_token, checked against n (slots or the SWA map's length)."""
    return [I32_MIN, I32_MIN + 1, -3, -2, -1, 0, 0, 0, n - 1, n, n, n + 1, I32_MAX]


rates = st.sampled_from([0.0, 0.1, 0.4, 0.8])  # bulk values replaced by hostile ones
seeds = st.integers(0, 2**32 - 1)


@st.composite
def engines(draw, *, swa: bool | None = None):
    """The canary's side: buffer (random bytes), sources and hash mode, SWA pool sizes, assert flag."""
    rng = np.random.default_rng(draw(seeds))
    num_slots = draw(sizes(1, 40))
    kind = draw(st.sampled_from(["none", "partial", "all", "wide", "many"]))
    sources = []
    if kind != "none":  # "many": the *_many verifies (MANY_SOURCES or more short strips, ALL)
        count = draw(st.integers(abi.MANY_SOURCES, abi.MANY_SOURCES + 3)) if kind == "many" else draw(st.integers(1, 2))
        for k in range(count):
            page = draw(st.sampled_from([1, 2, 3, 16]))
            bpt = 64 if kind == "wide" and k == 0 else draw(st.sampled_from([16, 32, 48, 80]))
            reads = [r for r in (16, 32, 48, 64, 80) if r <= bpt and (kind != "all" or r < abi.WIDE_HASH_BYTES)]
            read = 64 if kind == "wide" and k == 0 else draw(st.sampled_from(reads))
            pitch = page * bpt + draw(st.sampled_from([0, 0, 16, 48]))  # > row bytes: a column slice
            rows = -(-num_slots // page)
            sources.append((rng.integers(0, 256, (rows, page * bpt), dtype=np.uint8), page, bpt, read, pitch))
    mode = {"none": HashMode.NONE, "partial": HashMode.PARTIAL}.get(kind, HashMode.ALL)
    swa = draw(st.booleans()) if swa is None else swa
    return dict(num_slots=num_slots, full_slots=draw(sizes(1, 48)) if swa else num_slots, swa=swa,
                canary=rng.integers(0, 256, (num_slots, draw(st.sampled_from([32, 40, 64]))), dtype=np.uint8),
                mode=mode, sources=sources, assert_flag=draw(st.sampled_from([0, 1, -1, 7])))


@st.composite
def sinks(draw, capacity: int | None = None):
    """Ring (poisoned), counters, and either a v1 write index or a 64-bit claim with consumed rows."""
    cap = capacity or draw(st.sampled_from([1, 2, 5, 64]))
    rng = np.random.default_rng(draw(seeds))
    window = draw(st.booleans())
    if window:  # the claim counts violations: it stays far below 2**63
        start = draw(st.sampled_from([0, 0, 1, cap, I32_MAX, (1 << 32) + 3, 1 << 62]))
        consumed = draw(st.sampled_from([0, start, start - cap + 1, start + 1, start - 2 * cap, I64_MIN, I64_MAX]))
    else:
        start, consumed = draw(st.sampled_from([0, 0, 0, cap - 1, cap, -1, I32_MAX, I32_MIN])), 0
    return dict(ring=rng.integers(I64_MIN, I64_MAX, (cap, abi.RING_COLS), dtype=np.int64, endpoint=True),
                window=window, start=start, consumed=consumed, skips=int(rng.integers(0, 1 << 40)),
                kernel_runs=int(rng.integers(0, 1 << 40)), slot_runs=int(rng.integers(0, 1 << 40)))


def plan_poison(rng, max_batch: int, capacity: int) -> dict:
    """Stale garbage in every plan array, as a reused plan holds."""
    big = lambda n: rng.integers(I64_MIN, I64_MAX, n, dtype=np.int64, endpoint=True)  # noqa: E731
    small = lambda: rng.integers(I32_MIN, I32_MAX, 1, dtype=np.int32, endpoint=True)  # noqa: E731
    return dict(offsets=big(max_batch + 1), seed=big(max_batch), num_valid_reqs=small(),
                entry_offsets=big(max_batch + 1), num_valid=small(), enable=small(),
                **{k: big(capacity) for k in ("slot", "expected_token", "expected_position", "prev_slot")})


def requests(draw, bs: int, rows: int, max_len: int) -> dict:
    """bs plausible requests (real rows, padding last, prefixes within req_to_token, a few new
    tokens), then up to a few values poked to hostile ones: rows 0 (padding in the middle), -1,
    past the table or extreme; prefixes negative, past max_len or extreme; extends negative or huge."""
    pad = draw(sizes(0, bs // 2)) if draw(st.booleans()) else 0
    rpi = [draw(sizes(1, rows - 1)) for _ in range(bs - pad)] + [0] * pad
    prefix = [draw(st.sampled_from(range(max_len, -1, -1))) for _ in range(bs)]  # simplest: the whole row cached
    extend = [draw(sizes(0, 3)) for _ in range(bs)]
    if bs:
        for _ in range(draw(st.sampled_from([0, 0, 1, 2, 4]))):
            field, r = draw(st.sampled_from([rpi, prefix, extend])), draw(sizes(0, bs - 1))
            bound = rows if field is rpi else max_len if field is prefix else 0
            field[r] = draw(st.sampled_from(extremes(bound)))
    # extends are left hostile: several near INT64_MAX would wrap an unchecked int64 sum (a bug this
    # suite found, test_regression_extend_lens_sum_overflows); each is clamped before it is summed now
    return dict(req_pool_indices=np.array(rpi, np.int64), prefix_lens=np.array(prefix, np.int64),
                extend_lens=np.array(extend, np.int64))


@st.composite
def batches(draw, eng: dict, max_batch: int):
    """An engine batch over a req_to_token of its own, with its tokens, an optional expected-token
    pool and an optional SWA window and map (``eng["swa"]``)."""
    rng, rate = np.random.default_rng(draw(seeds)), draw(rates)
    ns, full = eng["num_slots"], eng["full_slots"]
    rows = draw(st.sampled_from(3 * list(range(2, 7)) + [1]))  # 1: no real row at all
    max_len = draw(st.sampled_from(2 * list(range(1, 11)) + [0]))
    bs = draw(st.sampled_from(3 * list(range(1, max_batch + 1)) + [0]))  # empty batches now and then
    b = requests(draw, bs, rows, max_len)
    # with a map, req_to_token holds full-pool slots, checked against the map's length
    map_len = draw(st.sampled_from([full, full, full - 1, full + 1, 0, full // 2])) if eng["swa"] else full
    b["req_to_token"] = bulk(rng, (rows, max_len), 1, full - 1, rtt_pool(full) + rtt_pool(map_len), rate, np.int32)
    owned = sum(max(int(e), 0) for r, e in zip(b["req_pool_indices"].tolist(), b["extend_lens"].tolist())
                if r != 0)  # Python ints: hostile extends overflow an int64 sum
    T = draw(st.one_of(st.just(owned), sizes(0, 24)) if owned <= 24 else sizes(0, 24))
    b["out_cache_loc"] = padded_tokens(rng, T, owned, full, rate)
    b["input_ids"] = bulk(rng, T, 0, 1000, extremes(0), rate)
    b["positions"] = bulk(rng, T, 0, max_len + 2, extremes(max_len), rate)
    if draw(st.booleans()):
        b["expected_input_ids"] = np.where(rng.random(T) < 0.2, b["input_ids"] + 1, b["input_ids"])
        b["expected_positions"] = np.where(rng.random(T) < 0.2, b["positions"] ^ 1, b["positions"])
    if draw(st.booleans()):
        # A pool with fewer rows than req_to_token is rejected on the host (see
        # test_regression_expected_pool_shorter_than_req_to_token), so the pool here has at least its rows.
        # Lengths and offsets that put a request's last cached position right at the end of
        # what it may read (pos + offset == valid length) come first.
        offset = draw(st.sampled_from([0, 1, -1, 2, 3, -3, 1 << 62, -(1 << 62), max_len, -max_len]))
        pool_len = draw(st.sampled_from([max(0, max_len - 1 + offset), max_len, max_len + 1, max(0, max_len - 1), 0,
                                         max_len + 3]))
        pool_len = min(pool_len, max_len + 3)
        pool_rows = draw(st.sampled_from([rows, rows, rows + 2]))  # the last row ends at the guard
        b["expected_pool"] = bulk(rng, (pool_rows, pool_len), 0, 1000, extremes(0), rate)
        if draw(st.booleans()):
            edge = [min(max(p - 1 + offset, I64_MIN), I64_MAX) for p in b["prefix_lens"].tolist()]
            b["expected_valid_lens"] = np.array([draw(st.one_of(st.just(e), hostile(0, pool_len, pool_len)))
                                                 for e in edge], np.int64)
        b["expected_token_offset"] = offset
    b["swa_window"] = draw(st.sampled_from([0, 0, 1, 2, 3, I32_MAX]))
    if eng["swa"]:
        b["swa_map"] = bulk(rng, max(map_len, 0), 0, ns - 1, slot_pool(ns), rate)
        b["swa_out_cache_loc"] = padded_tokens(rng, T, owned, ns, rate)
    poke_reads(draw, b, ns, full)
    return b


def padded_tokens(rng, T: int, owned: int, n: int, rate: float) -> np.ndarray:
    """Slots of T new tokens: the ``owned`` ones (and a fraction ``rate`` of the rest) real or
    hostile, the tokens past them padding as engines pad (-1 skip, or 0 the padding slot)."""
    loc = bulk(rng, T, 1, n - 1, slot_pool(n), rate)
    padding = (np.arange(T) >= owned) & (rng.random(T) >= rate)
    return np.where(padding, rng.choice(np.array([-1, 0], np.int64), T), loc)


def poke_reads(draw, b: dict, ns: int, full: int) -> None:
    """Hostile values exactly where the kernels read a request's slots: its last cached position
    (the write's seed and the last entry), its window's first entry and the slot before it (where a
    0 is legitimate), in req_to_token or, with a map, in the map entry that position names."""
    rtt, swa_map, window = b["req_to_token"], b.get("swa_map"), b["swa_window"]
    rows, max_len = rtt.shape
    bs = len(b["req_pool_indices"])
    for _ in range(draw(st.sampled_from([0, 1, 2, 3])) if bs else 0):
        r = draw(sizes(0, bs - 1))
        row, prefix = int(b["req_pool_indices"][r]), int(b["prefix_lens"][r])
        if not (1 <= row < rows and 1 <= prefix <= max_len):
            continue
        lo = prefix - window if 0 < window < prefix else 0
        pos = draw(st.sampled_from(sorted({prefix - 1, lo, max(lo - 1, 0)})))
        full_slot = int(rtt[row, pos])
        if swa_map is not None and 0 <= full_slot < len(swa_map) and draw(st.booleans()):
            swa_map[full_slot] = draw(st.sampled_from(slot_pool(ns)))
        else:
            rtt[row, pos] = draw(st.sampled_from(rtt_pool(full)))


@st.composite
def tails(draw, head: dict, max_batch: int):
    """The batch a TAIL launch gets: HEAD's, or one the engine changed since the plan was built."""
    t = {k: v for k, v in head.items() if k not in ("input_ids", "positions", "out_cache_loc", "expected_input_ids",
                                                    "expected_positions", "swa_out_cache_loc")}
    changes = draw(st.sets(st.sampled_from(["rows", "prefix", "resize", "narrow"]), max_size=3))
    rows, max_len = head["req_to_token"].shape
    bs = len(head["req_pool_indices"])
    if "resize" in changes:
        new = draw(sizes(0, max_batch))
        more = requests(draw, max(0, new - bs), rows, max_len)
        for k in ("req_pool_indices", "prefix_lens", "extend_lens"):
            t[k] = np.concatenate([t[k][:new], more[k]])
        if "expected_valid_lens" in t:
            pool_len = head["expected_pool"].shape[1]
            extra = draw(st.lists(hostile(0, pool_len, pool_len), min_size=max(0, new - bs), max_size=max(0, new - bs)))
            t["expected_valid_lens"] = np.concatenate([t["expected_valid_lens"][:new], np.array(extra, np.int64)])
        bs = new
    if "rows" in changes and bs:
        t["req_pool_indices"] = t["req_pool_indices"].copy()
        for i in draw(st.lists(sizes(0, bs - 1), min_size=1, max_size=3)):
            t["req_pool_indices"][i] = draw(st.one_of(st.just(0), hostile(1, rows - 1, rows)))
    if "prefix" in changes and bs:
        t["prefix_lens"] = t["prefix_lens"] + np.array(draw(st.lists(st.sampled_from([0, 1, 3, I32_MAX]), min_size=bs,
                                                                     max_size=bs)), np.int64)
    if "narrow" in changes:  # a req_to_token narrower (or shorter) than at plan time
        t["req_to_token"] = head["req_to_token"][:draw(sizes(1, rows)), :draw(sizes(0, max_len))].copy()
    offsets = draw(st.sampled_from(["plan", "plan", "sorted", "garbage"]))
    garbage = None
    if offsets != "plan":
        garbage = np.array(draw(st.lists(hostile(0, 40, 40), min_size=max_batch + 1, max_size=max_batch + 1)), np.int64)
        garbage = np.sort(garbage) if offsets == "sorted" else garbage
    flags = None
    if draw(st.booleans()):
        flags = (draw(hostile(0, 80, 80).filter(lambda v: I32_MIN <= v <= I32_MAX)), draw(st.sampled_from([0, 1, -1, 2])))
    return dict(batch=t, changes=sorted(changes), entry_offsets=garbage, flags=flags)


def stamp(eng: dict, b: dict, rng) -> None:
    """Stamp each req_to_token row as one request (reference write), so that verifies also meet
    intact chains; then flip a few bytes of the buffer."""
    rtt, canary = b["req_to_token"], eng["canary"]
    rows, max_len = rtt.shape
    loc = reference_plan.map_slots(rtt.reshape(-1).astype(np.int64), b.get("swa_map")) if rows * max_len else \
        np.zeros(0, np.int64)
    srcs = [reference.RefSource(d, page, bpt, 16 if eng["mode"] == HashMode.PARTIAL else read)
            for d, page, bpt, read, _ in eng["sources"]]
    scratch = dict(ring=np.zeros((1, 8), np.int64), write_index=np.zeros(1, np.int32),
                   kernel_run_counter=np.zeros(1, np.int64), slot_run_counter=np.zeros(1, np.int64))
    reference.write(canary=canary, offsets=np.arange(rows + 1, dtype=np.int64) * max_len,
                    seed=np.full(rows, -1, np.int64), num_valid_reqs=np.array([rows], np.int32),
                    input_ids=rng.integers(0, 1000, rows * max_len).astype(np.int64),
                    positions=np.tile(np.arange(max_len, dtype=np.int64), rows), out_cache_loc=loc, sources=srcs,
                    tag=0, **scratch)
    for _ in range(int(rng.integers(0, 3))):
        canary[int(rng.integers(0, canary.shape[0])), int(rng.integers(0, 32))] ^= 1 << int(rng.integers(0, 8))
