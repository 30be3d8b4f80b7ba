"""Host validation: one passing and one failing case per rule, asserting the message text."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.errors import ValidationError, ValidationTypeError
from kvcanary.ops.sources import marshal_sources

POOL = np.zeros((64, 256), np.uint8)


def test_page_size_rule():
    kc.RealKvSource(POOL, 1, 16)
    with pytest.raises(ValidationError, match=r"^kv-canary: RealKvSource.page_size must be an integer in "
                                              r"\[1, 2147483647\], got 0 \(int\). Fix: pass the tokens per row"):
        kc.RealKvSource(POOL, 0, 16)
    with pytest.raises(ValidationTypeError, match=r"^kv-canary: RealKvSource.page_size must be an integer .*, "
                                                  r"got 1.5 \(float\). Fix: "):
        kc.RealKvSource(POOL, 1.5, 16)  # the wrong kind of value, not a value out of range


def test_num_bytes_per_token_rule():
    kc.RealKvSource(POOL, 2, 128)
    for bad in (0, 24, -16):
        with pytest.raises(ValidationError, match=rf"^kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got {bad} \(int\). Fix: "):
            kc.RealKvSource(POOL, 1, bad)


def test_read_bytes_rule():
    kc.RealKvSource(POOL, 1, 64, 64)
    for bad in (0, 8, 80):
        with pytest.raises(ValidationError, match=rf"^kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in \(0, num_bytes_per_token=64\], got {bad} \(int\). Fix: "):
            kc.RealKvSource(POOL, 1, 64, bad)


def test_at_least_2d_rule_with_fix():
    with pytest.raises(ValueError, match=r"^kv-canary: RealKvSource.tensor must be at least 2-D, got shape \(16384,\). Fix: reshape to \[num_slots, bytes_per_slot\], e.g. t.view\(t.shape\[0\], -1\)$"):
        kc.RealKvSource(POOL.reshape(-1), 1, 16)



def test_row_stride_multiple_of_16():
    wide = np.zeros((8, 40), np.uint8)
    with pytest.raises(ValueError, match=r"^kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, got 40 bytes \(shape=\(8, 32\), strides=\(40, 1\), dtype=uint8\)"):
        kc.RealKvSource(wide[:, :32], 1, 32)
    kc.RealKvSource(np.zeros((8, 48), np.uint8)[:, :32], 1, 32)  # a 48-byte row stride is fine


def test_marshal_2d_rule_is_the_seed_message():
    three_d = np.zeros((4, 16, 32), np.uint8)  # [pages, page_size, bytes]
    src = kc.RealKvSource(three_d, 16, 32)
    with pytest.raises(ValueError) as err:
        marshal_sources([src], abi.HashMode.PARTIAL, 64)
    msg = str(err.value)
    assert msg.startswith("kv-canary: real_kv_sources[0].tensor (viewed as uint8) must be 2-D, got 3-D")
    assert msg.endswith("(or build it with kvcanary.sources_from_pages / sources_from_layers)")
    assert "t.view(t.shape[0], -1)" in msg
    fixed = kc.sources_from_pages(three_d)  # the helper does the flattening, without a copy
    (m,) = marshal_sources([fixed], abi.HashMode.PARTIAL, 64)
    assert m.view.ptr == three_d.ctypes.data and m.view.shape == (4, 512)


def test_inner_dimension_contiguous_rule():
    t = np.zeros((64, 64), np.uint8)[:, ::2]  # inner stride 2
    src = kc.RealKvSource(np.zeros((64, 32), np.uint8), 1, 32)
    marshal_sources([src], abi.HashMode.ALL, 64)
    with pytest.raises(ValueError, match=r"^kv-canary: real_kv_sources\[0\].tensor must have a contiguous inner dimension.*fix:"):
        marshal_sources([kc.RealKvSource(t, 1, 32)], abi.HashMode.ALL, 64)


def test_base_alignment_rule():
    buf = np.zeros((64, 64 + 16), np.uint8)
    ok = buf[:, 16:48]
    marshal_sources([kc.RealKvSource(ok, 1, 32)], abi.HashMode.ALL, 64)
    off = kc.from_pointer(buf.ctypes.data + 8, (64, 32), np.uint8, device=None, strides=(80, 1), owner=buf)
    with pytest.raises(ValueError, match=r"^kv-canary: real_kv_sources\[0\].tensor base address must be 16-byte aligned.*fix:"):
        marshal_sources([kc.RealKvSource(off, 1, 32)], abi.HashMode.ALL, 64)


def test_max_sources_rule():
    sources = [kc.RealKvSource(POOL, 1, 16)] * abi.MAX_REAL_KV_SOURCES
    assert len(marshal_sources(sources, abi.HashMode.PARTIAL, 64)) == 64
    with pytest.raises(ValueError, match=r"^kv-canary: at most 64 RealKvSource entries supported by the CUDA ABI, got 65"):
        marshal_sources(sources + sources[:1], abi.HashMode.PARTIAL, 64)


def test_sources_must_cover_the_canary_slots_and_rows_hold_a_page():
    src = kc.RealKvSource(np.zeros((10, 64), np.uint8), 4, 16)  # 40 slots
    marshal_sources([src], abi.HashMode.PARTIAL, 40)
    with pytest.raises(ValueError, match=r"covers 40 slots .* but the canary buffer has 41"):
        marshal_sources([src], abi.HashMode.PARTIAL, 41)
    with pytest.raises(ValueError, match=r"needs page_size \* num_bytes_per_token = 8 \* 16 = 128 bytes per row"):
        marshal_sources([kc.RealKvSource(np.zeros((10, 64), np.uint8), 8, 16)], abi.HashMode.PARTIAL, 40)


def test_mode_none_reads_no_source():
    src = kc.RealKvSource(np.zeros((10, 64), np.uint8), 4, 16)
    assert marshal_sources([src], abi.HashMode.NONE, 10**6) == ()


def test_state_array_rules():
    kc.CanaryBuffer(np.zeros((8, 32), np.uint8))
    with pytest.raises(ValidationTypeError, match=r"^kv-canary: canary buffer must have dtype uint8, got int64. Fix: "):
        kc.CanaryBuffer(np.zeros((8, 4), np.int64))
    with pytest.raises(ValueError, match=r"slot stride must be >= 32 bytes"):
        kc.CanaryBuffer(np.zeros((8, 24), np.uint8))
    with pytest.raises(ValueError, match=r"must be C-contiguous"):
        kc.CanaryBuffer(np.zeros((8, 64), np.uint8)[:, :32])
    with pytest.raises(ValueError, match=r"violation ring must have shape \(\*, 8\)"):
        kc.ViolationSink(np.zeros((4, 7), np.int64), np.zeros(1, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int64))


def test_write_argument_rules():
    ctx = kc.VerifyContext(kc.CanaryBuffer.allocate(16), kc.ViolationSink.allocate(8))
    plan = kc.StepPlan.allocate(2, 4)
    ids = np.zeros(3, np.int64)
    kc.write(ctx, plan, ids, ids, ids)
    with pytest.raises(ValueError, match=r"^kv-canary: positions must have shape \(3,\), got \(2,\)"):
        kc.write(ctx, plan, ids, ids[:2], ids)
    with pytest.raises(ValidationTypeError, match=r"^kv-canary: input_ids must have dtype int64, got int32. Fix: "):
        kc.write(ctx, plan, ids.astype(np.int32), ids, ids)
    with pytest.raises(ValueError, match=r"expected_input_ids and expected_positions go together"):
        kc.write(ctx, plan, ids, ids, ids, expected_input_ids=ids)

    other = kc.VerifyContext(kc.CanaryBuffer.allocate(16), kc.ViolationSink.allocate(8))
    assert kc.ops.prepare_write(ctx, plan, ids, ids, ids, chain_from=other) is None  # host: the reference ran
    with pytest.raises(ValueError, match=r"^kv-canary: write\(chain_from=\) must be another buffer of the same shape "
                                         r"on the same device, got 16 x 32 bytes on device None for 16 x 32 on device "
                                         r"None \(the same buffer\)\. Fix: "):
        kc.ops.prepare_write(ctx, plan, ids, ids, ids, chain_from=ctx)
    small = kc.VerifyContext(kc.CanaryBuffer.allocate(8), kc.ViolationSink.allocate(8))
    with pytest.raises(ValueError, match=r"got 8 x 32 bytes on device None for 16 x 32 on device None\. Fix: "):
        kc.ops.prepare_write(ctx, plan, ids, ids, ids, chain_from=small)
    with pytest.raises(ValidationTypeError, match=r"^kv-canary: chain_from must be a kvcanary.VerifyContext"):
        kc.ops.prepare_write(ctx, plan, ids, ids, ids, chain_from=ctx.buffer)


def test_batch_rules():
    plan = kc.StepPlan.allocate(2, 16)
    z = np.zeros(2, np.int64)
    rtt = np.zeros((4, 8), np.int32)
    kc.build_plan(kc.Batch(z, z, z, rtt), plan)
    with pytest.raises(ValueError, match=r"batch size must be <= max_batch \(2\), got 3"):
        kc.build_plan(kc.Batch(np.zeros(3, np.int64), np.zeros(3, np.int64), np.zeros(3, np.int64), rtt), plan)
    with pytest.raises(ValidationTypeError, match=r"batch.req_to_token must have dtype int32, got int64. Fix: "):
        kc.build_plan(kc.Batch(z, z, z, rtt.astype(np.int64)), plan)
    with pytest.raises(ValueError, match=r"batch.prefix_lens must have shape \(2,\)"):
        kc.build_plan(kc.Batch(z, np.zeros(3, np.int64), z, rtt), plan)


def test_arrays_on_two_devices_are_rejected():
    dev = kc.from_pointer(0x10000, (1,), np.int32, device=0)
    with pytest.raises(ValueError, match=r"must live on one device, got host, cuda:0"):
        kc.VerifyContext(kc.CanaryBuffer.allocate(16), kc.ViolationSink.allocate(8), chain_position_assert=dev)


def test_validation_never_touches_the_driver(monkeypatch):
    from kvcanary.runtime import driver
    monkeypatch.setattr(driver, "init", lambda: (_ for _ in ()).throw(AssertionError("driver touched")))
    test_marshal_2d_rule_is_the_seed_message()
    test_write_argument_rules()


# ---- errors that point at the right thing (issue 31) -------------------------------------------------
def _small_canary(max_batch=8, n=64):
    k, v = np.zeros((n, 16), np.uint8), np.zeros((n, 16), np.uint8)
    return kc.KvCanary(kc.PoolGroup(n, k_sources=[kc.source_from_slots(k)], v_sources=[kc.source_from_slots(v)]),
                       device=None, max_batch=max_batch)


def test_token_arrays_of_different_lengths_are_named_with_every_length():
    """Catches the error that blamed positions (3, like out_cache_loc) when input_ids (2) was short."""
    rtt = np.zeros((2, 8), np.int32)
    b = kc.Batch(req_pool_indices=np.array([1]), prefix_lens=np.array([0]), extend_lens=np.array([3]),
                 req_to_token=rtt, input_ids=np.arange(2), positions=np.arange(3), out_cache_loc=np.arange(1, 4))
    with pytest.raises(ValidationError, match=r"kv-canary: the batch's per-token arrays must .* all of one length, "
                                              r"got input_ids 2, positions 3, out_cache_loc 3\. Fix: "):
        _small_canary().before_forward(b)


def test_a_batch_over_max_batch_names_the_setting_the_user_made():
    """Catches "Fix: StepPlan.allocate(max_batch>=10, ...)" for a KvCanary(max_batch=8) user."""
    rtt = np.zeros((11, 8), np.int32)
    b = kc.Batch(req_pool_indices=np.arange(1, 11), prefix_lens=np.zeros(10, np.int64),
                 extend_lens=np.ones(10, np.int64), req_to_token=rtt, input_ids=np.arange(10),
                 positions=np.zeros(10, np.int64), out_cache_loc=np.arange(1, 11))
    with pytest.raises(ValidationError, match=r"batch size must be <= max_batch \(8\), got 10 requests\. "
                                              r"Fix: build the canary with KvCanary\(max_batch>=10\)"):
        _small_canary(max_batch=8).before_forward(b)


def test_a_stack_of_layers_is_refused_by_source_from_slots_not_read_as_slots():
    """Catches a [layers, slots, heads, dim] tensor read as 4 slots (then blamed for covering too few)."""
    with pytest.raises(ValidationError, match=r"source_from_slots\(pool\) takes one layer's pool.*got a 4-D array of "
                                              r"shape \(4, 64, 2, 8\).*Fix: pass pool\[layer\], or "
                                              r"kvcanary.sources_from_layers\(pool\)"):
        kc.source_from_slots(np.zeros((4, 64, 2, 8), np.uint8))
    per_layer = kc.sources_from_layers(np.zeros((4, 64, 2, 8), np.uint8))  # what the fix says works
    assert len(per_layer) == 4


def test_a_pool_row_that_is_no_multiple_of_16_bytes_says_so_plainly():
    """Catches "got '250 bytes per slot (shape (64, 250))' (str)": a type tag leaking into the message."""
    with pytest.raises(ValidationError) as err:
        kc.source_from_slots(np.zeros((64, 250), np.uint8))
    assert "got 250 bytes per slot (shape (64, 250))" in str(err.value) and "(str)" not in str(err.value)
