"""The lost-write check of a fingerprinting write (docs/format.md §7.1, issue 43, fault class K14),
on the CPU reference: expected rows built by hand from the format, never from kernel output."""

import numpy as np
import pytest

from kvcanary.abi import FIELD_POSITION, FIELD_REAL_KV_HASH, FIELD_TOKEN, FailReason
from kvcanary.reference.canary import RefSource, fingerprint
from kvcanary.reference.hashing import mix3, to_i64
from kvcanary.reporting.violations import reason_labels
from tests.test_reference import ANCHOR_H, TAIL, Ctx

LOST = int(FailReason.LOST_WRITE)
SLOTS = 16


def pool(seed=1):
    """One K pool, a 32-byte strip per slot (PARTIAL hashes its first 16 bytes)."""
    return np.random.default_rng(seed).integers(0, 256, (SLOTS, 32), dtype=np.uint8)


def src(kv, hash_bytes=16):
    return RefSource(kv, page_size=1, bytes_per_token=32, hash_bytes=hash_bytes)


def rows(ctx):
    return [tuple(r) for r in ctx.ring[:int(ctx.write_index[0])].tolist()]


def lost_rows(ctx):
    return [r for r in rows(ctx) if r[7] & LOST]


def test_lost_write_bit_is_an_extension_bit_labelled_lost_write():
    assert LOST == 1024 and LOST > int(FailReason.SELF_TEST)
    assert reason_labels(LOST) == ["lost_write"]


@pytest.mark.parametrize("hash_bytes", [16, 32])  # PARTIAL and ALL
def test_a_store_that_never_happened_is_reported_in_the_write(hash_bytes):
    """Slot 5 held token 11 at position 0; the engine "writes" token 12 at position 3 there but its
    store is lost, so the bytes stay token 11's: the write reports it, with the previous record's
    token and position, and still stamps the new record (the chain describes what the model saw)."""
    kv, ctx = pool(), Ctx(SLOTS)
    ctx.write([(-1, [5], [11], [0])], sources=[src(kv, hash_bytes)])
    assert rows(ctx) == []
    ctx.write([(-1, [5], [12], [3])], sources=[src(kv, hash_bytes)])  # no KV store in between
    assert rows(ctx) == [(TAIL, 5, 3, 12, 11, to_i64(ANCHOR_H), 0, LOST)]
    assert ctx.field(5, FIELD_TOKEN) == 12 and ctx.field(5, FIELD_POSITION) == 3


def test_a_real_store_is_not_reported():
    kv, ctx = pool(), Ctx(SLOTS)
    ctx.write([(-1, [5, 6], [11, 12], [0, 1])], sources=[src(kv)])
    kv[5, 0] ^= 1  # the engine stores the new token's KV (here: any change inside the hashed bytes)
    kv[6] = pool(2)[6]
    ctx.write([(-1, [5, 6], [21, 22], [0, 1])], sources=[src(kv)])
    assert rows(ctx) == []


def test_a_rewrite_with_the_same_token_and_bytes_is_legitimate():
    """Slot reuse by the same token at the same position (a prefix-cache eviction and recompute):
    same identity, same bytes, no row; the same token with another prefix or at another position
    over unchanged bytes (layer 0's V does not depend on either) is not reported either."""
    kv, ctx = pool(), Ctx(SLOTS)
    ctx.write([(-1, [3, 4], [7, 8], [0, 1])], sources=[src(kv)])
    ctx.write([(-1, [3, 4], [7, 8], [0, 1])], sources=[src(kv)])  # the same identity again
    ctx.write([(3, [4], [8], [5])], sources=[src(kv)])            # same token, other chain and position
    assert rows(ctx) == []


def test_padding_slot_skipped_entries_and_identity_only_writes_never_report():
    kv, ctx = pool(), Ctx(SLOTS)
    ctx.write([(-1, [0, 5], [1, 2], [0, 1])], sources=[src(kv)])
    ctx.write([(-1, [0, -1, 5], [9, 9, 2], [0, 1, 1])], sources=[src(kv)])  # slot 0: padding; -1: skipped
    assert rows(ctx) == []
    head = Ctx(SLOTS)  # a HEAD buffer: stamped without fingerprints (hash mode NONE, no sources)
    head.write([(-1, [5], [1], [0])])
    head.write([(-1, [5], [2], [0])])
    assert rows(head) == []


def test_an_unknown_token_matches_any():
    """The vLLM connector stamps -1 for a decode token its scheduler did not know (async scheduling);
    a preempted request recomputed into the same slot re-stamps it with the known token over the same
    bytes: not a lost write. Nor is the reverse, or -1 over -1."""
    kv, ctx = pool(), Ctx(SLOTS)
    ctx.write([(-1, [5, 6], [-1, 7], [34, 35])], sources=[src(kv)])
    ctx.write([(-1, [5, 6], [762, -1], [34, 35])], sources=[src(kv)])
    ctx.write([(-1, [5], [-1], [36])], sources=[src(kv)])
    assert rows(ctx) == []


