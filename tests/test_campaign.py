"""A CI-sized fault-injection campaign on the CPU reference backend (issue 5): every class of
FAULTS.md that a hash mode covers is caught in every injection that really happened and was read;
the pairs a mode cannot see are marked "not covered"; clean runs report nothing."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from kvcanary.cli import demo
from kvcanary.errors import ValidationError, ValidationTypeError
from kvcanary.sim import campaign, workers
from kvcanary.sim.clean import clean_run, merge_clean_runs
from kvcanary.sim.faults import CLASSES, MODES, coverage
from kvcanary.sim.output import format_table, not_covered_lines, passed, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def reduced():
    return campaign.run_campaign(CLASSES, MODES, injections=2, seed=2024)


def test_coverage_table_follows_faults_md():
    blind = {c for c in CLASSES if not coverage(c, "none")[0]}
    # FAULTS.md's four, and issue 43's two (a lost store and a zeroing change bytes only); K9 is
    # seen in every mode (the plan builder checks the padding lanes' slots)
    assert blind == {"K6", "K7", "K10", "K12", "K14", "K5b"}
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


@pytest.mark.parametrize("mode", ["partial", "all"])
def test_lost_writes_are_caught_in_the_step_that_lost_them(mode):
    """K14 (issue 43): every variant is reported by the lost-write check of the TAIL write of the
    step whose store was lost, before the stale bytes are first read."""
    variants = set()
    for seed in range(6):
        r = campaign.run_injection("K14", mode, seed=seed)
        assert r["outcome"] == "detected", r
        assert r["report_step"] == r["injected_step"] <= r["read_step"], r
        assert r["first_report"]["reasons"] == ["lost_write"] and r["first_report"]["tag"].startswith("TAIL"), r
        variants.add(r["variant"].split(" (")[0])
    assert len(variants) >= 2, variants


def test_lost_writes_are_missed_without_the_check(monkeypatch):
    """The K14 scenario is real: without the lost-write check the stale bytes are stamped as the
    truth and every later read passes (the fault is read, nothing is reported)."""
    import numpy as np

    from kvcanary.reference import canary as reference
    none = np.zeros(0, np.int64)
    monkeypatch.setattr(reference, "lost_writes", lambda *a: (none, none, none))
    r = campaign.run_injection("K14", "all", seed=0)
    assert r["outcome"] == "missed" and r["read_step"] is not None, r


def test_late_zeroing_is_caught_at_the_first_read():
    seen = set()
    for seed in range(6):
        r = campaign.run_injection("K5b", "partial", seed=seed)
        assert r["outcome"] in ("detected", "not_exercised"), r
        if r["outcome"] == "detected":
            assert r["read_latency"] == 0, r  # reported in the step that first read the zeros
            assert "verify_real_kv_hash" in r["first_report"]["reasons"], r
            seen.add(r["variant"])
    assert seen == {"restored block zeroed after it landed", "neighbouring live block zeroed"}, seen


def test_raise_mode_detects_like_log_mode():
    for cls in ("K2", "K10"):
        log = campaign.run_injection(cls, "all", seed=5)
        raised = campaign.run_injection(cls, "all", seed=5, report="raise")
        assert raised["outcome"] == log["outcome"] == "detected"
        assert raised["report_step"] == log["report_step"]


def test_clean_run_verifies_a_million_slots_without_false_positives():
    r = clean_run(10**6, hash_mode="all", seed=3)
    assert r["verified_slots"] >= 10**6
    assert r["false_positives"] == 0, r["first_false_positives"]
    w = r["workload"]
    assert w["finished"] and w["prefix_hit_tokens"] and w["drafts_rejected"] and w["swept_slots"], w


@pytest.mark.parametrize("jobs", [1, 2])
def test_demo_cli_runs_with_tiny_flags(tmp_path, jobs):
    cmd = [sys.executable, "-m", "kvcanary", "demo", "--injections", "1", "--classes", "K3,K9,K12",
           "--modes", "none,partial", "--backend", "cpu", "--clean-slots", "20000", "--out", str(tmp_path),
           "--jobs", str(jobs)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "not covered in none: K12" in p.stdout and "clean run" in p.stdout
    data = json.loads((tmp_path / "campaign.json").read_text())
    assert data["cells"]["K12/none"]["covered"] is False and data["cells"]["K3/none"]["covered"] is True
    assert data["cells"]["K9/none"]["covered"] is True
    assert data["clean_runs"][0]["false_positives"] == 0
    assert data["clean_runs"][0].get("runs", 1) == jobs        # --jobs reaches the clean run too


def test_parallel_campaign_matches_the_serial_one():
    # A class with an uncovered mode (K12/none) checks that cells are assembled in the serial order.
    classes, modes = ["K1", "K9", "K12"], ["none", "partial"]
    serial = campaign.run_campaign(classes, modes, injections=2, seed=11)
    seen = []
    parallel = campaign.run_campaign(classes, modes, injections=2, seed=11, jobs=2,
                                     progress=lambda done, total, label: seen.append((done, total)))
    assert parallel["cells"] == serial["cells"]
    assert parallel["runs"] == serial["runs"]          # outcomes, latencies, seeds, evidence, in order
    assert [r["seed"] for r in parallel["runs"]] == [
        campaign.seed_for(11, c, m, i) for c in classes for m in modes if coverage(c, m)[0] for i in range(2)]
    total = len(serial["runs"])
    assert seen == [(k, total) for k in range(1, total + 1)]   # advanced once per injection, in the parent
    assert {k: v for k, v in parallel.items() if k != "seconds"} == {k: v for k, v in serial.items()
                                                                     if k != "seconds"}


def test_worker_failures_are_raised_not_dropped():
    # An injection that cannot even build its engine raises in the serial run; in a worker it must
    # raise too (same exception, naming the injection), not come back as a shorter campaign.
    with pytest.raises(Exception) as serial:
        campaign.run_campaign(["K3"], ["partial"], injections=2, report="bogus")
    with pytest.raises(type(serial.value)) as parallel:
        campaign.run_campaign(["K3"], ["partial"], injections=2, report="bogus", jobs=2)
    assert str(parallel.value) == str(serial.value)
    assert any("injection K3 partial seed" in note for note in parallel.value.__notes__)


def test_parallel_clean_run_merges_its_runs(tmp_path):
    min_verified, jobs = 60_000, 2
    single = clean_run(min_verified, hash_mode="all", seed=3)
    merged = clean_run(min_verified, hash_mode="all", seed=3, jobs=jobs)
    assert set(merged) == set(single) | {"runs"} and merged["runs"] == jobs
    assert merged["verified_slots"] >= min_verified and merged["steps"] >= jobs
    assert merged["false_positives"] == 0 and merged["first_false_positives"] == []
    assert merged["protected_tokens"] > 0 and merged["workload"]["requests"] > 0
    # the demo's reporting takes the merged dict like a single run's
    assert passed({"cells": {}}, [merged]) and "over 2 runs" in format_table(
        campaign.run_campaign(["K3"], ["partial"], injections=1), [merged])
    write_json({}, [merged], str(tmp_path / "c.json"))
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["clean_runs"][0]["runs"] == jobs


def test_merge_clean_runs_sums_counts_and_keeps_five_false_positives():
    def run(fps, steps, **workload):
        return dict(hash_mode="all", backend="cpu", steps=steps, verified_slots=10 * steps,
                    protected_tokens=steps, false_positives=len(fps), first_false_positives=fps[:5],
                    workload=workload, seconds=1.0)
    a = run([{"slot": i} for i in range(4)], 3, requests=2, finished=1)
    b = run([{"slot": 10 + i} for i in range(3)], 5, requests=1, swept_slots=7)
    m = merge_clean_runs([a, b], seeds=[7, 8])
    assert (m["steps"], m["verified_slots"], m["protected_tokens"]) == (8, 80, 8)
    assert (m["false_positives"], m["runs"]) == (7, 2)
    assert m["workload"] == {"requests": 3, "finished": 1, "swept_slots": 7}
    assert [(v["slot"], v["run_seed"]) for v in m["first_false_positives"]] == [
        (0, 7), (1, 7), (2, 7), (3, 7), (10, 8)]      # run order, the first five
    assert not passed({"cells": {}}, [m])


def test_jobs_flag():
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert p.parse_args([]).jobs == "auto"
    assert p.parse_args(["--jobs", "4"]).jobs == "4"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert workers.resolve_jobs("auto", "cpu") == cpus      # the default: every usable CPU ...
    assert workers.resolve_jobs("auto", "gpu") == 1         # ... but no workers sharing one GPU
    assert workers.resolve_jobs(0) == workers.resolve_jobs("0") == cpus
    assert workers.resolve_jobs(3) == workers.resolve_jobs(" 3 ") == 3 and workers.resolve_jobs(1) == 1
    for bad in (-1, "-2", "many", "1.5"):
        with pytest.raises(ValidationError, match=r"^kv-canary: --jobs .*Fix: "):
            workers.resolve_jobs(bad)
    with pytest.raises(ValidationTypeError, match="kv-canary: jobs must be an int"):
        workers.resolve_jobs(2.0)
    with pytest.raises(ValidationError, match="--jobs"):
        demo.run(p.parse_args(["--jobs", "-2", "--backend", "cpu"]))


@pytest.mark.parametrize("n", [0, -1])
def test_a_campaign_without_injections_is_rejected_not_a_success(n):
    with pytest.raises(ValidationError, match=r"^kv-canary: --injections must be >= 1, got -?\d.*Fix: "):
        campaign.run_campaign(["K3"], ["none"], injections=n)
    with pytest.raises(ValidationTypeError, match="kv-canary: injections must be an int"):
        campaign.run_campaign(["K3"], ["none"], injections=2.5)


def test_modes_and_classes_spelling():
    assert demo.parse_list("all", MODES, "--modes", "") == ["all"]          # hash mode ALL alone
    assert demo.parse_list("every", MODES, "--modes", "") == ["none", "partial", "all"]
    assert demo.parse_list("PARTIAL, all,partial", MODES, "--modes", "") == ["partial", "all"]
    assert demo.parse_list("every", CLASSES, "--classes", "") == list(CLASSES)
    assert demo.parse_list("k12,K1", CLASSES, "--classes", "") == ["K12", "K1"]
    for bad in ("", "al", "none,every", "none,,x"):
        with pytest.raises(ValidationError, match=r"^kv-canary: --modes takes .*Fix: e\.g\. --modes"):
            demo.parse_list(bad, MODES, "--modes", "partial,all")
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    args = p.parse_args([])
    assert demo.parse_list(args.modes, MODES, "--modes", "") == list(MODES)   # the default: every mode
    assert demo.parse_list(args.classes, CLASSES, "--classes", "") == list(CLASSES)


def test_not_covered_note_names_only_what_is_not_covered():
    def result(modes):
        cells = {f"K3/{m}": dict(covered=True, note="") for m in modes}
        cells.update({f"K12/{m}": dict(covered=coverage("K12", m)[0], note=coverage("K12", m)[1]) for m in modes})
        return dict(modes=modes, classes=["K3", "K12"], cells=cells, partial_note="PARTIAL note")
    assert not_covered_lines(result(["all"])) == []
    assert not_covered_lines(result(["partial"])) == ["PARTIAL note."]
    (line,) = not_covered_lines(result(["none", "all"]))
    assert line.startswith("not covered in none: K12 (identity-only mode hashes no KV bytes")
    assert "K3" not in line


@pytest.mark.gpu
def test_reduced_campaign_and_clean_run_on_the_gpu():
    res = campaign.run_campaign(CLASSES, MODES, injections=2, seed=2024, backend="gpu")
    assert passed(res), format_table(res)
    assert all(c["detected"] >= 1 for c in res["cells"].values() if c["covered"]), format_table(res)
    clean = clean_run(10**6, hash_mode="all", backend="gpu", seed=3)
    assert clean["verified_slots"] >= 10**6 and clean["false_positives"] == 0, clean["first_false_positives"]


def test_heat_map_has_axis_titles_a_colour_bar_and_a_legend(tmp_path):
    pytest.importorskip("matplotlib")
    from kvcanary.sim.output import heatmap, heatmap_figure
    res = campaign.run_campaign(["K3", "K12"], ["none", "all"], injections=1, seed=4)
    fig = heatmap_figure(res)
    ax, bar = fig.axes                                   # the matrix and its colour bar
    assert ax.get_xlabel().startswith("hash mode") and ax.get_ylabel().startswith("fault class")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["none", "all"]
    assert "detection rate" in bar.get_ylabel() and bar.get_ylim() == (0.0, 1.0)
    (legend,) = fig.legends
    assert "not covered" in legend.get_texts()[0].get_text()
    assert "not covered" in [t.get_text() for t in ax.texts]   # K12 in none
    assert heatmap(res, str(tmp_path / "c.png")) == str(tmp_path / "c.png") and (tmp_path / "c.png").stat().st_size


def test_an_engine_error_before_the_fault_landed_fails_the_campaign():
    # On the GPU backend the K5 reload once raised a ValidationTypeError in 4 of 9 injections;
    # they counted as "not exercised" and the campaign still passed.
    res = campaign.run_campaign(["K3"], ["none"], injections=1, seed=4)
    assert passed(res) and "ERROR:" not in format_table(res)
    broken = dict(res, runs=res["runs"] + [dict(res["runs"][0], outcome="not_exercised", injected_step=None,
                                                error="ValidationTypeError: kv-canary: slots: ...")])
    assert not passed(broken)
    assert "ERROR: K3/none seed" in format_table(broken) and "failed before its fault landed" in format_table(broken)
    late = dict(res, runs=res["runs"] + [dict(res["runs"][0], error="IndexError: after the fault")])
    assert passed(late)  # a corrupted engine tripping over itself after its fault is not the harness's fault


def test_a_campaign_run_in_parts_merges_into_the_one_shot_campaign(tmp_path):
    from kvcanary.sim import merge
    whole = campaign.run_campaign(["K3", "K9", "K12"], MODES, injections=1, seed=5)
    a = campaign.run_campaign(["K12"], MODES, injections=1, seed=5)
    b = campaign.run_campaign(["K3", "K9"], MODES, injections=1, seed=5)
    clean = [clean_run(2000, hash_mode="all", seed=s) for s in (1, 2)]
    paths = []
    for name, part, c in (("a", a, [clean[0]]), ("b", b, [clean[1]])):
        paths.append(write_json(part, c, str(tmp_path / name / "campaign.json")))
    assert merge.main([*paths, "--out", str(tmp_path / "m")]) == 0
    got = json.loads((tmp_path / "m" / "campaign.json").read_text())
    assert got["classes"] == ["K3", "K9", "K12"]                  # CLASSES order, whichever part held them
    assert got["cells"] == json.loads(json.dumps(whole["cells"]))  # rebuilt from the records: the same cells
    (fp,) = got["clean_runs"]
    assert fp["verified_slots"] == clean[0]["verified_slots"] + clean[1]["verified_slots"] and fp["runs"] == 2
    summary = json.loads((tmp_path / "m" / "campaign-summary.json").read_text())
    assert "runs" not in summary and summary["kept_runs"] == [] and summary["cells"] == got["cells"]
    assert "result: every exercised injection" in (tmp_path / "m" / "campaign.txt").read_text()
    # a committed summary of part a (no per-injection records) merges like part a itself
    again, _ = merge.merge([merge.summary(a, [clean[0]]), b])
    assert again["cells"] == whole["cells"]
    with pytest.raises(ValidationError, match="cell K3/none is in parts 0 and 1"):
        merge.merge([b, b])
    with pytest.raises(ValidationError, match="must share seed"):
        merge.merge([a, {**b, "seed": 6}])
    (tmp_path / "other.json").write_text('{"cells": {}}')
    assert merge.main([paths[0], str(tmp_path / "other.json"), "--out", str(tmp_path / "x")]) == 2
