"""GPU tier (emulated without a GPU): the launches a small step saves (issue 29).

- HEAD's plan build folded into its paired writes (kvc_prepare_write_pair, a block per request):
  the session, hostile batch values and a later step's verdicts equal the CPU reference and the
  unfolded device step, word for word (rows, buffers, request verdicts, the failed count);
- the pump's snapshot taken by the step's last launch (kvc_step_end: its last block to finish):
  one per eager step, no kvc_snapshot launch, each step's violations in that step's report.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.ops import backends
from tests.support.session import Session, host_buffers, violation_key
from tests.test_manager import _flip_kv, _wrong_rtt

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]  # no GPU: the kernels run in tests/emu


def words(a, device) -> np.ndarray:
    """A canary's verdict words or failed count (a device view: copied back) as host int64."""
    if device is None:
        return np.array(a, np.int64)
    from kvcanary.runtime import memory
    return memory.copy_to_host_ptr(np.zeros(a.shape, np.int64), a.ptr, device)


def head_kernels(canary) -> list[str]:
    """The kernels of the HEAD stage's last packed layout."""
    cache = canary.stages.packed["HEAD"]
    return [launch.name for launch in next(reversed(cache.entries.values())).launches]


def folded(canary) -> bool:
    """HEAD's first launch builds the plan (either variant: a warp per half, or the block's path too)."""
    return head_kernels(canary)[0] in ("kvc_prepare_write_pair_warps", "kvc_prepare_write_pair")


@pytest.fixture(params=[True, False], ids=["folded", "apart"])
def fold(request, monkeypatch):
    monkeypatch.setattr(backends, "FOLD", request.param)
    return request.param


@pytest.mark.parametrize("fault", [None, "rtt", "kv"])
def test_a_session_equals_the_reference_with_the_build_folded_or_apart(fold, fault):
    corrupt = {None: None, "rtt": _wrong_rtt, "kv": _flip_kv}[fault]
    at = {None: None, "rtt": 3, "kv": 4}[fault]
    host, dev = Session(chain_position_assert=True), Session(0, chain_position_assert=True)
    assert violation_key(host.script(at, corrupt)) == violation_key(dev.script(at, corrupt))
    assert folded(dev.canary) == fold  # the script's steps are small: folded unless KVCANARY_FOLD=0
    hb, db = host_buffers(host.canary), host_buffers(dev.canary)
    for name in hb:
        np.testing.assert_array_equal(hb[name], db[name], err_msg=str(name))
    np.testing.assert_array_equal(words(host.canary.verdicts, None), words(dev.canary.verdicts, 0))
    assert words(host.canary.failed_count, None).tolist() == words(dev.canary.failed_count, 0).tolist()
    dev.canary.health_check()


def _canary(device, records=None):
    """A K + V canary over one pool (identity only), for a req_to_token of 6 rows x 16."""
    return kc.KvCanary(kc.PoolGroup(64), device=device, hash_mode="none", mode="log", max_batch=6,
                       verify_capacity=256, export=(records if records is not None else []).append)


def _batch(device, rows, prefix, extend, rtt, ids, pos, loc):
    from kvcanary.runtime import memory
    D = (lambda a: a) if device is None else memory.to_device
    i64 = lambda v: D(np.array(v, np.int64))  # noqa: E731
    return kc.Batch(i64(rows), i64(prefix), i64(extend), D(np.array(rtt, np.int32)), i64(ids), i64(pos), i64(loc))


def _rtt():
    rtt = np.zeros((6, 16), np.int32)
    for r in range(1, 6):
        rtt[r, :8] = np.arange(8) + 8 * r  # rows 1..5 own slots 8r .. 8r + 7
    return rtt


# (rows, prefix, extend, new tokens' slots): each batch breaks one rule of docs/format.md §8 or takes
# a path of its own through the fold (QUIET: nothing to report)
HOSTILE = {
    "row past req_to_token": ([1, 9, 2], [0, 0, 0], [1, 1, 1], [8, 40, 16]),
    "prefix past max_len": ([1, 2], [0, 99], [1, 1], [8, 16]),
    "negative extend": ([1, 2, 3], [0, -0, 0], [1, -2, 1], [8, 16, 24]),
    "padding before a real row": ([1, 0, 3], [0, 0, 0], [1, 1, 1], [8, 0, 24]),
    "a token no request owns": ([1, 2], [0, 0], [1, 1], [8, 16, 17]),
    "fewer tokens than the requests own": ([1, 2], [0, 0], [2, 2], [8, 9, 16]),
    "a slot repeated in one request": ([1, 2], [0, 0], [3, 1], [8, 9, 8, 16]),
    "empty batch": ([], [], [], []),
    "a request past a warp's tokens (the block's path)": ([1, 2], [0, 0], [1, 40], [8] + list(range(16, 56))),
}
QUIET = ("a slot repeated in one request", "empty batch", "a request past a warp's tokens (the block's path)")


