"""GPU tier: records that travel, on the device (kvc_copy_records): a device canary's export
equals the host canary's byte for byte, a device import at other slots verifies clean, the
device records cross to a host canary through bytes and back, and a device slot outside the
pool is reported (SLOT_OUT_OF_RANGE) without touching memory."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import FailReason
from kvcanary.manager.canary import KvCanary, PoolGroup
from kvcanary.ops.records import CanaryRecords
from kvcanary.runtime import memory

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]  # no GPU: kernels run in tests/emu

N, BPT, LEN = 96, 32, 6
SRC, DST = [5, 6, 7, 8, 9, 10], [40, 33, 71, 12, 55, 60]


def side(device, seed):
    rng = np.random.default_rng(seed)
    k, v = (rng.integers(0, 256, (N, BPT), dtype=np.uint8) for _ in range(2))
    put = (lambda a: a) if device is None else (lambda a: memory.to_device(a))  # noqa: E731
    pools = [put(k), put(v)]
    records = []
    canary = KvCanary(PoolGroup(N, [kc.source_from_slots(pools[0])], [kc.source_from_slots(pools[1])]),
                      device=device, hash_mode="partial", max_batch=2, verify_capacity=256, export=records.append)
    return canary, (k, v), pools, records


def batch(device, slots, prefix, extend, tokens, positions):
    put = (lambda a: a) if device is None else (lambda a: memory.to_device(np.ascontiguousarray(a)))  # noqa: E731
    rtt = np.zeros((2, 32), np.int32)
    rtt[1, :len(slots)] = slots
    new = np.array(slots[prefix:prefix + extend], np.int64)
    return kc.Batch(put(np.array([1], np.int64)), put(np.array([prefix], np.int64)), put(np.array([extend], np.int64)),
                    put(rtt), put(np.array(tokens, np.int64)), put(np.array(positions, np.int64)), put(new))


def prefill(canary, device):
    b = batch(device, SRC, 0, LEN, list(range(100, 100 + LEN)), list(range(LEN)))
    canary.before_forward(b)
    canary.after_forward(b)


def test_device_export_equals_host_export_and_imports_clean():
    host, (k, v), _, _ = side(None, 1)
    dev, _, dpools, _ = side(0, 1)
    prefill(host, None)
    prefill(dev, 0)
    r_host, r_dev = host.export_records(SRC), dev.export_records(memory.to_device(np.array(SRC, np.int64)))
    np.testing.assert_array_equal(r_dev.to_host().records, r_host.records)
    assert r_dev.descriptor == r_host.descriptor
    # device -> device import at other slots, in another order; then the first read is clean
    dst, _, dpools2, recs = side(0, 2)
    for a, b in zip(dpools, dpools2):
        h = b.numpy()
        h[DST] = a.numpy()[SRC]
        b.copy_from_host(h)
    dst.import_records(DST, r_dev)
    after = DST + [80]
    b2 = batch(0, after, LEN, 1, [999], [LEN])
    dst.before_forward(b2)
    dst.after_forward(b2)
    dst.flush()
    assert [r for r in recs if r["type"] == "violation"] == []
    # and through bytes into a host canary
    h2, (hk, hv), _, hrecs = side(None, 3)
    hk[DST], hv[DST] = k[SRC], v[SRC]
    h2.import_records(DST, CanaryRecords.from_bytes(r_dev.to_bytes()))
    b3 = batch(None, after, LEN, 1, [999], [LEN])
    h2.before_forward(b3)
    h2.after_forward(b3)
    assert [r for r in hrecs if r["type"] == "violation"] == []


def test_device_slots_outside_the_pool_are_reported_not_read():
    dev, _, _, recs = side(0, 4)
    prefill(dev, 0)
    r = dev.export_records(memory.to_device(np.array([5, -1, N + 7, 6], np.int64)))
    dev.flush()
    rows = [x for x in recs if x["type"] == "violation"]
    assert sorted(x["slot_idx"] for x in rows) == [-1, N + 7]
    assert all(x["fail_reason_bits"] == int(FailReason.SLOT_OUT_OF_RANGE) for x in rows)
    host = r.to_host().records
    assert not host[:, 1].any() and not host[:, 2].any() and host[:, 0].any()  # bad slots: nothing copied


@pytest.mark.parametrize("device", [None, 0])
def test_a_scalar_slot_is_refused_alike_on_both_backends(device):
    # the campaign's K5 injector once passed dst[i]: the host canary took it as [i], the device
    # canary raised a type error; one slot is [i] on both
    canary, _, _, _ = side(device, 5)
    for scalar in (5, np.int64(5), np.array(5)):
        with pytest.raises(kc.ValidationError, match=r"got the scalar 5 .*\[5\] for one slot"):
            canary.export_records(scalar)
