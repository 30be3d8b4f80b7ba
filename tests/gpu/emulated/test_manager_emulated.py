"""GPU tier, emulated without a GPU: the scripted session on the device equals the CPU reference
(records and buffers, with faults, SWA windows, the fingerprint budget, the self-test), and the
pump's kvc_snapshot copies the status block before its completion word."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.reporting.pump import DEPTH, Pump
from kvcanary.runtime import memory
from tests.support import swa_window
from tests.support.session import Session, host_buffers, violation_key
from tests.test_fingerprint_budget import (
    BOUNDARY_CASES,
    budget_by_hand,
    reported_positions,
)
from tests.test_manager import _flip_kv, _wrong_position, _wrong_rtt

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]  # no GPU: the kernels run in tests/emu


# fresh device arrays every step: patched launches
@pytest.mark.parametrize("swa", [False, True])
@pytest.mark.parametrize("fault", [None, "rtt", "kv", "pos"])
def test_session_on_gpu_equals_reference(swa, fault):
    corrupt = {None: None, "rtt": _wrong_rtt, "kv": _flip_kv, "pos": _wrong_position}[fault]
    at = {None: None, "rtt": 3, "kv": 4, "pos": 2}[fault]
    host = Session(swa=swa, chain_position_assert=True)
    dev = Session(0, swa=swa, chain_position_assert=True)
    assert violation_key(host.script(at, corrupt)) == violation_key(dev.script(at, corrupt))
    hb, db = host_buffers(host.canary), host_buffers(dev.canary)
    for name in hb:
        np.testing.assert_array_equal(hb[name], db[name], err_msg=str(name))
    assert host.canary.stats()["verified_slots"] == dev.canary.stats()["verified_slots"]
    dev.canary.health_check()


@pytest.mark.parametrize("every", [2, 3, 100])
@pytest.mark.parametrize("fault", [None, "kv"])
def test_fingerprint_budget_on_gpu_equals_reference(every, fault):
    """KvCanary(fingerprint_every=N): the TAIL verifies fingerprint a rotating share of the cached
    tokens (docs/format.md §6.1); rows, buffers and counters equal the reference's."""
    corrupt = None if fault is None else _flip_kv
    host = Session(fingerprint_every=every)
    dev = Session(0, fingerprint_every=every)
    assert violation_key(host.script(4, corrupt)) == violation_key(dev.script(4, corrupt))
    assert ring_rows(host.canary) == ring_rows(dev.canary)
    hb, db = host_buffers(host.canary), host_buffers(dev.canary)
    for name in hb:
        np.testing.assert_array_equal(hb[name], db[name], err_msg=str(name))
    dev.canary.health_check()


@pytest.mark.parametrize("every,prefills", BOUNDARY_CASES)
def test_the_kernels_fingerprint_exactly_the_formats_positions(every, prefills):
    """Catches an off-by-one at the budget's "newest N tokens" boundary in the fused verify kernels
    (the session above never puts a fingerprinted position at the boundary that both sides would
    see differently): the exact set per request and phase, against docs/format.md §6.1 by hand."""
    steps = every + 1
    assert reported_positions(0, every, prefills, steps) == budget_by_hand(every, prefills, steps)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit-plan"])
@pytest.mark.parametrize("zero_position", [5, 7], ids=["out-of-window-predecessor", "inside-the-window"])
@pytest.mark.parametrize("hash_mode,layers", swa_window.VARIANTS, ids=["narrow", "many", "wide", "identity"])
def test_an_swa_windows_slot_0_is_judged_as_the_reference_judges_it(hash_mode, layers, zero_position, fused):
    """Catches the padding-slot rule applied to the first SWA entry's out-of-window predecessor in
    any fused-verify variant (a false PADDING_SLOT_READ on a healthy request), and a 0 inside the
    window not reported: the kernels' rows equal the reference's, which tests/test_swa_window.py
    holds to docs/format.md §8."""
    want = swa_window.run(None, hash_mode, layers, zero_position, fused)
    assert (want == []) == (zero_position == 5)
    assert swa_window.run(0, hash_mode, layers, zero_position, fused) == want


class HeadRecordChanged(Session):
    """A session whose forward also changes one field of the HEAD K record of one new token (entry
    `entry` of step `at`) after before_forward: the record the later writes of the step (HEAD V,
    TAIL K, TAIL V) take their chain from on the device (docs/format.md §7, the chain once per step)."""

    def __init__(self, device=None, *, at, entry, field, **kw):
        super().__init__(device, **kw)
        self.at, self.entry, self.field = at, entry, field

    def forward(self, arrays):
        super().forward(arrays)
        if self.step_no != self.at:
            return
        arr = self.canary.ctx[("HEAD", "FULL", "K", "write")].buffer.array
        host = arr if isinstance(arr, np.ndarray) else arr.numpy()
        words = host.view(np.int64).reshape(host.shape[0], -1)
        words[int(arrays["loc"][self.entry]), self.field] ^= 0x10
        if not isinstance(arr, np.ndarray):
            arr.copy_from_host(host)


