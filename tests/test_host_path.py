"""Issue 12, host path: launches packed once per array layout and replayed with each call's
addresses (manager stages and eager ops) never skip a check that a changed layout needs, and the
adapters' shortened torch paths give the values of the long ones. On tests/support/fake_cuda.py: no GPU;
the launched params are read back from the fake driver's queue."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.interop import arrays
from kvcanary.runtime import memory

D = memory.to_device


class Cai:
    """A bare __cuda_array_interface__ producer (ordinal from the pointer) at any address."""

    def __init__(self, ptr, shape, typestr="<i8", strides=None, device=None):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": tuple(shape), "typestr": typestr,
                                         "strides": strides, "version": 3, "stream": None}
        if device is not None:
            self.device = device


def launched(fake, *kernels):
    """Params structs of the queued launches of each of ``kernels``, oldest first (one list per
    kernel; the queue is emptied)."""
    out = {k: [] for k in kernels}
    for s, queue in fake.pending.items():
        for name, _grid, _grid_y, _block, params in queue:
            if name in out:
                out[name].append(abi.CTYPES[abi.KERNELS[name]].from_buffer_copy(params))
        fake.pending[s] = []
    return [out[k] for k in kernels] if len(kernels) > 1 else out[kernels[0]]


def manager_batch(ids=(7,), loc=(9,)):
    return kc.Batch(D(np.array([1], np.int64)), D(np.array([3], np.int64)), D(np.array([1], np.int64)),
                    D(np.zeros((2, 8), np.int32)), D(np.array(ids, np.int64)), D(np.array([3], np.int64)),
                    D(np.array(loc, np.int64)))


def make_canary():
    return kc.KvCanary(kc.PoolGroup(64, halves=("K",)), device=0, hash_mode="none", max_batch=2, verify_capacity=256)


def step(canary, batch, s):
    canary.before_forward(batch, stream=s)
    canary.after_forward(batch, stream=s)


def test_manager_replays_new_addresses_and_revalidates_every_changed_layout(fake):
    canary, s = make_canary(), fake.cuStreamCreate(0)[1]
    batch = manager_batch()
    step(canary, batch, s)
    launched(fake, "kvc_write")
    fresh = manager_batch(ids=(8,), loc=(10,))  # same layout, new addresses: replayed, patched
    step(canary, fresh, s)
    assert len(canary.stages.packed["HEAD"]) == 1
    assert [p.out_cache_loc for p in launched(fake, "kvc_write")] == [fresh.out_cache_loc.ptr] * 2
    loc = fresh.out_cache_loc
    bad = {
        "dtype": (Cai(loc.ptr, (1,), "<i4"), kc.ValidationTypeError, "int64"),
        "shape": (Cai(loc.ptr, (2,)), kc.ValidationError, "one entry per new token"),
        "stride": (Cai(D(np.zeros(2, np.int64)).ptr, (1, 1), strides=(8, 16)), kc.ValidationError, "1-D"),
        "null": (Cai(0, (1,), device=0), kc.ValidationError, "non-NULL"),  # the packed layout, NULL
        "past the address space": (Cai((1 << 63) - 4, (1,), device=0), kc.ValidationError, "address space"),
        "device": (Cai(loc.ptr, (1,), device=1), kc.ValidationError, "device"),
    }
    for what, (arr, error, match) in bad.items():
        b = manager_batch()
        b.out_cache_loc = arr
        with pytest.raises(error, match=match):
            step(canary, b, s)
    # a bare producer at the very address of the packed layout replays (its ordinal from the pointer)
    same = manager_batch()
    same.out_cache_loc = Cai(loc.ptr, (1,))
    step(canary, same, s)
    assert len(canary.stages.packed["HEAD"]) == 1


def test_manager_key_holds_torch_strides_and_neg_bit(fake, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(arrays, "_torch_ordinal", lambda obj: 0)  # CPU tensors stand in for cuda:0 ones
    canary, s = make_canary(), fake.cuStreamCreate(0)[1]
    T = lambda v, dt=torch.int64: torch.tensor(v, dtype=dt)  # noqa: E731
    fields = lambda: dict(req_pool_indices=T([1, 1]), prefix_lens=T([0, 0]), extend_lens=T([1, 0]),  # noqa: E731
                          req_to_token=torch.zeros((2, 2), dtype=torch.int32), input_ids=T([5, 0]),
                          positions=T([0, 0]), out_cache_loc=T([9, -1]))
    step(canary, kc.Batch(**fields()), s)
    step(canary, kc.Batch(**fields()), s)
    assert len(canary.stages.packed["HEAD"]) == 1
    f = fields()
    f["req_to_token"] = f["req_to_token"].t()  # same shape and dtype, transposed strides
    with pytest.raises(kc.ValidationError, match="C-contiguous"):
        step(canary, kc.Batch(**f), s)
    f = fields()
    f["input_ids"] = torch._neg_view(f["input_ids"])
    with pytest.raises(kc.ValidationError, match="neg"):
        step(canary, kc.Batch(**f), s)
    f = fields()
    f["input_ids"] = f["input_ids"].to(torch.int32)
    with pytest.raises(kc.ValidationTypeError, match="int64"):
        step(canary, kc.Batch(**f), s)


def test_manager_same_objects_changed_in_place_are_rekeyed(fake, monkeypatch):
    """The very tensor objects of the last step, resized in place: their new layout is validated
    (no identity shortcut) and the launches read their new address."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(arrays, "_torch_ordinal", lambda obj: 0)
    canary, s = make_canary(), fake.cuStreamCreate(0)[1]
    T = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    batch = kc.Batch(T([1]), T([0]), T([1]), torch.zeros((2, 2), dtype=torch.int32), T([5]), T([0]), T([9]))
    step(canary, batch, s)
    batch.out_cache_loc.set_(T([11]))  # another storage, same layout
    launched(fake, "kvc_write")
    step(canary, batch, s)
    assert [p.out_cache_loc for p in launched(fake, "kvc_write")] == [batch.out_cache_loc.data_ptr()] * 2
    batch.out_cache_loc.resize_(2)  # another length: per-token arrays disagree
    with pytest.raises(kc.ValidationError, match="one entry per new token"):
        step(canary, batch, s)


