"""A CI-sized fault-injection campaign on the CPU reference backend (issue 5): every class of
FAULTS.md that a hash mode covers is caught in every injection that really happened and was read;
the pairs a mode cannot see are marked "not covered"; clean runs report nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcanary.sim import campaign
from kvcanary.sim.faults import CLASSES, MODES, coverage
from kvcanary.sim.report import format_table, passed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def reduced():
    return campaign.run_campaign(CLASSES, MODES, injections=2, seed=2024)


def test_coverage_table_follows_faults_md():
    blind = {c for c in CLASSES if not coverage(c, "none")[0]}
    # FAULTS.md's four, plus K9: padding lanes carry no canary work, a stray padding write changes bytes only
    assert blind == {"K6", "K7", "K9", "K10", "K12"}
    assert all(coverage(c, m)[0] for c in CLASSES for m in ("partial", "all"))


def test_every_covered_class_is_caught_in_every_exercised_injection(reduced):
    for c in CLASSES:
        for m in MODES:
            cell = reduced["cells"][f"{c}/{m}"]
            if not coverage(c, m)[0]:
                assert cell == {"covered": False, "note": coverage(c, m)[1]}
                continue
            assert cell["missed"] == 0, (c, m, [r for r in reduced["runs"] if r["outcome"] == "missed"])
            assert cell["detected"] >= 1, (c, m, cell)            # never vacuous: the fault was read
            assert cell["detected"] + cell["not_exercised"] == cell["injections"] == 2
            assert cell["clean_violations"] == 0 and cell["errors"] == 0, (c, m, cell)
    for r in reduced["runs"]:
        if r["outcome"] == "detected":
            assert r["read_step"] is not None and r["injected_step"] <= r["report_step"]
            assert r["evidence"]["variant"]
    assert passed(reduced)
    table = format_table(reduced)
    assert "not covered" in table and "K13" in table


def test_read_path_faults_are_reported_when_read():
    # Identity and fingerprint checks fire on the step that reads the corruption (PARTIAL sees
    # the first 16 bytes of a strip: the flip lands there).
    for cls, mode in (("K3", "none"), ("K12", "partial"), ("K5", "all"), ("K1", "none")):
        r = campaign.run_injection(cls, mode, seed=77)
        assert r["outcome"] == "detected", r
        assert r["report_step"] == r["read_step"], r


def test_raise_mode_detects_like_log_mode():
    for cls in ("K2", "K10"):
        log = campaign.run_injection(cls, "all", seed=5)
        raised = campaign.run_injection(cls, "all", seed=5, report="raise")
        assert raised["outcome"] == log["outcome"] == "detected"
        assert raised["report_step"] == log["report_step"]


def test_clean_run_verifies_a_million_slots_without_false_positives():
    r = campaign.clean_run(10**6, hash_mode="all", seed=3)
    assert r["verified_slots"] >= 10**6
    assert r["false_positives"] == 0, r["first_false_positives"]
    w = r["workload"]
    assert w["finished"] and w["prefix_hit_tokens"] and w["drafts_rejected"] and w["swept_slots"], w


def test_demo_cli_runs_with_tiny_flags(tmp_path):
    cmd = [sys.executable, "-m", "kvcanary", "demo", "--injections", "1", "--classes", "K3,K9,K12",
           "--modes", "none,partial", "--backend", "cpu", "--clean-slots", "20000", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "not covered" in p.stdout and "clean run" in p.stdout
    data = json.loads((tmp_path / "campaign.json").read_text())
    assert data["cells"]["K9/none"]["covered"] is False and data["cells"]["K3/none"]["covered"] is True
    assert data["clean_runs"][0]["false_positives"] == 0


@pytest.mark.gpu
def test_reduced_campaign_and_clean_run_on_the_gpu():
    res = campaign.run_campaign(CLASSES, MODES, injections=2, seed=2024, backend="gpu")
    assert passed(res), format_table(res)
    assert all(c["detected"] >= 1 for c in res["cells"].values() if c["covered"]), format_table(res)
    clean = campaign.clean_run(10**6, hash_mode="all", backend="gpu", seed=3)
    assert clean["verified_slots"] >= 10**6 and clean["false_positives"] == 0, clean["first_false_positives"]
