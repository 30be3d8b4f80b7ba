"""GPU tier (and the CPU emulator): VllmBatchStager stages a step of vLLM attention metadata in one
launch, into its own buffers, with exactly the values of the numpy path of ``vllm_batch`` (the
reference: numpy ops written from the adapter's contract, not the kernel) on seeded random and
hostile metadata (int32 / int64 inputs, padded metadata, a block table wider than it is used,
garbage block ids and lengths); a step of the same shape returns the same Batch object at the
same addresses; bad arrays are refused with what was expected; and a canary fed the staged Batch
steps clean and reports a request pointed at a wrong block."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.adapters import vllm_batch
from kvcanary.adapters.vllm_stager import VllmBatchStager
from kvcanary.interop import arrays
from kvcanary.runtime import memory

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]

FIELDS = ("req_pool_indices", "prefix_lens", "extend_lens", "req_to_token", "input_ids", "positions",
          "out_cache_loc")


def metadata(seed: int, n: int, *, block: int = 4, max_blocks: int = 6, hostile: bool = False, wide=None):
    """numpy metadata of n requests (plus padding rows and tokens) and the block-table columns used."""
    rng = np.random.default_rng(seed)
    wide = rng.integers(0, 2, 6).astype(bool) if wide is None else wide
    dt = [np.int64 if w else np.int32 for w in wide]
    cells = (n + 2) * (max_blocks + 3)
    table = rng.permutation(4 * cells)[:cells].reshape(n + 2, max_blocks + 3) + 1
    seq = rng.integers(0, max_blocks * block + 1, n + 2)
    q = rng.integers(0, 4, n + 1)
    if hostile:
        table[rng.random(table.shape) < 0.2] = rng.choice([-7, 2**31 + 5, 2**40, -(2**33)])
        seq[rng.random(seq.shape) < 0.3] = rng.choice([-5, 10**9, 2**40])
        q[rng.random(q.shape) < 0.3] = rng.choice([-3, 50])
    qsl = np.concatenate([[0], np.cumsum(q)])
    t = int(max(qsl[n], 0)) + 3
    meta = dict(block_table=table.astype(dt[0]), seq_lens=seq.astype(dt[1]), query_start_loc=qsl.astype(dt[2]),
                slot_mapping=rng.integers(-1, 5000, t).astype(dt[3]),
                input_ids=rng.integers(0, 1 << 20, t).astype(dt[4]), positions=rng.integers(0, 99, t).astype(dt[5]))
    return meta, max_blocks


def device(meta: dict, max_blocks: int) -> dict:
    """The metadata on the device; the block table as the first max_blocks columns of a wider one."""
    out = {k: memory.to_device(np.ascontiguousarray(v)) for k, v in meta.items() if k != "block_table"}
    wide_table = memory.to_device(np.ascontiguousarray(meta["block_table"]))
    view = arrays.as_view(wide_table, name="block_table")
    out["block_table"] = arrays.ArrayView(view.ptr, (view.shape[0], max_blocks), view.strides, view.dtype,
                                             view.dtype_name, view.device, False, wide_table)
    return out


def read(stager: VllmBatchStager, batch) -> dict:
    n, t = batch.req_pool_indices.shape[0], batch.input_ids.shape[0]
    b = stager.buffers
    bufs = dict(req_pool_indices=b["rows"], prefix_lens=b["prefix"], extend_lens=b["extend"], input_ids=b["ids"],
                positions=b["pos"], out_cache_loc=b["loc"])
    got = {k: b.numpy()[:t if k in ("input_ids", "positions", "out_cache_loc") else n] for k, b in bufs.items()}
    got["req_to_token"] = stager.req_to_token.numpy()[:n + 1]
    return got


def reference(meta: dict, max_blocks: int, block: int, max_len: int, **trim) -> dict:
    host = vllm_batch(**{**meta, "block_table": np.ascontiguousarray(meta["block_table"][:, :max_blocks])},
                      block_size=block, max_len=max_len, **trim)
    return {k: np.asarray(getattr(host, k)) for k in FIELDS}


@pytest.mark.parametrize("seed,n,hostile,trim", [(0, 1, False, False), (1, 5, False, True), (2, 17, False, False),
                                                 (3, 5, True, False), (4, 17, True, True), (5, 9, True, True)])
def test_staged_batch_equals_vllm_batch(seed, n, hostile, trim):
    block, (meta, max_blocks) = 4, metadata(seed, n, hostile=hostile)
    max_len = max_blocks * block - (seed % 3)
    kw = dict(num_reqs=n, num_tokens=max(0, int(meta["query_start_loc"][n]))) if trim else {}
    if trim and kw["num_tokens"] > meta["input_ids"].shape[0]:
        kw["num_tokens"] = meta["input_ids"].shape[0]
    stager = VllmBatchStager(max_reqs=n + 2, max_tokens=meta["input_ids"].shape[0], max_len=max_len, block_size=block)
    batch = stager(**device(meta, max_blocks), **kw)
    want = reference(meta, max_blocks, block, max_len, **kw)
    got = read(stager, batch)
    for k in FIELDS:
        np.testing.assert_array_equal(got[k], want[k].astype(got[k].dtype), err_msg=k)
        assert got[k].shape == tuple(getattr(batch, k).shape), k
    assert stager.launches == 1


def test_a_step_of_the_same_shape_returns_the_same_batch_restaged():
    block = 4
    meta1, mb = metadata(10, 6, wide=[False, False, False, True, False, True])
    rng = np.random.default_rng(11)
    meta2 = {k: rng.permutation(v.reshape(-1)).reshape(v.shape) for k, v in meta1.items()}  # same layout
    t = meta1["input_ids"].shape[0] - 2
    stager = VllmBatchStager(max_reqs=8, max_tokens=64, max_len=mb * block, block_size=block)
    first = stager(**device(meta1, mb), num_tokens=t)
    ptrs = [getattr(first, k).ptr for k in FIELDS]
    second = stager(**device(meta2, mb), num_tokens=t)  # new arrays, new addresses, same layout
    assert second is first and [getattr(second, k).ptr for k in FIELDS] == ptrs
    assert len(stager.packed) == 1 and stager.launches == 2
    got, want = read(stager, second), reference(meta2, mb, block, mb * block, num_tokens=t)
    for k in FIELDS:
        np.testing.assert_array_equal(got[k], want[k].astype(got[k].dtype), err_msg=k)


@pytest.mark.parametrize("bad,match", [
    (lambda m: {**m, "seq_lens": m["seq_lens"].astype(np.float32)}, r"seq_lens must be int32 or int64, got float32"),
    (lambda m: {**m, "positions": np.stack([m["positions"]] * 2)}, r"positions must be a 1-D array"),
    (lambda m: {**m, "input_ids": m["input_ids"].astype(np.int16)}, r"input_ids must be int32 or int64, got int16"),
    (lambda m: {**m, "query_start_loc": m["query_start_loc"][:0]}, r"query_start_loc must hold num_reqs \+ 1 offsets"),
])
def test_bad_arrays_are_refused_with_the_fix(bad, match):
    meta, mb = metadata(20, 4)
    stager = VllmBatchStager(max_reqs=8, max_tokens=64, max_len=mb * 4, block_size=4)
    with pytest.raises((kc.ValidationError, TypeError), match=match):
        stager(**device(bad(meta), mb))
    assert stager.launches == 0


def test_a_step_larger_than_the_stager_or_its_table_is_refused():
    meta, mb = metadata(21, 6)
    with pytest.raises(kc.ValidationError, match=r"a step of requests=7 \(capacity 4\) does not fit the VllmBatchStager\. Fix: build"):
        VllmBatchStager(max_reqs=4, max_tokens=64, max_len=mb * 4, block_size=4)(**device(meta, mb))
    with pytest.raises(kc.ValidationError, match=r"max_len=25 exceeds what the block table maps \(6 blocks"):
        VllmBatchStager(max_reqs=8, max_tokens=64, max_len=25, block_size=4)(**device(meta, mb))


def test_a_canary_fed_staged_batches_steps_clean_and_reports_a_wrong_block():
    """Decode steps of 3 requests on a 4-slot-block cache: clean, then request 1's block table
    points its second block at another request's block (a stale table after a free)."""
    block, mb, n = 4, 4, 3
    stager = VllmBatchStager(max_reqs=n, max_tokens=n, max_len=mb * block, block_size=block)
    canary = kc.KvCanary(kc.PoolGroup(64 * block, halves=("K",)), device=0, hash_mode="none", mode="log",
                         max_batch=n, verify_capacity=n * mb * block)
    table = (np.arange(n * mb).reshape(n, mb) * 3 + 1).astype(np.int32)  # distinct blocks per request
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 1000, (n, mb * block))

    def step(length: int, tab):
        seq = np.full(n, length, np.int32)
        slots = tab[:, (length - 1) // block] * block + (length - 1) % block
        meta = dict(block_table=tab, seq_lens=seq, query_start_loc=np.arange(n + 1, dtype=np.int32),
                    slot_mapping=slots.astype(np.int64), input_ids=tokens[:, length - 1].astype(np.int32),
                    positions=np.full(n, length - 1, np.int64))
        batch = stager(**device(meta, mb))
        canary.before_forward(batch)
        canary.after_forward(batch)

    for length in range(1, 9):
        step(length, table)
    canary.flush()
    assert canary.stats()["violations"] == 0
    bad = table.copy()
    bad[1, 0] = table[2, 0]  # request 1's first block now names request 2's
    step(9, bad)
    canary.flush()
    assert canary.stats()["violations"] > 0