def ops_state():
    ctx = kc.VerifyContext(kc.CanaryBuffer.allocate(64, device=0), kc.ViolationSink.allocate(device=0),
                           kc.LaunchTag.TAIL_K_FULL, [], kc.HashMode.NONE)
    return ctx, kc.StepPlan.allocate(2, 16, device=0)


def test_eager_ops_replay_per_layout_and_revalidate_changes(fake):
    ctx, plan = ops_state()
    s = fake.cuStreamCreate(0)[1]
    for ids in ((7,), (8,), (9,)):  # a fresh Batch each call
        b = manager_batch(ids=ids)
        kc.build_plan(b, plan, stream=s)
        kc.fused_verify(ctx, b, plan, stream=s)
        kc.write(ctx, plan, b.input_ids, b.positions, b.out_cache_loc, stream=s)
        (prep,), (fused,), (wr,) = launched(fake, "kvc_prepare", "kvc_fused_verify", "kvc_write")
        assert prep.req_to_token == fused.req_to_token == b.req_to_token.ptr
        assert (wr.input_ids, wr.positions, wr.out_cache_loc) == (b.input_ids.ptr, b.positions.ptr, b.out_cache_loc.ptr)
        assert wr.seed == plan.seed.ptr and wr.offsets == plan.offsets.ptr
    assert len(ctx._kvc_packed) == 2 and len(plan._kvc_packed) == 1  # write + fused on ctx, build on plan
    b = manager_batch()
    with pytest.raises(kc.ValidationTypeError, match="int64"):
        kc.write(ctx, plan, Cai(b.input_ids.ptr, (1,), "<i4"), b.positions, b.out_cache_loc, stream=s)
    with pytest.raises(kc.ValidationError, match="shape"):
        kc.write(ctx, plan, b.input_ids, Cai(b.positions.ptr, (2,)), b.out_cache_loc, stream=s)
    with pytest.raises(kc.ValidationError, match="non-NULL"):
        kc.write(ctx, plan, b.input_ids, b.positions, Cai(0, (1,), device=0), stream=s)
    b.req_to_token = Cai(b.req_to_token.ptr, (2, 8), "<i8")
    with pytest.raises(kc.ValidationTypeError, match="int32"):
        kc.fused_verify(ctx, b, plan, stream=s)
    with pytest.raises(kc.ValidationTypeError, match="int32"):
        kc.build_plan(b, plan, stream=s)
    b = manager_batch()
    with pytest.raises(kc.ValidationError):
        kc.build_plan(b, plan, swa_window=-1, stream=s)  # a scalar argument is part of the key
    plan.seed = D(np.zeros(2, np.int64))  # a plan array replaced: packed again, read from the new array
    launched(fake, "kvc_write")
    kc.write(ctx, plan, b.input_ids, b.positions, b.out_cache_loc, stream=s)
    (wr,) = launched(fake, "kvc_write")
    assert wr.seed == plan.seed.ptr
    plan.seed = D(np.zeros(3, np.int64))  # of the wrong length: refused
    with pytest.raises(kc.ValidationError, match="plan.seed"):
        kc.write(ctx, plan, b.input_ids, b.positions, b.out_cache_loc, stream=s)


def test_eager_op_cache_keeps_no_caller_array_alive(fake):
    import gc
    import weakref
    ctx, plan = ops_state()
    b = manager_batch()
    kc.write(ctx, plan, b.input_ids, b.positions, b.out_cache_loc, stream=fake.cuStreamCreate(0)[1])
    ref = weakref.ref(b.input_ids)
    del b
    gc.collect()
    assert ref() is None


