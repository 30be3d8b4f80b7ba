"""GPU tier (and the CPU emulator): PagedBatchStager stages a transformers continuous-batching step
(cumulative query / key lengths, physical read and write indices, ids, positions) in one launch
with exactly the values of StepBatches' torch path on CPU tensors (the reference: torch ops
written from the adapter's contract, not the kernel), on seeded random steps with int32 and int64
inputs and physical indices that name no token (negative, past the page, past the cache); the map
grows when a request outgrows it; a step of the same shape returns the same Batch object; a step
of more requests than the canary's batch is refused."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.adapters.paged_stager import PagedBatchStager
from kvcanary.adapters.transformers_batch import Scheduled, StepBatches
from kvcanary.adapters.transformers_layout import PagedLayout
from kvcanary.runtime import memory

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]
torch = pytest.importorskip("torch")

PAGE, LAYERS, BLOCKS = 4, 2, 200
LAYOUT = SimpleNamespace(page_size=PAGE, stride=2 * PAGE * LAYERS, num_slots=BLOCKS * PAGE)
LAYOUT.to_slots = lambda index: PagedLayout.to_slots(LAYOUT, index)
FIELDS = ("req_pool_indices", "prefix_lens", "extend_lens", "req_to_token", "input_ids", "positions",
          "out_cache_loc")


def step_data(seed: int, n: int, *, longest: int = 40, hostile: bool = False, pad: int = 0, table: bool = False):
    """(model inputs as numpy, the host's notes) of one step of n requests. ``pad`` > 0: the step is
    padded to a static shape as transformers pads it for CUDA graphs and torch.compile (``pad``
    requests of no tokens, their cumulative lengths a plateau; ``2 * pad`` padding tokens writing to
    the write-trash block; padding reads of the read-trash index 0). ``table``: a decode-fast-path
    step (one new token per request) given by a block table of page entries (block * pages per
    block, -1 past a request's blocks); its read index is empty and its write index stale."""
    rng = np.random.default_rng(seed)
    past = rng.integers(0, longest, n)
    query = np.ones(n, np.int64) if table else rng.integers(1, 6, n)
    lens = past + query
    phys, owned = [], []
    for L in lens:  # a request's tokens: page offsets of random blocks
        blocks = rng.choice(BLOCKS, -(-int(L) // PAGE), replace=False)
        pos = np.arange(L)
        owned.append(blocks)
        phys.append(blocks[pos // PAGE] * LAYOUT.stride + pos % PAGE)
    read = np.concatenate(phys)
    write = np.concatenate([p[-q:] for p, q in zip(phys, query)])
    cols = max(len(b) for b in owned) + 1
    block_table = np.full((n + pad, cols), -1, np.int64)
    for r, blocks in enumerate(owned):
        block_table[r, :len(blocks)] = blocks * (LAYOUT.stride // PAGE)
    if hostile:
        for arr in (read, write, block_table):
            bad = rng.random(arr.shape) < 0.15
            arr[bad] = rng.choice([-5, PAGE + 1, BLOCKS * LAYOUT.stride + 3, 2**35])
    wide = rng.integers(0, 2, 7).astype(bool)
    dt = [np.int64 if w else np.int32 for w in wide]
    cu_q = np.concatenate([[0], np.cumsum(query), np.full(pad, query.sum())])
    cu_k = np.concatenate([[0], np.cumsum(lens), np.full(pad, lens.sum())])
    t = int(query.sum()) + 2 * pad
    positions = np.concatenate([np.arange(p, p + q) for p, q in zip(past, query)] + [np.zeros(2 * pad, np.int64)])
    write = np.concatenate([write, np.full(2 * pad, LAYOUT.stride)])  # the write-trash block: a real slot
    read = np.concatenate([read, np.zeros(3 * pad, np.int64)])
    if table:
        read, write = read[:0], rng.integers(0, BLOCKS * LAYOUT.stride, t)
    data = dict(cu_seq_lens_q=cu_q.astype(dt[0]), cu_seq_lens_k=cu_k.astype(dt[1]),
                read_index=[read.astype(dt[2])], write_index=[write.astype(dt[3])],
                input_ids=rng.integers(0, 1 << 20, (1, t)).astype(dt[4]),
                position_ids=positions[None].astype(dt[5]))
    if table:
        data["block_table"] = block_table[None].astype(dt[6])
    return data, Scheduled(max_len=int(lens.max()))


def as_torch(data):
    return {k: ([torch.from_numpy(x[0])] if isinstance(x, list) else torch.from_numpy(x)) for k, x in data.items()}


def as_device(data):
    out = {}
    for k, x in data.items():
        if isinstance(x, list) or x.ndim > 1:  # [1, T] and [groups, n, cols]: the stager takes element 0
            out[k] = [memory.to_device(x[0])]
        else:
            out[k] = memory.to_device(x)
    return out


def staged(stager, dev, pending):
    table = dev.get("block_table")
    return stager(cu_q=dev["cu_seq_lens_q"], cu_k=dev["cu_seq_lens_k"], read_index=dev["read_index"][0],
                  write_index=dev["write_index"][0], input_ids=dev["input_ids"][0], positions=dev["position_ids"][0],
                  max_len=pending.max_len, block_table=None if table is None else table[0])


def read(stager, batch) -> dict:
    b = stager.buffers
    n, t, w = batch.req_pool_indices.shape[0], batch.input_ids.shape[0], batch.out_cache_loc.shape[0]
    return dict(req_pool_indices=b["rows"].numpy()[:n], prefix_lens=b["prefix"].numpy()[:n],
                extend_lens=b["extend"].numpy()[:n], input_ids=b["ids"].numpy()[:t], positions=b["pos"].numpy()[:t],
                out_cache_loc=b["loc"].numpy()[:w], req_to_token=stager.req_to_token.numpy())


STEPS = [(0, 1, 10, False, 0), (1, 6, 40, False, 0), (2, 6, 40, True, 0), (3, 15, 300, False, 0),
         (4, 15, 300, True, 0), (5, 4, 40, False, 3), (6, 9, 300, True, 6), (7, 1, 33, False, 14)]


@pytest.mark.parametrize("table", [False, True], ids=["indices", "block-table"])
@pytest.mark.parametrize("seed,n,longest,hostile,pad", STEPS)
def test_staged_step_equals_the_torch_path(seed, n, longest, hostile, pad, table):
    data, pending = step_data(seed, n, longest=longest, hostile=hostile, pad=pad, table=table)
    reference = StepBatches(LAYOUT, 16).batch(as_torch(data), pending, check_inputs=False)
    stager = PagedBatchStager(LAYOUT, max_reqs=15, max_tokens=8, max_writes=8)  # grows for the larger steps
    batch = staged(stager, as_device(data), pending)
    got = read(stager, batch)
    for k in FIELDS:
        want = getattr(reference, k).numpy()
        np.testing.assert_array_equal(got[k], want.astype(got[k].dtype), err_msg=k)
        assert tuple(getattr(batch, k).shape) == want.shape, k
    assert stager.launches == 1


@pytest.mark.parametrize("table", [False, True], ids=["indices", "block-table"])
def test_padding_and_block_tables_give_the_documented_slots(table):
    """The torch path (the kernel's reference) against the adapter's contract, by hand: padding
    tokens of a static-shape step are skipped (-1; before, they carried the write-trash block's
    slot, which the canary refused), padding reads leave the map alone, and a decode-fast-path step
    maps position p of request r to block_table[r][p // page] / pages_per_block * page + p % page."""
    n, pad = 5, 4
    data, pending = step_data(40, n, longest=60, pad=pad, table=table)
    b = StepBatches(LAYOUT, 16).batch(as_torch(data), pending, check_inputs=False)
    cu_q, cu_k = data["cu_seq_lens_q"].astype(np.int64), data["cu_seq_lens_k"].astype(np.int64)
    real = int(cu_q[n])
    loc = b.out_cache_loc.numpy()
    assert (loc[real:] == -1).all() and len(loc) == real + 2 * pad
    assert b.extend_lens.numpy()[n:].tolist() == [0] * pad and b.prefix_lens.numpy()[n:].tolist() == [0] * pad
    rtt = b.req_to_token.numpy()
    for r in range(n):
        length = int(cu_k[r + 1] - cu_k[r])
        if table:
            entries = data["block_table"][0][r].astype(np.int64)
            want = [entries[p // PAGE] // (LAYOUT.stride // PAGE) * PAGE + p % PAGE for p in range(length)]
        else:
            idx = data["read_index"][0][cu_k[r]:cu_k[r + 1]].astype(np.int64)
            want = [i // LAYOUT.stride * PAGE + i % LAYOUT.stride for i in idx]
        assert rtt[r + 1, :length].tolist() == want, r
        assert loc[cu_q[r + 1] - 1] == want[-1], r  # the newest token is written where it is later read
    assert (rtt[n + 1:] == 0).all(), "padding requests and padding reads must leave the map alone"


def test_a_step_of_the_same_shape_returns_the_same_batch_and_a_longer_one_grows_the_map():
    data, pending = step_data(10, 4)
    stager = PagedBatchStager(LAYOUT, max_reqs=4, max_tokens=64, max_writes=64)
    first = staged(stager, as_device(data), pending)
    again = staged(stager, as_device(data), pending)  # new arrays, same layout
    assert again is first and len(stager.packed) == 1
    long_data, long_pending = step_data(11, 4, longest=600)
    grown = staged(stager, as_device(long_data), long_pending)
    assert stager.req_to_token.shape[1] >= long_pending.max_len and grown.req_to_token.shape == stager.req_to_token.shape
    reference = StepBatches(LAYOUT, 5).batch(as_torch(long_data), long_pending, check_inputs=False)
    np.testing.assert_array_equal(stager.req_to_token.numpy()[:, :reference.req_to_token.shape[1]],
                                  reference.req_to_token.numpy())


def test_a_step_of_more_requests_than_the_batch_is_refused():
    data, pending = step_data(20, 6)
    stager = PagedBatchStager(LAYOUT, max_reqs=4, max_tokens=64, max_writes=64)
    with pytest.raises(kc.ValidationError, match=r"a step of requests=6 \(capacity 4\) does not fit the PagedBatchStager"):
        staged(stager, as_device(data), pending)
    assert stager.launches == 0


@pytest.mark.parametrize("max_len", [-1, 2.5, "600", None])
def test_a_step_length_that_is_no_count_is_refused_before_any_allocation(max_len):
    data, pending = step_data(21, 2)
    stager = PagedBatchStager(LAYOUT, max_reqs=4, max_tokens=64, max_writes=64)
    dev = as_device(data)
    refused = (kc.ValidationError, kc.ValidationTypeError)
    with pytest.raises(refused, match=r"kv-canary: max_len must be .*Fix: pass the step's longest request"):
        stager(cu_q=dev["cu_seq_lens_q"], cu_k=dev["cu_seq_lens_k"], read_index=dev["read_index"][0],
               write_index=dev["write_index"][0], input_ids=dev["input_ids"][0], positions=dev["position_ids"][0],
               max_len=max_len)
    assert stager.launches == 0 and stager.req_to_token is None


def carried_step(seed: int, n: int):
    """A step under async batching: (data, pending, carry_over_ids, previous output ids) with some
    tokens carried over (one index past the previous output and one negative other than -1 among
    them: both take the step's own token) and the host's expected ids -1 where it cannot know them."""
    data, pending = step_data(seed, n)
    rng = np.random.default_rng(seed)
    t = data["input_ids"].shape[1]
    prev = rng.integers(0, 1 << 20, 40).astype(np.int32)
    carry = np.where(rng.random(t + 3) < 0.5, rng.integers(0, 40, t + 3), -1).astype(np.int32)
    carry[0], carry[1] = 40, -7
    pending.ids = [int(x) for x in rng.integers(0, 1 << 20, t)]
    pending.ids[2] = -1
    pending.positions = list(range(t))
    return data, pending, carry, prev


def test_carried_over_tokens_and_unknown_expected_ids_equal_the_torch_path(emulated_device, monkeypatch):
    """Async batching: the staged ids take the previous batch's output where carry_over_ids names
    an index inside it (the engine's own forward does the same), and an expected id the host did
    not know (-1) becomes the staged token, as the torch path computes them (before, the adapter
    wrote the carried tokens into the engine's input_ids)."""
    if emulated_device is not None:
        def host_view(a):
            raw = (ctypes.c_char * (a.dtype.itemsize * int(np.prod(a.shape)))).from_address(a.ptr)
            return torch.from_numpy(np.frombuffer(raw, dtype=a.dtype).reshape(a.shape))
        monkeypatch.setattr(torch, "from_dlpack", host_view)
    data, pending, carry, prev = carried_step(50, 5)
    carried = (torch.from_numpy(carry), torch.from_numpy(prev))
    want = StepBatches(LAYOUT, 8).batch(as_torch(data), pending, True, carried)
    sb = StepBatches(LAYOUT, 8, device=0, tokens=8)
    engine = as_device(data)
    before = engine["input_ids"][0].numpy().copy()
    got = sb.as_torch(sb.batch(engine, pending, True, (memory.to_device(carry), memory.to_device(prev))))
    ids = want.input_ids.numpy()
    assert ids[0] == data["input_ids"][0, 0] and ids[1] == data["input_ids"][0, 1]  # out of range: not carried
    assert any(ids[i] == prev[carry[i]] != data["input_ids"][0, i] for i in range(2, len(ids)) if carry[i] >= 0)
    assert want.expected_input_ids.numpy()[2] == ids[2]
    for k in (*FIELDS, "expected_input_ids", "expected_positions"):
        np.testing.assert_array_equal(getattr(got, k).cpu().numpy(), getattr(want, k).numpy(), err_msg=k)
    np.testing.assert_array_equal(engine["input_ids"][0].numpy(), before)  # the engine's inputs are left alone


def test_step_batches_stage_on_the_device_and_hand_over_torch_tensors(emulated_device, monkeypatch):
    """StepBatches with a device stages the step (one launch) into the stager's buffers: the same
    Batch of views for every step of a shape (the canary's launches replay without keying), and
    its torch twin over the same buffers, so callbacks read ``info.batch`` as they do from the torch
    path. (Emulated: device memory is host memory, viewed by CPU torch.)"""
    if emulated_device is not None:
        def host_view(a):
            raw = (ctypes.c_char * (a.dtype.itemsize * int(np.prod(a.shape)))).from_address(a.ptr)
            return torch.from_numpy(np.frombuffer(raw, dtype=a.dtype).reshape(a.shape))
        monkeypatch.setattr(torch, "from_dlpack", host_view)
    data, pending = step_data(30, 5, hostile=True)
    sb = StepBatches(LAYOUT, 8, device=0, tokens=8)
    views = sb.batch(as_device(data), pending, check_inputs=False)
    got = sb.as_torch(views)
    want = StepBatches(LAYOUT, 8).batch(as_torch(data), pending, check_inputs=False)
    assert sb.stager.launches == 1
    for k in FIELDS:
        t = getattr(got, k)
        assert isinstance(t, torch.Tensor) and not isinstance(getattr(views, k), torch.Tensor), k
        np.testing.assert_array_equal(t.cpu().numpy(), getattr(want, k).numpy().astype(t.cpu().numpy().dtype),
                                      err_msg=k)
    again = sb.batch(as_device(data), pending, check_inputs=False)
    assert again is views and sb.as_torch(again) is got and sb.stager.launches == 2
    longer, long_pending = step_data(31, 5, longest=600)  # the map grows: the old Batch and its twin go
    sb.as_torch(sb.batch(as_device(longer), long_pending, check_inputs=False))
    assert len(sb.torch_batches) == 1 and all(b is not got for _, b in sb.torch_batches.values())


def test_a_fixed_stager_hands_one_batch_of_its_capacity_for_every_shape():
    """Catches a canary that packs its launches once per step shape (about 1 ms of host time each on
    a slow host, every shape an engine captures): a ``fixed`` stager returns one Batch of its whole
    capacity for steps of any shape, the step's own entries equal to the torch path's and the tail
    padding (map row 0, no tokens; tokens 0 at position 0 writing no slot), also where a larger step
    left its values before; expected positions start at the capacity."""
    stager = PagedBatchStager(LAYOUT, max_reqs=16, max_tokens=96, max_writes=96, fixed=True)
    got = []
    for seed, n, longest, hostile, pad in ((40, 9, 300, False, 3), (41, 2, 40, True, 0), (42, 5, 40, False, 2)):
        data, pending = step_data(seed, n, longest=longest, hostile=hostile, pad=pad)
        reference = StepBatches(LAYOUT, 17).batch(as_torch(data), pending, check_inputs=False)
        batch = staged(stager, as_device(data), pending)
        got.append(batch)
        b = stager.buffers
        assert batch.req_pool_indices.shape == (16,) and batch.input_ids.shape == (96,)
        assert batch.out_cache_loc.shape == (96,)
        full = dict(req_pool_indices=b["rows"].numpy(), prefix_lens=b["prefix"].numpy(),
                    extend_lens=b["extend"].numpy(), input_ids=b["ids"].numpy(), positions=b["pos"].numpy(),
                    out_cache_loc=b["loc"].numpy())
        for k in ("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc"):
            want = getattr(reference, k).numpy()
            np.testing.assert_array_equal(full[k][:len(want)], want.astype(np.int64), err_msg=k)
            pad_value = -1 if k == "out_cache_loc" else 0
            assert (full[k][len(want):] == pad_value).all(), k
    assert got[0] is got[1] is got[2] and len(stager.packed) == 3
    with_expected = stager(**_staged_args(as_device(step_data(43, 3)[0])), max_len=40, expected=True)
    assert with_expected.expected_positions.ptr == stager.buffers["exp"].ptr + 8 * 96


def _staged_args(dev):
    return dict(cu_q=dev["cu_seq_lens_q"], cu_k=dev["cu_seq_lens_k"], read_index=dev["read_index"][0],
                write_index=dev["write_index"][0], input_ids=dev["input_ids"][0], positions=dev["position_ids"][0])


def test_expected_tokens_larger_than_their_pinned_source_are_refused():
    """Catches a copy that reads past its pinned source: a captured step copies its expected tokens
    from a pinned buffer sized to the stager's capacity; if the stager's token buffers grew later,
    writing a step's tokens is refused with a kv-canary error instead of the copy reading beyond it."""
    sb = StepBatches(LAYOUT, 8, device=0, tokens=16, fixed=True)
    sb.pin_expected(1)
    _, pending = step_data(60, 3)
    sb.write_expected(pending, 8, 0)  # fits
    sb.stager.expected_buffer(40)     # a step of 40 tokens grows the stager
    with pytest.raises(kc.ValidationError, match=r"kv-canary: a step's expected tokens must fit the pinned buffer "
                                                 r".*\(16 tokens\), got a stager of \d+ tokens"):
        sb.write_expected(pending, 8, 0)


def test_an_engine_array_with_strided_elements_is_refused():
    """A 1-D view whose elements are not contiguous (every other int64 of a buffer) would stage
    the interleaved memory: refused, saying what was expected, what was got and the fix."""
    from kvcanary.interop.arrays import from_pointer
    data, pending = step_data(10, 4)
    dev = as_device(data)
    t = data["input_ids"].shape[1]
    both = memory.to_device(np.repeat(data["input_ids"][0].astype(np.int64), 2))
    dev["input_ids"] = [from_pointer(both.ptr, (t,), np.int64, device=0, strides=(16,), owner=both)]
    stager = PagedBatchStager(LAYOUT, max_reqs=4, max_tokens=64, max_writes=64)
    with pytest.raises(kc.ValidationError, match=r"kv-canary: input_ids must be a 1-D array with contiguous elements, "
                                                 r"got shape \(\d+,\), strides \(16,\)\. Fix: .*contiguous"):
        staged(stager, dev, pending)
    assert stager.launches == 0
