"""The fingerprint budget (docs/format.md §6.1) on the host backend: with
``KvCanary(fingerprint_every=N)`` every TAIL verify still checks every entry's chain, position and
token, but compares the real-KV fingerprint of an entry only when its position is the phase mod N
(phase: the HEAD verify's run count, so step k of a canary, counted from 0, has phase k + 1) or
when it is one of its request's last N cached positions. Expected steps are worked out from
§6.1 by hand; the device kernels are held to the reference in tests/gpu/emulated/test_manager_emulated.py."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.reference import plan as reference_plan
from tests.support.session import Session

PREFILL = 40


def reports(every: int, position: int, *, flip_before: int = 1, steps: int = 9) -> list[int]:
    """Steps in which TAIL K reports a real-KV mismatch when one K byte of the token at
    ``position`` is flipped just before step ``flip_before``: step 0 prefills 40 tokens, steps
    1.. decode one token each (position 40 is step 1's token)."""
    s = Session(fingerprint_every=every)
    s.step([(1, list(range(100, 100 + PREFILL)))])
    for k in range(1, steps + 1):
        if k == flip_before:
            slot = int(s.rtt[1, position])
            s.k[0][slot, 3] ^= 0x40  # inside the 16 bytes PARTIAL fingerprints
            s.sync_pools()
        s.step([(1, [200 + k])])
    s.canary.flush()
    rows = [r for r in s.records if r["type"] == "violation"]
    assert all(r["launch_tag"] == "TAIL_K_FULL" and r["fail_reason"] == ["verify_real_kv_hash"]
               and r["position"] == position for r in rows)
    return sorted({r["step"] for r in rows})


def test_every_step_by_default():
    assert reports(1, 5) == list(range(1, 10))


@pytest.mark.parametrize("every", [2, 4, 7])
@pytest.mark.parametrize("position", [0, 5, 6, 31])
def test_a_cached_token_is_checked_once_every_n_steps(every, position):
    # cached and outside every request's last `every` positions through step 9 (end >= 40)
    want = [k for k in range(1, 10) if (k + 1) % every == position % every]
    assert reports(every, position) == want
    assert want and want[0] - 1 <= every - 1  # reported at most N - 1 steps after its first read (step 1)


def test_the_newest_tokens_are_always_checked():
    # position 40 is step 1's new token, flipped before step 3: step k verifies positions
    # [0, 39 + k), whose last 4 (>= 35 + k) hold 40 through step 5; afterwards only the phase
    # 40 % 4 == 0 checks it (step 7: run count 8)
    assert reports(4, 40, flip_before=3) == [3, 4, 5, 7]


def test_the_rule_as_format_md_states_it():
    # every 4, phase counter 6 -> phase 2; a request verifying positions 0..11 (end 12)
    got = reference_plan.fingerprinted(np.arange(12), np.full(12, 12), 4, 6)
    assert np.flatnonzero(got).tolist() == [2, 6, 8, 9, 10, 11]
    assert reference_plan.fingerprinted(np.arange(3), np.full(3, 3), 1, 5) is None  # all


def test_identity_checks_still_run_every_step():
    s = Session(fingerprint_every=1000)
    s.step([(1, list(range(100, 100 + PREFILL)))])
    s.rtt[1, 7] = s.rtt[1, 8]  # a wrong index map entry: the chain breaks at position 8
    s.step([(1, [300])])
    s.canary.flush()
    assert any(r["type"] == "violation" and r["step"] == 1 and r["launch_tag"] == "HEAD_K_FULL" for r in s.records)


def test_options_are_checked():
    group = kc.PoolGroup(16, k_sources=[kc.RealKvSource(np.zeros((16, 64), np.uint8), 1, 64)])
    with pytest.raises(ValueError, match=r"^kv-canary: fingerprint_every must be an integer in \[1, 2147483647\], "
                                         r"got 0 \(int\)\. Fix: pass 1 "):
        kc.KvCanary(group, fingerprint_every=0)
    with pytest.raises(ValueError, match=r"^kv-canary: fingerprint_every=4 needs the fused verify, got "
                                         r"fused=False\. Fix: "):
        kc.KvCanary(group, fingerprint_every=4, fused=False)
    ctx = kc.VerifyContext(kc.CanaryBuffer.allocate(16), kc.ViolationSink.allocate(8), fingerprint_every=4)
    plan = kc.StepPlan.allocate(2, 4, materialize=True)
    with pytest.raises(ValueError, match=r"^kv-canary: verify\(\) fingerprints every entry of a materialised "
                                         r"plan, got a context with fingerprint_every=4"):
        kc.verify(ctx, plan)


def reported_positions(device, every: int, prefills: tuple[int, ...], steps: int) -> list[dict]:
    """Per decode step k = 1..steps: {row: positions whose TAIL K real-KV mismatch was reported}
    when one K byte of every cached token of every request is flipped during that step only
    (requests in rows 1.., prefilled at step 0 with ``prefills`` tokens, one new token a step)."""
    s = Session(device, fingerprint_every=every, ring_capacity=4096)
    s.step([(row, list(range(100 * row, 100 * row + n))) for row, n in enumerate(prefills, 1)])
    out = []
    for k in range(1, steps + 1):
        cached = [int(s.rtt[row, p]) for row in range(1, len(prefills) + 1) for p in range(s.lens[row])]
        s.k[0][cached, 3] ^= 0x40  # inside the 16 bytes PARTIAL fingerprints
        s.sync_pools()
        before = len(s.records)
        s.step([(row, [7000 + k]) for row in range(1, len(prefills) + 1)])
        s.canary.flush()
        s.k[0][cached, 3] ^= 0x40
        s.sync_pools()
        got: dict = {}
        for r in s.records[before:]:
            if r["type"] == "violation":
                assert r["launch_tag"] == "TAIL_K_FULL" and r["fail_reason"] == ["verify_real_kv_hash"], r
                row = next(i for i in range(1, len(prefills) + 1) if r["slot_idx"] in s.rtt[i, :s.lens[i]])
                got.setdefault(row, set()).add(r["position"])
        out.append(got)
    return out


def budget_by_hand(every: int, prefills: tuple[int, ...], steps: int) -> list[dict]:
    """docs/format.md §6.1: in step k (phase k + 1) a request whose verified positions end at
    ``end`` (its cached tokens: prefill + k - 1) has position p fingerprinted when
    p mod N == (k + 1) mod N, or p >= end - N."""
    out = []
    for k in range(1, steps + 1):
        want = {}
        for row, n in enumerate(prefills, 1):
            end = n + k - 1
            want[row] = {p for p in range(end) if p % every == (k + 1) % every or p >= end - every}
        out.append(want)
    return out


BOUNDARY_CASES = [(2, (3, 8)), (3, (2, 3, 4)), (5, (4, 5, 6, 13))]  # prefills below, at and above N


@pytest.mark.parametrize("every,prefills", BOUNDARY_CASES)
def test_the_exact_fingerprinted_positions_are_the_formats(every, prefills):
    """Catches an off-by-one at the "newest N tokens" boundary (``>=`` read as ``>``): the exact
    set of fingerprinted positions of every request, in every phase, against §6.1 by hand, with
    requests shorter than, as long as and longer than N."""
    steps = every + 1  # every phase, and one more
    assert reported_positions(None, every, prefills, steps) == budget_by_hand(every, prefills, steps)
