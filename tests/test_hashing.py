"""docs/format.md §3 hashing: pinned vectors typed in by hand, and the numpy variants against the int ones."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary import abi
from kvcanary.reference.canary import RefSource, fingerprint
from kvcanary.reference.hashing import (
    ANCHOR_HASH,
    as_u64,
    mix3,
    mix3_np,
    sm,
    sm_np,
    to_i64,
    to_u64,
)

U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)

STRIP = bytes([0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80,
               0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF])


def test_pinned_sm_vectors():
    assert sm(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    assert sm(1) == 0x5692161D100B05E5
    assert sm(0xFFFFFFFFFFFFFFFF) == 0xB4D055FCF2CBBD7B
    assert sm(0xC0FFEE1234567890) == 0xDE7FAE23A9A1B716
    assert sm(0) == 0
    assert abi.ANCHOR == 0xC0FFEE1234567890
    assert ANCHOR_HASH == 0xDE7FAE23A9A1B716


def test_pinned_sm_vectors_numpy():
    x = np.array([0x9E3779B97F4A7C15, 1, 0xFFFFFFFFFFFFFFFF, 0xC0FFEE1234567890, 0], dtype=np.uint64)
    want = [0xE220A8397B1DCDAF, 0x5692161D100B05E5, 0xB4D055FCF2CBBD7B, 0xDE7FAE23A9A1B716, 0]
    got = sm_np(x)
    assert got.dtype == np.uint64
    assert [int(v) for v in got] == want
    assert [int(v) for v in x] == [0x9E3779B97F4A7C15, 1, 0xFFFFFFFFFFFFFFFF, 0xC0FFEE1234567890, 0]


def test_int64_input_is_read_as_its_bit_pattern():
    assert sm(-1) == 0xB4D055FCF2CBBD7B
    assert int(sm_np(np.array([-1], dtype=np.int64))[0]) == 0xB4D055FCF2CBBD7B
    assert mix3(-1, -2, -3) == mix3(2**64 - 1, 2**64 - 2, 2**64 - 3)


def _strip_source(strip: bytes, hash_bytes: int, bytes_per_token: int = 16) -> RefSource:
    data = np.zeros((1, bytes_per_token), dtype=np.uint8)
    data[0, :len(strip)] = np.frombuffer(strip, dtype=np.uint8)
    return RefSource(data, page_size=1, bytes_per_token=bytes_per_token, hash_bytes=hash_bytes)


def test_pinned_real_kv_vector_partial_and_all():
    # Per-source hash by hand from §3: words are little-endian, h = sm(sm(0 ^ w0) ^ w1).
    w0, w1 = 0x8040201008040201, 0xFFC0A09088848281
    assert int.from_bytes(STRIP[:8], "little") == w0
    assert int.from_bytes(STRIP[8:], "little") == w1
    assert sm(sm(w0) ^ w1) == 0xF036E30B6961C78D
    assert sm(0xF036E30B6961C78D) == 0x6041580849E6407D
    # PARTIAL: 16 bytes of a wider token; ALL: read_bytes == 16 == bytes_per_token.
    partial = _strip_source(STRIP, hash_bytes=16, bytes_per_token=64)
    full = _strip_source(STRIP, hash_bytes=16, bytes_per_token=16)
    for src in (partial, full):
        got = fingerprint(np.array([0], dtype=np.int64), [src])
        assert got.dtype == np.uint64
        assert int(got[0]) == 0x6041580849E6407D


def test_fingerprint_without_sources_is_zero():
    assert fingerprint(np.arange(5, dtype=np.int64), []).tolist() == [0] * 5


@settings(max_examples=200, deadline=None)
@given(st.lists(U64, min_size=1, max_size=20))
def test_sm_np_matches_sm(values):
    got = sm_np(np.array(values, dtype=np.uint64))
    assert [int(v) for v in got] == [sm(v) for v in values]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(U64, I64, I64), min_size=1, max_size=20))
def test_mix3_np_matches_mix3(triples):
    a = np.array([t[0] for t in triples], dtype=np.uint64)
    b = np.array([t[1] for t in triples], dtype=np.int64)
    c = np.array([t[2] for t in triples], dtype=np.int64)
    got = mix3_np(a, b, c)
    assert got.dtype == np.uint64
    assert [int(v) for v in got] == [mix3(*t) for t in triples]
    assert [int(v) for v in mix3_np(a.view(np.int64), b.view(np.uint64), c)] == [int(v) for v in got]


def test_mix3_definition_and_order():
    a, b, c = 0x1234, 7, 3
    assert mix3(a, b, c) == sm(sm(sm(a) ^ b) ^ c)
    assert mix3(a, b, c) != mix3(a, c, b)
    assert mix3(a, b, c) != mix3(b, a, c)
    assert mix3(a, b, c) != mix3(c, b, a)


@given(I64)
def test_bit_pattern_round_trip(i):
    assert to_i64(to_u64(i)) == i
    assert 0 <= to_u64(i) < 2**64
    assert int(as_u64(np.array([i], dtype=np.int64))[0]) == to_u64(i)


def test_to_i64_of_top_bit():
    assert to_i64(0xFFFFFFFFFFFFFFFF) == -1
    assert to_i64(0x8000000000000000) == -(2**63)
    assert to_u64(-1) == 0xFFFFFFFFFFFFFFFF