def test_torch_block_table_expansion_equals_the_table_by_hand():
    torch = pytest.importorskip("torch")
    from kvcanary.adapters import block_table_to_req_to_token
    bt = torch.tensor([[3, 7, 1], [5, 2, 0]], dtype=torch.int32)
    seq = torch.tensor([40, 20], dtype=torch.int32)
    want = np.zeros((3, 48), np.int32)
    want[1, :16], want[1, 16:32], want[1, 32:40] = range(48, 64), range(112, 128), range(16, 24)
    want[2, :16], want[2, 16:20] = range(80, 96), range(32, 36)
    for _ in range(2):  # the second call reads the kept column constants
        got = block_table_to_req_to_token(bt, seq, 16)
        assert got.dtype == torch.int32 and np.array_equal(got.numpy(), want)
    out = torch.full((4, 40), 99, dtype=torch.int32)
    assert block_table_to_req_to_token(bt, seq, 16, max_len=40, out=out) is out
    assert np.array_equal(out[:3].numpy(), want[:, :40]) and (out[3] == 99).all()
    # same length, another block size: other constants (block b, offset o -> slot 8b + o)
    got = block_table_to_req_to_token(bt, seq.clone().fill_(3), 8, max_len=16)
    assert got[1].tolist() == [24, 25, 26] + [0] * 13 and got[2].tolist() == [40, 41, 42] + [0] * 13
    with pytest.raises(kc.ValidationError, match="neg"):
        block_table_to_req_to_token(torch._neg_view(bt), seq, 16)
    with pytest.raises(kc.ValidationTypeError, match="integer dtype"):
        block_table_to_req_to_token(bt.float(), seq, 16)


def test_sglang_decode_lengths_are_one_new_token_after_seq_minus_one():
    torch = pytest.importorskip("torch")
    import types

    from kvcanary.adapters import sglang_batch
    fb = types.SimpleNamespace(forward_mode=types.SimpleNamespace(name="DECODE"),
                               req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor([5, 9], dtype=torch.int32),
                               input_ids=torch.tensor([3, 4], dtype=torch.int32), positions=torch.tensor([4, 8]),
                               out_cache_loc=torch.tensor([10, 11]))
    b = sglang_batch(fb, torch.zeros((3, 16), dtype=torch.int32))
    assert b.prefix_lens.tolist() == [4, 8] and b.extend_lens.tolist() == [1, 1]
    assert b.extend_lens.dtype == b.prefix_lens.dtype == b.input_ids.dtype == torch.int64
    assert ctypes.sizeof(ctypes.c_int64) == b.extend_lens.element_size()


def test_only_kvcanary_arrays_replay_by_identity(fake, monkeypatch):
    """The same DeviceArray objects as the stage's last step skip the key (their address and layout
    are fixed for life); the same torch tensors are keyed again every stage."""
    from kvcanary.manager import stages
    from kvcanary.ops import packing
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(arrays, "_torch_ordinal", lambda obj: 0)
    calls = []
    monkeypatch.setattr(stages, "arg_keys", lambda fields: calls.append(1) or packing.arg_keys(fields))
    canary, s = make_canary(), fake.cuStreamCreate(0)[1]
    batch = manager_batch()
    step(canary, batch, s)
    del calls[:]
    step(canary, batch, s)
    assert calls == []
    T = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    tb = kc.Batch(T([1]), T([3]), T([1]), torch.zeros((2, 8), dtype=torch.int32), T([7]), T([3]), T([9]))
    step(canary, tb, s)
    del calls[:]
    step(canary, tb, s)
    assert len(calls) == 2


def test_a_scalar_field_keys_on_its_type_and_value(fake):
    """expected_token_offset 1, then True (equal to 1, refused as a bool), then numpy's 1 (an
    integer: accepted, and packed once for its own key)."""
    canary, s = make_canary(), fake.cuStreamCreate(0)[1]
    batch = manager_batch()
    batch.expected_token_offset = 1
    step(canary, batch, s)
    for bad in (True, 1.0):
        batch.expected_token_offset = bad
        with pytest.raises(kc.ValidationTypeError, match="expected_token_offset"):
            step(canary, batch, s)
    batch.expected_token_offset = np.int64(1)
    step(canary, batch, s)
    step(canary, batch, s)
    assert len(canary.stages.packed["HEAD"]) == 2


def test_a_replay_writes_only_the_addresses_of_the_arguments_that_moved(fake):
    """Issue 30: a step patches only the pointers that changed. The packed params' field of an
    argument whose address stayed is not written again (a value planted in it survives the replay);
    every field of an argument that moved gets its new address."""
    canary, s = make_canary(), fake.cuStreamCreate(0)[1]
    first = manager_batch()
    step(canary, first, s)
    entry = next(iter(canary.stages.packed["HEAD"].values()))
    moved = kc.Batch(**{**first.__dict__, "input_ids": D(np.array([8], np.int64))})  # one argument moves
    fields = dict(entry.patches)
    names = list(first.__dict__)
    planted = 0x1234_5670
    stayed = fields[names.index("req_to_token")]
    for f in stayed:
        f.value = planted
    launched(fake, "kvc_write")
    step(canary, moved, s)
    assert all(f.value == planted for f in stayed)  # not rewritten: its address did not change
    assert all(f.value == moved.input_ids.ptr for f in fields[names.index("input_ids")])
    assert [p.input_ids for p in launched(fake, "kvc_write")] == [moved.input_ids.ptr] * 2