def test_a_never_written_slot_of_a_zeroed_pool_that_stays_zero_is_a_lost_write():
    """A record never written holds zeros, and so do its hashed bytes in a zeroed pool (the
    fingerprint of zero bytes is 0): a write whose store was lost into a fresh slot is reported;
    into a pool not zeroed, or for token 0, it is not (docs/format.md §7.1, limits)."""
    kv = np.zeros((SLOTS, 32), np.uint8)
    assert int(fingerprint([5], [src(kv)])[0]) == 0
    ctx = Ctx(SLOTS)
    ctx.write([(-1, [5, 6], [12, 0], [0, 1])], sources=[src(kv)])
    h1 = to_i64(mix3(ANCHOR_H, 12, 0))
    assert rows(ctx) == [(TAIL, 5, 0, 12, 0, to_i64(ANCHOR_H), 0, LOST)]
    fresh = Ctx(SLOTS)
    fresh.write([(-1, [5], [12], [0])], sources=[src(pool())])
    assert rows(fresh) == [] and h1 != 0


def test_a_slot_written_twice_by_one_request_is_checked_in_order():
    """Entries are checked in order against the record the slot holds just before each is stamped:
    the second occurrence of slot 5 finds the first's record over the same bytes: one row for it."""
    kv, ctx = pool(), Ctx(SLOTS)
    ctx.write([(-1, [5, 5], [11, 12], [0, 1])], sources=[src(kv)])
    h1 = to_i64(mix3(ANCHOR_H, 11, 0))
    assert rows(ctx) == [(TAIL, 5, 1, 12, 11, h1, 0, LOST)]


def test_lost_write_rows_are_attributed_to_their_request():
    from kvcanary.reference.ring import Verdicts
    kv, ctx = pool(), Ctx(SLOTS)
    ctx.write([(-1, [2], [4], [0]), (-1, [5], [11], [0])], sources=[src(kv)])
    verdicts = Verdicts(np.zeros(4, np.uint64), np.zeros(1, np.int64), np.full(len(ctx.ring), -1, np.int64))
    from kvcanary.reference.canary import write
    write(canary=ctx.canary, offsets=np.array([0, 1, 2], np.int64), seed=np.array([-1, -1], np.int64),
          num_valid_reqs=np.array([2], np.int32), input_ids=np.array([4, 12], np.int64),
          positions=np.array([0, 0], np.int64), out_cache_loc=np.array([2, 5], np.int64), sources=[src(kv)],
          tag=TAIL, verdicts=verdicts, **ctx.sink())
    assert [r[1] for r in lost_rows(ctx)] == [5]
    assert verdicts.words.tolist() == [0, LOST, 0, 0] and int(verdicts.failed[0]) == 1


def test_long_clean_run_with_slot_churn_and_identical_rewrites_reports_nothing():
    """500 steps over 64 slots: each step frees and reallocates slots at random, stores the new
    tokens' KV (a function of token, position and chain, as a model's deeper layers) and stamps
    them; one in four reuses a slot for the token it already held at the same position (identical
    bytes, identical record). Nothing is reported; then one store lost is caught at once."""
    rng = np.random.default_rng(43)
    n = 64
    kv = np.zeros((n, 32), np.uint8)
    ctx = Ctx(n, ring_capacity=8)
    held = {}

    def content(token, position, chain):
        return np.random.default_rng([token, position, chain & 0xFFFFFFFF]).integers(0, 256, 32, dtype=np.uint8)

    for _ in range(500):
        slots = rng.choice(np.arange(1, n), 4, replace=False)
        reqs = []
        for s in slots.tolist():
            if s in held and rng.random() < 0.25:
                token, position = held[s]
            else:
                token, position = int(rng.integers(0, 1000)), int(rng.integers(0, 100))
            kv[s] = content(token, position, ANCHOR_H)
            held[s] = (token, position)
            reqs.append((-1, [s], [token], [position]))
        ctx.write(reqs, sources=[src(kv, 32)])
    assert rows(ctx) == []
    s = 7
    token = held[s][0] + 1
    ctx.write([(-1, [s], [token], [0])], sources=[src(kv, 32)])  # its KV store is lost
    assert lost_rows(ctx) == [(TAIL, s, 0, token, held[s][0], to_i64(ANCHOR_H), held[s][1], LOST)]


def test_record_fields_keep_format_v1():
    """The check reads the v1 record (TOKEN, POSITION, REAL_KV_HASH) and stores the same four fields."""
    kv, ctx = pool(), Ctx(SLOTS)
    ctx.write([(-1, [5], [11], [0])], sources=[src(kv)])
    assert ctx.field(5, FIELD_REAL_KV_HASH) == to_i64(int(fingerprint([5], [src(kv)])[0]))


