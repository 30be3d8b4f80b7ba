"""GPU tier (and the CPU emulator): SglangBatchStager stages an SGLang ForwardBatch in one launch,
into its own buffers, with exactly the values of ``sglang_batch`` on the same ForwardBatch in host
arrays (the reference: the adapter's numpy path, written from its contract) for every forward mode,
int32 / int64 inputs and hostile lengths; the Batch reads the engine's req_to_token in place; a
step of the same shape returns the same Batch object; bad arrays are refused with what was
expected; and a canary fed the staged Batch steps clean and reports a request whose map names
another request's slot."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.adapters import SglangBatchStager, sglang_batch
from kvcanary.runtime import memory

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]

FIELDS = ("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc")
DRAFTS = 3


def forward_batch(seed: int, mode: str, n: int, *, hostile: bool = False, wide=None, prefix_given=True):
    """A host ForwardBatch of ``n`` requests in ``mode`` (int32 / int64 arrays per ``wide``)."""
    rng = np.random.default_rng(seed)
    wide = rng.integers(0, 2, 7).astype(bool) if wide is None else wide
    dt = [np.int64 if w else np.int32 for w in wide]
    rows = rng.permutation(np.arange(1, 4 * n + 1))[:n]
    seq = rng.integers(1, 40, n)
    ext = {"DECODE": np.ones(n, np.int64), "TARGET_VERIFY": np.full(n, DRAFTS)}.get(mode, rng.integers(1, 5, n))
    t = int(ext.sum())  # the tokens the step carries (before a hostile length below)
    if hostile:  # lengths no engine sends: the stager copies them, the canary's plan kernel reports them
        seq[rng.random(n) < 0.3] = rng.choice([-5, 10**9, 2**40])
        if mode not in ("DECODE", "IDLE", "TARGET_VERIFY"):
            ext[rng.random(n) < 0.3] = rng.choice([-3, 2**33])
    fb = SimpleNamespace(forward_mode=SimpleNamespace(name=mode), req_pool_indices=rows.astype(dt[0]),
                         seq_lens=seq.astype(dt[1]), input_ids=rng.integers(0, 1 << 20, t).astype(dt[2]),
                         positions=rng.integers(0, 99, t).astype(dt[3]),
                         out_cache_loc=rng.integers(-1, 5000, t).astype(dt[4]), extend_seq_lens=None,
                         extend_prefix_lens=None, spec_info=SimpleNamespace(draft_token_num=DRAFTS, topk=1))
    if mode not in ("DECODE", "IDLE", "TARGET_VERIFY"):
        fb.extend_seq_lens = ext.astype(dt[5])
        if prefix_given and mode != "DRAFT_EXTEND_V2":
            fb.extend_prefix_lens = (seq - ext).astype(dt[6])
    return fb


def on_device(fb):
    out = SimpleNamespace(**vars(fb))
    for k, v in vars(fb).items():
        if isinstance(v, np.ndarray):
            setattr(out, k, memory.to_device(np.ascontiguousarray(v)))
    return out


def read(stager, batch) -> dict:
    n, t = batch.req_pool_indices.shape[0], batch.input_ids.shape[0]
    b = stager.buffers
    bufs = dict(req_pool_indices=b["rows"], prefix_lens=b["prefix"], extend_lens=b["extend"], input_ids=b["ids"],
                positions=b["pos"], out_cache_loc=b["loc"])
    return {k: buf.numpy()[:t if k in ("input_ids", "positions", "out_cache_loc") else n] for k, buf in bufs.items()}


RTT = np.arange(64 * 48, dtype=np.int32).reshape(64, 48)


@pytest.mark.parametrize("mode", ["DECODE", "IDLE", "TARGET_VERIFY", "EXTEND", "MIXED", "DRAFT_EXTEND_V2"])
@pytest.mark.parametrize("seed,n,hostile", [(0, 1, False), (1, 9, False), (2, 13, True)])
def test_staged_batch_equals_sglang_batch(mode, seed, n, hostile):
    fb = forward_batch(seed, mode, n, hostile=hostile)
    rtt = memory.to_device(RTT)
    stager = SglangBatchStager(rtt, max_reqs=n, max_tokens=max(1, fb.input_ids.shape[0]))
    batch = stager(on_device(fb))
    want = sglang_batch(fb, RTT)
    got = read(stager, batch)
    for k in FIELDS:
        np.testing.assert_array_equal(got[k], np.asarray(getattr(want, k)).astype(np.int64), err_msg=k)
        assert got[k].shape == tuple(getattr(batch, k).shape), k
    assert batch.req_to_token.ptr == rtt.ptr and batch.req_to_token.shape == RTT.shape  # read in place
    assert stager.launches == 1


def test_an_extend_without_prefix_lens_takes_seq_lens_minus_extend():
    fb = forward_batch(3, "EXTEND", 6, prefix_given=False)
    stager = SglangBatchStager(memory.to_device(RTT), max_reqs=6, max_tokens=64)
    got = read(stager, stager(on_device(fb)))
    np.testing.assert_array_equal(got["prefix_lens"], fb.seq_lens.astype(np.int64) - fb.extend_seq_lens)


def test_a_step_of_the_same_shape_returns_the_same_batch_restaged():
    first_fb, second_fb = forward_batch(4, "DECODE", 5, wide=[True] * 7), forward_batch(5, "DECODE", 5, wide=[True] * 7)
    stager = SglangBatchStager(memory.to_device(RTT), max_reqs=8, max_tokens=8)
    first = stager(on_device(first_fb))
    second = stager(on_device(second_fb))  # new arrays, new addresses, same layout
    assert second is first and len(stager.packed) == 1 and stager.launches == 2
    got = read(stager, second)
    np.testing.assert_array_equal(got["prefix_lens"], second_fb.seq_lens - 1)
    third = stager(on_device(forward_batch(6, "DECODE", 3, wide=[True] * 7)))
    assert third is not first and third.req_pool_indices.shape == (3,)


def test_a_new_req_to_token_is_checked_and_named_by_the_next_batch():
    stager = SglangBatchStager(memory.to_device(RTT), max_reqs=8, max_tokens=8)
    fb = on_device(forward_batch(7, "DECODE", 4, wide=[True] * 7))
    first = stager(fb)
    stager.req_to_token = memory.to_device(RTT[:32].copy())  # the engine's map reallocated
    second = stager(fb)
    assert second is not first and second.req_to_token.ptr == stager.req_to_token.ptr
    assert second.req_to_token.shape == (32, 48)
    stager.req_to_token = memory.to_device(RTT.astype(np.int64))
    with pytest.raises(kc.ValidationTypeError, match="req_to_token must have dtype int32, got int64"):
        stager(fb)


@pytest.mark.parametrize("bad,match", [
    (lambda fb: setattr(fb, "seq_lens", fb.seq_lens.astype(np.float32)), r"seq_lens must be int32 or int64, got float32"),
    (lambda fb: setattr(fb, "positions", fb.positions[:-1]), r"input_ids, positions and out_cache_loc must have one "
                                                             r"entry per new token, got 4, 3 and 4"),
    (lambda fb: setattr(fb, "seq_lens", fb.seq_lens[:2]), r"one entry per request \(>= 4\), got seq_lens of 2"),
    (lambda fb: setattr(fb, "forward_mode", SimpleNamespace(name="DUMMY_FIRST")), r"forward_mode DUMMY_FIRST is not"),
    (lambda fb: delattr(fb, "out_cache_loc"), r"out_cache_loc"),
])
def test_bad_arrays_are_refused_with_the_fix(bad, match):
    fb = forward_batch(8, "DECODE", 4)
    bad(fb)
    stager = SglangBatchStager(memory.to_device(RTT), max_reqs=8, max_tokens=64)
    with pytest.raises((kc.ValidationError, TypeError, AttributeError), match=match):
        stager(on_device(fb))
    assert stager.launches == 0


def test_a_step_larger_than_the_stager_or_a_translating_pool_is_refused():
    fb = on_device(forward_batch(9, "EXTEND", 6))
    with pytest.raises(kc.ValidationError, match=r"a step of requests=6 \(capacity 4\) does not fit the SglangBatchStager"):
        SglangBatchStager(memory.to_device(RTT), max_reqs=4, max_tokens=64)(fb)
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=memory.to_device(RTT)),
                             kv_index_translator=SimpleNamespace(is_translating=True))
    with pytest.raises(kc.ValidationError, match="use sglang_batch"):
        SglangBatchStager(runner, max_reqs=4, max_tokens=64)


def test_a_canary_fed_staged_batches_steps_clean_and_reports_a_wrong_map_entry():
    """Decode steps of 3 requests: clean, then request 1's map names request 2's first slot."""
    n, length_max = 3, 12
    rtt = np.zeros((n + 1, length_max + 1), np.int32)
    rtt[1:, :] = (np.arange(n * (length_max + 1)).reshape(n, -1) + 1).astype(np.int32)
    drtt = memory.to_device(rtt)
    stager = SglangBatchStager(drtt, max_reqs=n, max_tokens=n)
    canary = kc.KvCanary(kc.PoolGroup(64, halves=("K",)), device=0, hash_mode="none", mode="log", max_batch=n,
                         verify_capacity=n * length_max)
    tokens = np.random.default_rng(1).integers(0, 1000, (n, length_max))

    def step(length: int):
        seq = np.full(n, length, np.int64)
        fb = SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE"), req_pool_indices=np.arange(1, n + 1),
                             seq_lens=seq, input_ids=tokens[:, length - 1].copy(), positions=np.full(n, length - 1),
                             out_cache_loc=rtt[1:, length - 1].astype(np.int64))
        batch = stager(on_device(fb))
        canary.before_forward(batch)
        canary.after_forward(batch)

    for length in range(1, 9):
        step(length)
    canary.flush()
    assert canary.stats()["violations"] == 0
    bad = rtt.copy()
    bad[2, 0] = rtt[3, 0]  # request 2 (row 2) now reads request 3's first slot
    memory.copy_from_host_ptr(drtt.ptr, bad, 0)
    step(9)
    canary.flush()
    assert canary.stats()["violations"] > 0