@pytest.mark.parametrize("at,entry", [(0, 0), (0, 5), (0, 11), (1, 1), (3, 1)])
@pytest.mark.parametrize("field", [kc.abi.FIELD_TOKEN, kc.abi.FIELD_POSITION, kc.abi.FIELD_PREV_HASH])
def test_a_head_record_changed_before_tail_is_not_copied_into_tail(at, entry, field):
    """TAIL takes the step's chain from HEAD K only when every link checks out: a HEAD K record
    changed between HEAD and TAIL (first, middle, last entry of a prefill; a decode entry) leaves
    TAIL K and V as the serial chain makes them (the reference); a changed position or chain is reported."""
    host = HeadRecordChanged(at=at, entry=entry, field=field, chain_position_assert=True)
    dev = HeadRecordChanged(0, at=at, entry=entry, field=field, chain_position_assert=True)
    recs = host.script()
    assert violation_key(recs) == violation_key(dev.script())
    if field != kc.abi.FIELD_TOKEN:  # a token changed at a request's last entry is what its successor chains on
        assert any(r["launch_tag"] == "HEAD_K_FULL" for r in recs if r["type"] == "violation")
    hb, db = host_buffers(host.canary), host_buffers(dev.canary)
    for name in hb:
        np.testing.assert_array_equal(hb[name], db[name], err_msg=str(name))


def ring_rows(canary):
    ring = canary._ring if isinstance(canary._ring, np.ndarray) else canary._ring.numpy()
    claim = int((canary.status if isinstance(canary.status, np.ndarray) else canary.status.numpy())[kc.abi.STATUS_CLAIM])
    return sorted(map(tuple, ring[:claim].tolist()))


@pytest.mark.parametrize("fused", [True, False])
def test_self_test_on_gpu_equals_reference(fused):
    host = Session(self_test_every=2, fused=fused)
    dev = Session(0, self_test_every=2, fused=fused)
    assert violation_key(host.script(3, _wrong_rtt)) == violation_key(dev.script(3, _wrong_rtt))
    assert ring_rows(host.canary) == ring_rows(dev.canary)  # the self-test rows included, byte for byte
    tests = [r for r in ring_rows(dev.canary) if r[7] & kc.FailReason.SELF_TEST]
    assert [r[6] for r in tests] == [2, 4, 6]  # expected aux: the runs 2, 4, 6 of the 7-step script's HEAD K verify
    assert host.canary.stats()["self_tests"] == dev.canary.stats()["self_tests"] == 3
    dev.canary.health_check()


@pytest.mark.parametrize("fused", [True, False])
def test_the_kernels_self_test_fails_the_health_check_once_its_record_looks_right(fused):
    """Catches a device self-test that cannot fail: one that set the position-mismatch bit without
    comparing the record's position would still send the known-bad row, so the health check would
    pass. With the canary-only record corrected (the position docs/format.md §11 expects), the
    kernel's check finds nothing wrong: its rows stop matching the known-bad one, none is counted,
    and the health check fails."""
    from kvcanary import abi
    from kvcanary.manager.canary import Key
    dev = Session(0, self_test_every=2, fused=fused)
    ctx = dev.canary.ctx[Key("HEAD", "FULL", "K", "verify")]
    ctx._self_test.copy_from_host(np.array([abi.SELF_TEST_TOKEN, abi.SELF_TEST_POSITION, 0, 0], np.int64))
    dev.script()
    assert [r for r in dev.records if r["type"] == "violation"] == []  # self-test rows are never reported
    assert dev.canary.stats()["self_tests"] == 0
    with pytest.raises(kc.KvCanaryError, match=r"self-test: 0 of 3 expected self-test rows arrived.*did not match"):
        dev.canary.health_check()


def test_snapshot_kernel_copies_the_status_block_then_its_completion_word():
    host = np.arange(1, 301, dtype=np.int64) * -3  # a few hundred words, more than one block's pass
    status = memory.to_device(host)
    pump = Pump(status, memory.zeros((4, kc.abi.RING_COLS), np.int64), 4, 0)
    s = memory.new_stream(0)
    for k in range(2 * DEPTH + 1):  # every slot used twice
        pump.snapshot(s, k)
        deadline, taken = time.monotonic() + 5, []
        while not taken and time.monotonic() < deadline:  # plain loads of pinned memory, no driver call
            taken = pump.take()
        assert [m for _, m in taken] == [k], "the completion word never became visible to the host"
        assert taken[0][0] == host.tolist()
    assert pump.launches == 2 * DEPTH + 1 and pump.skipped == 0
