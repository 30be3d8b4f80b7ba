"""The CPU reference backend against docs/format.md §3–§7: hand-computed chains, properties, corruptions."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.abi import PREV_ON_PADDING, FailReason, LaunchTag
from kvcanary.reference.canary import RefSource, fingerprint, ring_append, verify, write
from kvcanary.reference.hashing import mix3, slot_hash, sm, to_i64

CHAIN = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
POSITION = int(FailReason.VERIFY_POSITION_MISMATCH)
REAL_KV = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
W_TOKEN = int(FailReason.WRITE_TOKEN_MISMATCH)
W_POSITION = int(FailReason.WRITE_POSITION_MISMATCH)
TOKEN = int(FailReason.VERIFY_TOKEN_MISMATCH)
OOB = int(FailReason.SLOT_OUT_OF_RANGE)
PADDING = int(FailReason.PADDING_SLOT_READ)
HEAD, TAIL = int(LaunchTag.HEAD_K_FULL), int(LaunchTag.TAIL_V_SWA)
ANCHOR_H = 0xDE7FAE23A9A1B716  # sm(ANCHOR), pinned in docs/format.md §3


class Ctx:
    """A canary buffer plus the ring and counters one context owns."""

    def __init__(self, num_slots, ring_capacity=64, stride=32):
        self.canary = np.zeros((num_slots, stride), dtype=np.uint8)
        self.ring = np.zeros((ring_capacity, 8), dtype=np.int64)
        self.write_index = np.zeros(1, dtype=np.int32)
        self.kernel_runs = np.zeros(1, dtype=np.int64)
        self.slot_runs = np.zeros(1, dtype=np.int64)

    def sink(self):
        return dict(ring=self.ring, write_index=self.write_index,
                    kernel_run_counter=self.kernel_runs, slot_run_counter=self.slot_runs)

    def field(self, slot, f):
        return int(self.canary[slot].view("<i8")[f])

    def set_field(self, slot, f, value):
        self.canary[slot].view("<i8")[f] = value

    def write(self, reqs, *, sources=(), tag=TAIL, expected=None, assert_flag=None, num_valid_reqs=None):
        """reqs: list of (seed, slots, tokens, positions); expected: (ids, positions) flat or None."""
        offsets = np.cumsum([0] + [len(r[1]) for r in reqs]).astype(np.int64)
        flat = lambda k: np.array([v for r in reqs for v in r[k]], dtype=np.int64)  # noqa: E731
        kw = {}
        if expected is not None:
            kw = dict(expected_input_ids=np.array(expected[0], np.int64),
                      expected_positions=np.array(expected[1], np.int64))
        if assert_flag is not None:
            kw["chain_position_assert"] = np.array([assert_flag], dtype=np.int32)
        n = len(reqs) if num_valid_reqs is None else num_valid_reqs
        write(canary=self.canary, offsets=offsets, seed=np.array([r[0] for r in reqs], np.int64),
              num_valid_reqs=np.array([n], np.int32), input_ids=flat(2), positions=flat(3),
              out_cache_loc=flat(1), sources=list(sources), tag=tag, **kw, **self.sink())

    def verify(self, entries, *, sources=(), tag=HEAD, check=True, capacity=None, num_valid=None,
               enable=1):
        """entries: list of (slot, expected_token, expected_position, prev_slot)."""
        cap = len(entries) if capacity is None else capacity
        cols = np.zeros((4, cap), dtype=np.int64)
        if entries:
            cols[:, :len(entries)] = np.array(entries, dtype=np.int64).T
        before = self.canary.copy()
        verify(canary=self.canary, slot=cols[0], expected_token=cols[1], expected_position=cols[2],
               prev_slot=cols[3], num_valid=np.array([len(entries) if num_valid is None else num_valid], np.int32),
               enable=np.array([enable], np.int32), sources=list(sources), tag=tag,
               check_expected_token=check, **self.sink())
        assert np.array_equal(self.canary, before), "verify modified the canary buffer"

    def rows(self):
        k = min(int(self.write_index[0]), len(self.ring))
        return [tuple(int(v) for v in r) for r in self.ring[:k]]


def chain_entries(slots, tokens, positions):
    return [(s, t, p, slots[i - 1] if i else -1) for i, (s, t, p) in enumerate(zip(slots, tokens, positions))]


@pytest.mark.parametrize("stride", [32, 48])
def test_five_step_chain_by_hand(stride):
    ctx = Ctx(16, stride=stride)
    slots, tokens, positions = [3, 7, 1, 9, 4], [101, 102, 103, 104, 105], [0, 1, 2, 3, 4]
    ctx.write([(-1, slots, tokens, positions)])
    h = [ANCHOR_H]
    for t, p in zip(tokens, positions):
        h.append(sm(sm(sm(h[-1]) ^ t) ^ p))
    for i, s in enumerate(slots):
        assert ctx.field(s, 0) == tokens[i]
        assert ctx.field(s, 1) == positions[i]
        assert ctx.field(s, 2) == to_i64(h[i])
        assert ctx.field(s, 3) == 0
        assert int(slot_hash(ctx.canary, [s])[0]) == h[i + 1]
    assert int(slot_hash(ctx.canary, [-1])[0]) == ANCHOR_H
    assert (ctx.kernel_runs[0], ctx.slot_runs[0]) == (1, 5)
    ctx.verify(chain_entries(slots, tokens, positions))
    assert ctx.rows() == []
    assert (ctx.kernel_runs[0], ctx.slot_runs[0]) == (2, 10)
    # Decode one more token seeded from the last slot: chain continues from h[5].
    ctx.write([(4, [11], [106], [5])], assert_flag=1)
    assert ctx.field(11, 2) == to_i64(h[5])
    ctx.verify(chain_entries(slots + [11], tokens + [106], positions + [5]))
    assert ctx.rows() == []


# ---- sources -----------------------------------------------------------------------------------------
@st.composite
def layouts(draw):
    page_size = draw(st.sampled_from([1, 16, 64]))
    mode = draw(st.sampled_from(["none", "partial", "all"]))
    num_slots = draw(st.integers(8, 80))
    pages = -(-num_slots // page_size)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sources = []
    for _ in range(0 if mode == "none" else draw(st.integers(0, 4))):
        bpt = draw(st.sampled_from([16, 32, 64]))
        read = draw(st.sampled_from([b for b in (16, 32, 64) if b <= bpt]))
        row_bytes = page_size * bpt + 16 * draw(st.integers(0, 2))
        if draw(st.booleans()):  # a per-layer slice of a bigger [pages, layers, row] buffer
            data = rng.integers(0, 256, (pages, 3, row_bytes), dtype=np.uint8)[:, 1, :]
        else:
            data = rng.integers(0, 256, (pages, row_bytes), dtype=np.uint8)
        sources.append(RefSource(data, page_size, bpt, 16 if mode == "partial" else read))
    return num_slots, sources


I64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=150, deadline=None)
@given(layouts(), st.data())
def test_clean_write_then_verify_reports_nothing(layout, data):
    num_slots, sources = layout
    perm = data.draw(st.permutations(range(1, num_slots)))
    lens = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    reqs, chains, used = [], [], 0
    for n in lens:
        n = min(n, len(perm) - used)
        if n == 0:
            break
        slots = list(perm[used:used + n])
        used += n
        tokens = data.draw(st.lists(I64, min_size=n, max_size=n))
        start = data.draw(st.integers(-(2**40), 2**40))
        positions = list(range(start, start + n))
        reqs.append((-1, slots, tokens, positions))
        chains.append([slots, tokens, positions])
    ctx = Ctx(num_slots)
    ctx.write(reqs, sources=sources)
    assert (ctx.kernel_runs[0], ctx.slot_runs[0]) == (1, used)
    # A decode step extends every request, seeded from its last slot, with the position assert on.
    step = []
    for c in chains:
        s = perm[used] if used < len(perm) else -1
        used += 1
        t = data.draw(I64)
        step.append((c[0][-1], [s], [t], [c[2][-1] + 1]))
        if s > 0:
            c[0].append(s), c[1].append(t), c[2].append(c[2][-1] + 1)
    ctx.write(step, sources=sources, assert_flag=1)
    stamped = sum(1 for r in step if r[1][0] > 0)
    assert (ctx.kernel_runs[0], ctx.slot_runs[0]) == (2, used - len(step) + stamped)
    entries = [e for c in chains for e in chain_entries(*c)]
    before = int(ctx.slot_runs[0])
    ctx.verify(entries, sources=sources, check=True)
    assert ctx.rows() == []
    assert (ctx.kernel_runs[0], ctx.slot_runs[0]) == (3, before + len(entries))
    for c in chains:
        want = fingerprint(np.array(c[0], np.int64), sources)
        got = [ctx.field(s, 3) for s in c[0]]
        assert got == [to_i64(int(v)) for v in want]


def make_layout(page_size=16, bpt=64, hash_bytes=16, num_slots=64, seed=0, strided=False):
    rng = np.random.default_rng(seed)
    pages = -(-num_slots // page_size)
    row = page_size * bpt + 32
    if strided:
        big = rng.integers(0, 256, (pages, 4, row), dtype=np.uint8)
        return big, RefSource(big[:, 2, :], page_size, bpt, hash_bytes)
    data = rng.integers(0, 256, (pages, row), dtype=np.uint8)
    return data, RefSource(data, page_size, bpt, hash_bytes)


def written(ctx, sources=(), n=4, start_pos=10):
    slots, tokens, positions = [5, 17, 2, 33, 40][:n], [7, -3, 2**40, 9, 1][:n], list(range(start_pos, start_pos + n))
    ctx.write([(-1, slots, tokens, positions)], sources=sources)
    return slots, tokens, positions


def sh(ctx, s):
    return int(slot_hash(ctx.canary, [s])[0])


@pytest.mark.parametrize("j", [0, 1, 3])
@pytest.mark.parametrize("check", [True, False])
def test_token_corruption(j, check):
    ctx = Ctx(64)
    slots, tokens, positions = written(ctx)
    ctx.set_field(slots[j], 0, tokens[j] + 1)
    ctx.verify(chain_entries(slots, tokens, positions), check=check)
    want = set()
    stored_prev = ctx.field(slots[j], 2)
    if check:
        want.add((HEAD, slots[j], positions[j], tokens[j] + 1, tokens[j], stored_prev, stored_prev, TOKEN))
    if j + 1 < len(slots):
        k = j + 1
        want.add((HEAD, slots[k], positions[k], tokens[k], tokens[k] if check else -1,
                  ctx.field(slots[k], 2), to_i64(mix3(stored_prev, tokens[j] + 1, positions[j])), CHAIN))
    assert set(ctx.rows()) == want and len(ctx.rows()) == len(want)


def test_expected_token_minus_one_is_unchecked():
    ctx = Ctx(64)
    slots, tokens, positions = written(ctx)
    entries = chain_entries(slots, [-1] * len(slots), positions)
    ctx.set_field(slots[3], 0, 12345)
    ctx.verify(entries, check=True)
    assert ctx.rows() == []


@pytest.mark.parametrize("j", [0, 2])
def test_position_corruption(j):
    ctx = Ctx(64)
    slots, tokens, positions = written(ctx)
    ctx.set_field(slots[j], 1, 999)
    ctx.verify(chain_entries(slots, tokens, positions))
    pj = ctx.field(slots[j], 2)
    k = j + 1
    assert ctx.rows() == [
        (HEAD, slots[j], 999, tokens[j], tokens[j], pj, pj, POSITION),
        (HEAD, slots[k], positions[k], tokens[k], tokens[k], ctx.field(slots[k], 2),
         to_i64(mix3(pj, tokens[j], 999)), CHAIN),
    ]


@pytest.mark.parametrize("j", [0, 2])
def test_prev_hash_corruption(j):
    ctx = Ctx(64)
    slots, tokens, positions = written(ctx)
    good = ctx.field(slots[j], 2)
    ctx.set_field(slots[j], 2, good ^ 1)
    ctx.verify(chain_entries(slots, tokens, positions))
    k = j + 1
    assert ctx.rows() == [
        (HEAD, slots[j], positions[j], tokens[j], tokens[j], good ^ 1, good, CHAIN),
        (HEAD, slots[k], positions[k], tokens[k], tokens[k], ctx.field(slots[k], 2),
         to_i64(mix3(good ^ 1, tokens[j], positions[j])), CHAIN),
    ]
    if j == 0:
        assert good == to_i64(ANCHOR_H)


def test_real_kv_field_corruption_with_and_without_sources():
    data, src = make_layout()
    ctx = Ctx(64)
    slots, tokens, positions = written(ctx, [src])
    ctx.set_field(slots[1], 3, ctx.field(slots[1], 3) + 1)
    ctx.verify(chain_entries(slots, tokens, positions), sources=[src])
    p1 = ctx.field(slots[1], 2)
    assert ctx.rows() == [(HEAD, slots[1], positions[1], tokens[1], tokens[1], p1, p1, REAL_KV)]
    # A buffer stamped with fingerprints verified without sources: every nonzero hash is reported.
    ctx2 = Ctx(64)
    slots, tokens, positions = written(ctx2, [src])
    ctx2.verify(chain_entries(slots, tokens, positions), sources=[])
    assert [r[1] for r in ctx2.rows()] == slots and {r[7] for r in ctx2.rows()} == {REAL_KV}


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("hash_bytes", [16, 48])
@pytest.mark.parametrize("strided", [False, True])
def test_real_kv_byte_inside_window_detected_outside_not(page_size, hash_bytes, strided):
    buf, src = make_layout(page_size=page_size, bpt=64, hash_bytes=hash_bytes, num_slots=64, strided=strided)
    ctx = Ctx(64)
    slots, tokens, positions = written(ctx, [src])
    entries = chain_entries(slots, tokens, positions)
    s = slots[2]
    row, col = s // page_size, (s % page_size) * 64
    view = src.data  # the live view: writing it writes the bigger buffer
    for off in (hash_bytes, 63):  # outside the hashed window of slot s, inside its token
        view[row, col + off] ^= 0xFF
    view[row, page_size * 64 + 5] ^= 0xFF  # row bytes past page_size * bytes_per_token
    if strided:
        buf[row, 1, col] ^= 0xFF  # another layer of the bigger buffer
    ctx.verify(entries, sources=[src])
    assert ctx.rows() == []
    for off in (0, hash_bytes - 1):
        view[row, col + off] ^= 0x01
        ctx.verify(entries, sources=[src])
        p = ctx.field(s, 2)
        assert ctx.rows()[-1] == (HEAD, s, positions[2], tokens[2], tokens[2], p, p, REAL_KV)
        view[row, col + off] ^= 0x01
    assert int(ctx.write_index[0]) == 2


def test_strided_source_reads_the_live_buffer_not_a_copy():
    big, src = make_layout(page_size=16, strided=True)
    assert src.data.strides[0] == 4 * src.data.shape[1] and np.shares_memory(src.data, big)
    slots = np.array([1, 20, 47], np.int64)
    before = fingerprint(slots, [src])
    big[20 // 16, 2, (20 % 16) * 64] ^= 0x80
    after = fingerprint(slots, [src])
    assert before[0] == after[0] and before[2] == after[2] and before[1] != after[1]
    dense = RefSource(np.ascontiguousarray(src.data), 16, 64, 16)
    assert np.array_equal(fingerprint(slots, [dense]), after)


def test_short_rows_read_only_the_bytes_a_slot_names():
    # 40-byte rows, page_size 2, 32 bytes per token: slot 0's strip fits, slot 1's would not.
    data = np.arange(40, dtype=np.uint8).reshape(1, 40)
    src = RefSource(data, 2, 32, 16)
    w0, w1 = int.from_bytes(bytes(range(8)), "little"), int.from_bytes(bytes(range(8, 16)), "little")
    assert int(fingerprint(np.array([0]), [src])[0]) == sm(sm(sm(w0) ^ w1))


def test_multi_source_combination_by_hand():
    a = np.arange(64, dtype=np.uint8).reshape(2, 32)
    b = (255 - np.arange(64, dtype=np.uint8)).reshape(2, 32)
    srcs = [RefSource(a, 1, 32, 16), RefSource(b, 1, 32, 32)]

    def strip_hash(row_bytes):
        h = 0
        for w in range(len(row_bytes) // 8):
            h = sm(h ^ int.from_bytes(bytes(row_bytes[8 * w:8 * w + 8]), "little"))
        return h
    want = sm(sm(strip_hash(a[1, :16])) ^ strip_hash(b[1, :32]))
    assert int(fingerprint(np.array([1]), srcs)[0]) == want
    assert int(fingerprint(np.array([1]), srcs[::-1])[0]) != want


# ---- plan semantics: slot 0, predecessors, ranges, counters -----------------------------------
def test_predecessor_slot_zero_means_unchecked_chain():
    ctx = Ctx(64)
    slots, tokens, positions = written(ctx)
    ctx.set_field(slots[2], 2, 77)
    entries = chain_entries(slots, tokens, positions)
    entries[2] = (slots[2], tokens[2], positions[2], 0)
    entries[3] = (slots[3], tokens[3], positions[3], 0)
    ctx.verify(entries)
    assert ctx.rows() == []
    entries[2] = (slots[2], tokens[2], positions[2] + 1, 0)
    ctx.verify(entries)
    assert ctx.rows() == [(HEAD, slots[2], positions[2], tokens[2], tokens[2], 77, 77, POSITION)]


def test_slot_zero_entries_are_reported_and_counted():
    # docs/format.md §6/§8: a plan entry is a real request's, and a real request never reads the padding slot
    ctx = Ctx(8)
    ctx.set_field(0, 0, 5)
    ctx.verify([(0, 1, 2, 3), (0, 9, 9, -1)])
    assert ctx.rows() == [(HEAD, 0, 2, 0, -1, 0, 0, PADDING), (HEAD, 0, 9, 0, -1, 0, 0, PADDING)]
    assert ctx.slot_runs[0] == 2 and ctx.kernel_runs[0] == 1


def test_required_predecessor_on_the_padding_slot_is_reported_unchecked():
    # plan prev PREV_ON_PADDING (-3): the chain is not checked, bit PADDING_SLOT_READ is set;
    # prev 0 (a legitimate zero, e.g. an SWA predecessor outside the window) stays silent
    ctx = Ctx(8)
    ctx.write([(-1, [3], [5], [4])])
    ctx.verify([(3, -1, 4, PREV_ON_PADDING), (3, -1, 4, 0)])
    stored = ctx.field(3, 2)
    assert ctx.rows() == [(HEAD, 3, 4, 5, -1, stored, stored, PADDING)]


def test_out_cache_loc_negative_is_skipped():
    ctx = Ctx(16)
    ctx.write([(-1, [3, -1, 5], [10, 11, 12], [0, 1, 2])], assert_flag=1)
    assert ctx.slot_runs[0] == 2 and ctx.rows() == []
    h1 = mix3(ANCHOR_H, 10, 0)
    assert ctx.field(5, 2) == to_i64(h1)  # the chain did not advance over the skipped entry
    assert ctx.field(5, 0) == 12


def test_repeated_slot_last_write_wins():
    ctx = Ctx(16)
    ctx.write([(-1, [3, 3], [10, 11], [0, 1])])
    assert (ctx.field(3, 0), ctx.field(3, 1), ctx.field(3, 2)) == (11, 1, to_i64(mix3(ANCHOR_H, 10, 0)))
    assert ctx.slot_runs[0] == 2


def test_enable_zero_does_nothing_but_count_the_launch():
    ctx = Ctx(64)
    slots, tokens, positions = written(ctx)
    ctx.set_field(slots[0], 1, 12345)
    runs = int(ctx.slot_runs[0])
    ctx.verify(chain_entries(slots, tokens, positions), enable=0)
    assert ctx.rows() == [] and ctx.kernel_runs[0] == 2 and ctx.slot_runs[0] == runs


@pytest.mark.parametrize("num_valid,active", [(4, 4), (9, 6), (2**31 - 1, 6), (-3, 0), (0, 0)])
def test_num_valid_is_clamped_to_capacity(num_valid, active):
    ctx = Ctx(64)
    slots, tokens, positions = written(ctx, n=4)
    for s in slots:
        ctx.set_field(s, 1, 5000)
    entries = chain_entries(slots, tokens, positions)
    ctx.verify(entries, capacity=6, num_valid=num_valid)
    assert ctx.slot_runs[0] == 4 + active
    # entries past the 4 given ones are zeros: slot 0, which a plan entry never names (reported)
    assert [r[1] for r in ctx.rows()] == slots[:min(active, 4)] + [0] * max(0, active - 4)


def test_write_num_valid_reqs_and_offsets_clamped():
    ctx = Ctx(16)
    reqs = [(-1, [1, 2], [1, 2], [0, 1]), (-1, [3], [3], [0])]
    ctx.write(reqs, num_valid_reqs=1)
    assert ctx.slot_runs[0] == 2 and ctx.field(3, 0) == 0
    ctx.write(reqs, num_valid_reqs=99)
    assert ctx.slot_runs[0] == 5 and ctx.kernel_runs[0] == 2
    ctx.write([], num_valid_reqs=0)
    assert ctx.slot_runs[0] == 5 and ctx.kernel_runs[0] == 3
    # Offsets past T or decreasing give clamped / empty ranges, never an error.
    out = Ctx(16)
    write(canary=out.canary, offsets=np.array([1, 99, 0], np.int64), seed=np.array([-1, -1], np.int64),
          num_valid_reqs=np.array([2], np.int32), input_ids=np.array([4, 5, 6], np.int64),
          positions=np.array([0, 1, 2], np.int64), out_cache_loc=np.array([7, 8, 9], np.int64),
          sources=[], tag=0, **out.sink())
    assert out.slot_runs[0] == 2 and out.field(7, 0) == 0 and out.field(8, 0) == 5


# ---- ring ---------------------------------------------------------------------------------------
def test_ring_overflow_keeps_first_rows_and_counts_all():
    ctx = Ctx(64, ring_capacity=2)
    slots, tokens, positions = written(ctx, n=5)
    for s in slots:
        ctx.set_field(s, 1, -7)
    ctx.verify(chain_entries(slots, tokens, positions), check=False)
    assert int(ctx.write_index[0]) == 5  # one row per entry; positions feed the successor's chain
    assert [r[1] for r in ctx.rows()] == slots[:2] and [r[7] for r in ctx.rows()] == [POSITION, POSITION | CHAIN]
    ctx.verify([(slots[0], -1, 0, 0)])
    assert int(ctx.write_index[0]) == 6 and [r[1] for r in ctx.rows()] == slots[:2]


def test_ring_append_int32_wraparound_never_overwrites():
    ring = np.zeros((4, 8), np.int64)
    wi = np.array([2**31 - 2], np.int32)
    ring_append(ring, wi, np.ones((3, 8), np.int64))
    assert int(wi[0]) == -(2**31) + 1 and not ring.any()
    wi[0] = 3
    ring_append(ring, wi, np.arange(16, dtype=np.int64).reshape(2, 8))
    assert int(wi[0]) == 5 and ring[3].tolist() == list(range(8)) and not ring[:3].any()


# ---- write-side asserts ------------------------------------------------------------------------
def test_expected_input_mismatches():
    ctx = Ctx(16)
    ids, pos = [10, 11, 12, 13], [0, 1, 2, 3]
    ctx.write([(-1, [1, 2, 3, 4], [10, 99, 12, 98], [0, 1, 7, 8])], expected=(ids, pos))
    h = [ANCHOR_H]
    for t, p in zip([10, 99, 12, 98], [0, 1, 7, 8]):
        h.append(mix3(h[-1], t, p))
    assert ctx.rows() == [
        (TAIL, 2, 1, 99, 11, to_i64(h[1]), 1, W_TOKEN),
        (TAIL, 3, 7, 12, 12, to_i64(h[2]), 2, W_POSITION),
        (TAIL, 4, 8, 98, 13, to_i64(h[3]), 3, W_TOKEN | W_POSITION),
    ]
    assert ctx.field(4, 2) == to_i64(h[3]) and ctx.field(4, 0) == 98  # stored the actual values


def test_chain_position_assert():
    ctx = Ctx(16)
    ctx.write([(-1, [1], [5], [9])])
    hs = mix3(ANCHOR_H, 5, 9)
    ctx.write([(1, [2, 3, 4], [6, 7, 8], [10, 12, 13])], assert_flag=1)
    # docs/format.md §7: the chain-position row stores the actual token in EXPECTED_TOKEN (as SGLang does)
    assert ctx.rows() == [(TAIL, 3, 12, 7, 7, to_i64(mix3(hs, 6, 10)), 11, W_POSITION)]
    ctx.write([(1, [5, 6], [6, 7], [10, 12])], assert_flag=0)
    ctx.write([(1, [5, 6], [6, 7], [10, 12])])
    ctx.write([(-1, [5, 6], [6, 7], [10, 12])], assert_flag=1)  # a chain head has no assert
    assert len(ctx.rows()) == 1
    ctx.write([(1, [7], [1], [3])], assert_flag=1, expected=([2], [3]))
    assert ctx.rows()[1:] == [(TAIL, 7, 3, 1, 2, to_i64(hs), 3, W_TOKEN),
                              (TAIL, 7, 3, 1, 1, to_i64(hs), 10, W_POSITION)]


# ---- out-of-range slots (kvcanary SLOT_OUT_OF_RANGE) -------------------------------------------
def test_verify_out_of_range_slot_and_predecessor():
    ctx = Ctx(16)
    ctx.write([(-1, [3, 4], [1, 2], [0, 1])])
    p4 = ctx.field(4, 2)
    ctx.verify([(16, 1, 5, 3), (-4, 1, 6, 3), (4, 2, 1, 99), (4, 2, 1, -2)])
    assert ctx.rows() == [
        (HEAD, 16, 5, 0, -1, 0, 0, OOB),
        (HEAD, -4, 6, 0, -1, 0, 0, OOB),
        (HEAD, 4, 1, 2, 2, p4, 0, CHAIN | OOB),
        (HEAD, 4, 1, 2, 2, p4, 0, CHAIN | OOB),  # -2 (SWA unmapped) is no chain head: out of range
    ]


def test_write_out_of_range_seed_and_slot():
    ctx = Ctx(16)
    ctx.write([(16, [2, 20, 3], [1, 2, 3], [0, 1, 2])], assert_flag=1)
    h1 = mix3(ANCHOR_H, 1, 0)
    assert ctx.rows() == [(TAIL, 16, -1, 0, -1, 0, 0, OOB), (TAIL, 20, 1, 2, -1, to_i64(h1), 0, OOB)]
    assert ctx.field(2, 2) == to_i64(ANCHOR_H) and ctx.field(3, 2) == to_i64(h1)
    assert ctx.slot_runs[0] == 2


def test_write_seed_slot_zero_is_a_real_seed():
    # docs/format.md §7: "Slot 0 is not special in write": a seed of 0 chains from slot 0's record
    ctx = Ctx(16)
    ctx.write([(-1, [0], [9], [4])])                     # a padding write stamps slot 0
    ctx.write([(0, [5], [3], [5])], assert_flag=1)
    h0 = mix3(mix3(ANCHOR_H, 9, 4), 3, 5)
    assert ctx.field(5, 2) == to_i64(mix3(ANCHOR_H, 9, 4)) and ctx.rows() == []
    ctx.write([(0, [6], [3], [9])], assert_flag=1)       # the seed's position (4) drives the assert
    assert ctx.rows() == [(TAIL, 6, 9, 3, 3, to_i64(mix3(ANCHOR_H, 9, 4)), 5, W_POSITION)]
    assert h0 != 0


def test_write_negative_seeds_other_than_chain_head_are_out_of_range():
    ctx = Ctx(16)
    ctx.write([(-2, [2], [1], [0]), (-7, [3], [1], [0])])
    assert ctx.rows() == [(TAIL, -2, -1, 0, -1, 0, 0, OOB), (TAIL, -7, -1, 0, -1, 0, 0, OOB)]
    assert ctx.field(2, 2) == ctx.field(3, 2) == to_i64(ANCHOR_H) and ctx.slot_runs[0] == 2


def test_write_skips_requests_the_plan_builder_rejected():
    # seed SEED_INVALID + field: no stamp, no row (the builder reported it), tokens still owned
    from kvcanary.abi import SEED_INVALID, BatchField
    ctx = Ctx(16)
    ctx.write([(-1, [2], [1], [0]), (SEED_INVALID + int(BatchField.REQ_POOL_INDEX), [3, 4], [5, 6], [0, 1]),
               (-1, [7], [8], [0])])
    assert ctx.rows() == [] and ctx.slot_runs[0] == 2
    assert ctx.field(3, 0) == ctx.field(4, 0) == 0 and ctx.field(7, 0) == 8


def test_write_rows_are_in_request_then_entry_order():
    ctx = Ctx(16)
    ctx.write([(-1, [1, 30, 2], [0, 0, 0], [0, 1, 2]), (99, [31, 3], [0, 0], [0, 1])])
    assert [r[1] for r in ctx.rows()] == [30, 99, 31]


def test_write_reads_seeds_before_its_own_stores():
    ctx = Ctx(16)
    ctx.write([(-1, [1], [5], [0])])
    h = mix3(ANCHOR_H, 5, 0)
    ctx.write([(-1, [1], [6], [0]), (1, [2], [7], [1])])
    assert ctx.field(2, 2) == to_i64(h)


# ---- rate ----------------------------------------------------------------------------------------
def test_verify_rate_identity_only():
    n_req, length = 1000, 1000
    num = n_req * length
    ctx = Ctx(num + 1)
    rng = np.random.default_rng(1)
    slots = (rng.permutation(num) + 1).reshape(n_req, length)
    tokens = rng.integers(0, 150000, (n_req, length))
    offsets = np.arange(0, num + 1, length, dtype=np.int64)
    write(canary=ctx.canary, offsets=offsets, seed=np.full(n_req, -1, np.int64),
          num_valid_reqs=np.array([n_req], np.int32), input_ids=tokens.reshape(-1),
          positions=np.tile(np.arange(length), n_req), out_cache_loc=slots.reshape(-1),
          sources=[], tag=0, **ctx.sink())
    prev = np.concatenate([np.full((n_req, 1), -1), slots[:, :-1]], axis=1).reshape(-1)
    plan = dict(slot=slots.reshape(-1), expected_token=tokens.reshape(-1),
                expected_position=np.tile(np.arange(length), n_req), prev_slot=prev,
                num_valid=np.array([num], np.int32), enable=np.array([1], np.int32))
    t0 = time.perf_counter()
    verify(canary=ctx.canary, **plan, sources=[], tag=0, check_expected_token=True, **ctx.sink())
    dt = time.perf_counter() - t0
    print(f"\nreference verify (identity only, {num} entries): {num / dt / 1e6:.1f} M entries/s")
    assert ctx.rows() == [] and ctx.slot_runs[0] == 2 * num