def _run(device, rows, prefix, extend, loc, steps=2):
    records = []
    canary = _canary(device, records)
    n = len(loc)
    batch = _batch(device, rows, prefix, extend, _rtt(), np.arange(n) + 100, np.zeros(n, np.int64), loc)
    for _ in range(steps):
        canary.before_forward(batch)
        canary.after_forward(batch)
    canary.flush()
    failed = sorted((r["step"], r["batch_index"], r["fail_reason_bits"]) for r in records if r["type"] == "failed_request")
    words_now = words(canary.verdicts, device).tolist(), words(canary.failed_count, device).tolist()
    buffers = {k: v.tolist() for k, v in canary.buffers().items()}
    return canary, (violation_key(records), failed, words_now, buffers)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_batch_values_in_the_folded_build_equal_the_build_apart(monkeypatch, case):
    """The host refuses these values before anything runs, so the reference here is the device's
    own kvc_prepare launch (whose values the plan tier checks against the CPU reference)."""
    rows, prefix, extend, loc = HOSTILE[case]
    got = {}
    for fold in (False, True):
        monkeypatch.setattr(backends, "FOLD", fold)
        canary, got[fold] = _run(0, rows, prefix, extend, loc)
        assert folded(canary) == fold
        if fold:  # past a warp's tokens the step takes the kernel with the block's path
            want = "kvc_prepare_write_pair" if len(loc) > 32 else "kvc_prepare_write_pair_warps"
            assert head_kernels(canary)[0] == want
    assert got[True] == got[False]
    assert case in QUIET or len(got[True][0]) > 0  # the others break a rule the kernels report


def test_the_fold_clears_the_last_steps_verdicts_in_and_past_the_new_batch(monkeypatch):
    """A step fails its last request (a row past req_to_token); the next step is clean: every verdict
    word is 0 again and the failed count 0 (docs/format.md §5.7: a step's words start clean), whether
    that request's block clears the word (the same batch size) or it lies past the new batch."""
    monkeypatch.setattr(backends, "FOLD", True)
    canary = _canary(0)
    bad = _batch(0, [1, 2, 9], [0, 0, 0], [1, 1, 1], _rtt(), [100, 101, 102], [0, 0, 0], [8, 16, 40])
    same = _batch(0, [1, 2, 3], [0, 0, 0], [1, 1, 1], _rtt(), [100, 101, 102], [0, 0, 0], [8, 16, 24])
    smaller = _batch(0, [1], [0], [1], _rtt(), [100], [0], [8])
    for clean in (same, smaller):
        canary.before_forward(bad)
        assert folded(canary)
        canary.after_forward(bad)
        assert list(words(canary.verdicts, 0)[:3] != 0) == [False, False, True]
        assert words(canary.failed_count, 0).tolist() == [1]
        canary.before_forward(clean)
        canary.after_forward(clean)
        assert words(canary.verdicts, 0).tolist() == [0] * 6
        assert words(canary.failed_count, 0).tolist() == [0]


def test_each_eager_step_takes_its_snapshot_in_its_last_launch():
    """No kvc_snapshot launch while stepping: each step's TAIL takes its snapshot (7 engine steps,
    7 snapshots), and a violation is reported as the step that found it, as the reference does."""
    host, dev = Session(), Session(0)
    dev.play(corrupt_at=4, corrupt=_flip_kv)
    pump = dev.canary.pump
    assert pump.launches == 0 and pump.folded == 7
    dev.canary.flush()  # its own snapshot launch, after the last step's
    assert pump.launches == 1 and dev.canary.step == 7
    want = violation_key(host.script(4, _flip_kv))
    assert violation_key(dev.records) == want and min(v[0] for v in want) == 4
