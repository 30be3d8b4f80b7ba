"""GPU tier: the fault-injection campaign (issue 5) end to end on the device backend: the
simulated engine's steps go through KvCanary and the real kernels (prepare, fused verify, write,
the pump's snapshot). Without a GPU it runs in the CPU emulator (tests/emu), which checks the
kernels inside the whole step loop, not only one launch at a time."""

from __future__ import annotations

import pytest

from kvcanary.sim import campaign
from kvcanary.sim.clean import clean_run
from kvcanary.sim.faults import coverage

pytestmark = [pytest.mark.gpu, pytest.mark.emulated]

CLASSES = ("K1", "K2", "K3", "K5", "K8", "K11", "K12", "K13")  # prefix, free, maps, copies, spec, positions, bytes, tokens


def test_device_campaign_catches_every_exercised_injection():
    result = campaign.run_campaign(CLASSES, ("none", "all"), injections=1, backend="gpu", seed=7)
    exercised = 0
    for key, cell in result["cells"].items():
        c, m = key.split("/")
        if not coverage(c, m)[0]:
            continue
        exercised += cell["detected"] + cell["missed"]
        assert cell["missed"] == 0, (key, cell)
    assert exercised >= 8


def test_device_clean_run_reports_nothing():
    """50 requests a step (so the fused verify runs request-major tasks), SWA, drafts, offload and
    sweeps: nothing is reported."""
    r = clean_run(100_000, hash_mode="partial", backend="gpu", seed=3, max_running=48, admit_per_step=48,
                           num_slots=1 << 16, prompt_len=(100, 400), verify_capacity=1 << 18)
    assert r["verified_slots"] >= 100_000
    assert r["false_positives"] == 0, r["first_false_positives"]