def test_the_manager_logs_exports_and_fails_the_request_of_a_lost_write(caplog):
    """Through KvCanary (host backend, mode fail_request): two requests decode; in step 2 request 1's
    slot is a slot request 0 freed in step 1, and its store is lost (the bytes stay request 0's). The
    TAIL writes report it: a log line and a JSON record that say lost_write, and a FailedRequest for
    batch index 1 only, with that slot."""
    import logging

    import kvcanary as kc
    n = 32
    k, v = np.zeros((n, 32), np.uint8), np.zeros((n, 32), np.uint8)
    records = []
    canary = kc.KvCanary(kc.PoolGroup(n, [kc.source_from_slots(k)], [kc.source_from_slots(v)]), device=None,
                         max_batch=2, mode="fail_request", export=records.append)
    rtt = np.zeros((3, 8), np.int32)

    def step(slots, tokens, positions, stores):
        rtt[1, positions[0]], rtt[2, positions[1]] = slots
        b = kc.Batch(np.array([1, 2]), np.array(positions), np.ones(2, np.int64), rtt.copy(),
                     input_ids=np.array(tokens), positions=np.array(positions), out_cache_loc=np.array(slots))
        canary.before_forward(b)
        for s, t, store in zip(slots, tokens, stores):  # the forward: each token's K and V, unless lost
            if store:
                k[s] = np.random.default_rng([t, 0]).integers(1, 256, 32, dtype=np.uint8)
                v[s] = np.random.default_rng([t, 1]).integers(1, 256, 32, dtype=np.uint8)
        canary.after_forward(b)

    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        step([5, 6], [100, 200], [0, 0], [True, True])
        rtt[1, 0] = 9  # request 0's first token moved (its slot 5 freed and handed to request 1)
        k[9], v[9] = k[5], v[5]
        step([9, 5], [101, 201], [0, 1], [True, False])  # request 1's store into slot 5 is lost
        canary.flush()
    lines = [r.getMessage() for r in caplog.records if "kv_canary violation" in r.getMessage()]
    assert len(lines) == 2 and all("fail_reason=lost_write slot_idx=5 position=1 stored_token=201 "
                                   "expected_token=100" in line for line in lines), lines
    rows = [r for r in records if r["type"] == "violation"]
    assert {r["launch_tag"] for r in rows} == {"TAIL_K_FULL", "TAIL_V_FULL"}
    assert all(r["fail_reason"] == ["lost_write"] and r["fail_reason_bits"] == LOST for r in rows)
    failed = [r for r in records if r["type"] == "failed_request"]
    assert [(f["batch_index"], f["reasons"], f["slots"]) for f in failed] == [(1, "lost_write", [5])], failed
    assert any("kv_canary failed request: step=1 batch_index=1 fail_reason=lost_write slots=[5]" in r.getMessage()
               for r in caplog.records)


def test_a_buffer_stamped_by_a_format_v1_writer_is_checked_and_still_verifies():
    """Records stamped by another format v1 implementation (SGLang's canary; here one written from
    docs/format.md §3/§7 alone, in plain Python) carry what the check reads: kvcanary's next write over them
    reports a lost store and stays silent for a real one, and the buffer verifies as before."""
    import struct

    from kvcanary.reference.canary import verify
    M64 = (1 << 64) - 1

    def sm(x):
        x &= M64
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & M64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & M64
        return x ^ (x >> 31)

    def fold(strip):
        h = 0
        for (w,) in struct.iter_unpack("<Q", strip):
            h = sm(h ^ w)
        return sm(0 ^ h)

    kv, ctx = pool(), Ctx(SLOTS)
    running = sm(0xC0FFEE1234567890)
    for pos, (slot, token) in enumerate([(3, 50), (4, 51)]):  # a v1 writer stamps a request of two tokens
        rec = struct.pack("<qqQQ", token, pos, running, fold(kv[slot, :16].tobytes()))
        ctx.canary[slot, :32] = np.frombuffer(rec, np.uint8)
        running = sm(sm(sm(running) ^ token) ^ pos)
    kv[4, :16] ^= 0xFF  # slot 4's new token's KV is stored; slot 3's store is lost
    ctx.write([(-1, [3, 4], [60, 61], [0, 1])], sources=[src(kv)])
    assert [r[1] for r in lost_rows(ctx)] == [3] and rows(ctx)[0][4] == 50
    ring = np.zeros((8, 8), np.int64)
    verify(canary=ctx.canary, slot=np.array([3, 4]), expected_token=np.array([60, 61]),
           expected_position=np.array([0, 1]), prev_slot=np.array([-1, 3]), num_valid=np.array([2], np.int32),
           enable=np.array([1], np.int32), ring=ring, write_index=(wi := np.zeros(1, np.int32)),
           kernel_run_counter=np.zeros(1, np.int64), slot_run_counter=np.zeros(1, np.int64),
           sources=[src(kv)], tag=TAIL, check_expected_token=True)
    assert int(wi[0]) == 0  # the stamped records verify (the lost store is invisible from here on)
