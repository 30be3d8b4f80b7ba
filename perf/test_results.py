"""perf/results.py on hand-made benchmark JSON (CPU): the table, the --before column and the
median comparison, where its output goes, and that only an H200 run replaces the committed results."""

from __future__ import annotations

import json

import pytest

from . import results as report


def bench(rows: list[dict], when: str, commit: str) -> dict:
    return {"datetime": when, "commit_info": {"id": commit}, "machine_info": {},
            "benchmarks": [{"name": "b", "extra_info": {"rows": rows}}]}


def row(name, measured, bound, ok=None, target=None):
    return dict(name=name, measured=measured, unit="s", bound=bound, bound_name="probe",
                ratio=measured / bound, target=target, ok=ok)


def test_before_column_pairs_rows_by_name(tmp_path):
    new = bench([row("verify", 20e-6, 10e-6, False, "<= 1.5x"), row("write", 3e-3, 2.5e-3)], "t1", "aaaa")
    old = bench([row("verify", 27.6e-6, 10e-6, False, "<= 1.5x")], "t0", "bbbbbbbbbbbbbbbb")
    (tmp_path / "new.json").write_text(json.dumps(new))
    (tmp_path / "old.json").write_text(json.dumps(old))
    out = tmp_path / "R.md"
    assert report.main([str(tmp_path / "new.json"), "--out", str(out), "--plots", str(tmp_path / "p"),
                        "--before", str(tmp_path / "old.json")]) == 0
    text = out.read_text()
    assert '"before": the same row in old.json (t0, commit bbbbbbbbbbbb).' in text
    assert "| verify | 20 µs | 10 µs (probe) | 2x | <= 1.5x | **FAIL** | 27.6 µs (2.76x) |" in text
    assert "| write | 3 ms | 2.5 ms (probe) | 1.2x | - |  | - |" in text
    assert "- targets: 0 of 1 met" in text


def test_without_before_the_table_has_six_columns(tmp_path):
    (tmp_path / "new.json").write_text(json.dumps(bench([row("verify", 20e-6, 10e-6)], "t1", "a")))
    out = tmp_path / "R.md"
    report.main([str(tmp_path / "new.json"), "--out", str(out), "--plots", str(tmp_path / "p")])
    assert "| benchmark | measured | bound | ratio | target | result |\n" in out.read_text()


def run_json(tmp_path, name: str, benchmarks: list[dict], gpu: str | None, harness: int = 2) -> str:
    data = {"datetime": name, "commit_info": {"id": "c" * 40},
            "machine_info": {"kvcanary_perf": {"harness": harness, "gpu": gpu, "no_gpu_reason": None if gpu else "no driver"}},
            "benchmarks": benchmarks}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return str(path)


def timed(fullname: str, median: float, rows: list[dict]) -> dict:
    return {"name": fullname.split("::")[-1], "fullname": fullname, "stats": {"median": median},
            "extra_info": {"rows": rows}}


@pytest.fixture
def committed(tmp_path, monkeypatch):
    """report.py's committed paths and default output, moved into tmp_path (the real ones stay)."""
    paths = {"out": tmp_path / "c" / "RESULTS.md", "plots": tmp_path / "c" / "plots",
             "json": tmp_path / "c" / "results-h200.json"}
    paths["out"].parent.mkdir()
    for p in (paths["out"], paths["json"]):
        p.write_text("committed\n")
    monkeypatch.setattr(report, "COMMITTED", paths)
    monkeypatch.setattr(report, "OUT", tmp_path / "default-out")
    return paths


def test_a_run_goes_to_the_default_output_not_the_committed_results(tmp_path, committed):
    run = run_json(tmp_path, "cpu", [timed("t::a", 1.0, [row("a", 1.0, 2.0)])], gpu=None)
    assert report.main([run]) == 0
    assert (tmp_path / "default-out" / "RESULTS.md").read_text().startswith("# kvcanary benchmark results")
    assert "- GPU: none (no driver)" in (tmp_path / "default-out" / "RESULTS.md").read_text()
    assert committed["out"].read_text() == committed["json"].read_text() == "committed\n"


@pytest.mark.parametrize("flag", ["--out", "--plots"])
def test_writing_over_the_committed_results_needs_the_flag(tmp_path, committed, flag):
    run = run_json(tmp_path, "gpu", [timed("t::a", 1.0, [row("a", 1.0, 2.0)])], gpu="NVIDIA H200")
    with pytest.raises(SystemExit, match="--update-committed"):
        report.main([run, flag, str(committed["out" if flag == "--out" else "plots"])])
    assert committed["out"].read_text() == "committed\n"


@pytest.mark.parametrize("gpu", [None, "NVIDIA A100-SXM4-80GB"])
def test_update_committed_refuses_a_run_without_an_h200(tmp_path, committed, gpu):
    run = run_json(tmp_path, "run", [timed("t::a", 1.0, [row("a", 1.0, 2.0)])], gpu=gpu)
    with pytest.raises(SystemExit, match="needs a run on an H200"):
        report.main([run, "--update-committed"])
    assert committed["out"].read_text() == committed["json"].read_text() == "committed\n"


def test_update_committed_takes_an_h200_run(tmp_path, committed):
    run = run_json(tmp_path, "h200", [timed("t::a", 1.0, [row("verify", 20e-6, 10e-6)])], gpu="NVIDIA H200")
    assert report.main([run, "--update-committed"]) == 0
    assert "| verify | 20 µs | 10 µs (probe) | 2x |" in committed["out"].read_text()
    assert json.loads(committed["json"].read_text())["datetime"] == "h200"


def test_before_lists_the_benchmarks_whose_median_grew_past_the_threshold(tmp_path, capsys):
    old = run_json(tmp_path, "old", [timed("t::slow", 10e-6, []), timed("t::same", 10e-6, []),
                                     timed("t::fast", 10e-6, []), timed("t::gone", 1e-6, [])], gpu="NVIDIA H200")
    new = run_json(tmp_path, "new", [timed("t::slow", 11.5e-6, [row("verify", 11.5e-6, 1e-6)]),
                                     timed("t::same", 10.9e-6, [row("write", 10.9e-6, 1e-6)]),
                                     timed("t::fast", 5e-6, [row("step", 5e-6, 1e-6)]),
                                     timed("t::new", 1.0, [row("other", 1.0, 1.0)])], gpu="NVIDIA H200")
    out = tmp_path / "R.md"
    assert report.main([new, "--before", old, "--out", str(out), "--plots", str(tmp_path / "p")]) == 0
    text = out.read_text()
    assert "1 of the 3 benchmarks in both runs regressed." in text
    assert "- regressed +15.0%: t::slow (median 10 µs -> 11.5 µs; rows: verify)" in text
    assert "t::same" not in text.split("(median)")[1] and "t::fast" not in text.split("(median)")[1]
    assert "report: regressed +15.0%: t::slow" in capsys.readouterr().out
    report.main([new, "--before", old, "--out", str(out), "--plots", str(tmp_path / "p"), "--regression", "5"])
    assert "t::same" in out.read_text().split("(median)")[1]


def test_before_from_a_harness_1_run_compares_rows_but_not_medians(tmp_path):
    old = run_json(tmp_path, "old", [timed("t::a", 3.0, [row("verify", 27.6e-6, 10e-6)])], gpu=None, harness=1)
    new = run_json(tmp_path, "new", [timed("t::a", 20e-6, [row("verify", 20e-6, 10e-6)])], gpu="NVIDIA H200")
    out = tmp_path / "R.md"
    report.main([new, "--before", old, "--out", str(out), "--plots", str(tmp_path / "p")])
    text = out.read_text()
    assert "| verify | 20 µs | 10 µs (probe) | 2x | - |  | 27.6 µs (2.76x) |" in text
    assert "No median comparison: the earlier run's pytest-benchmark stats are not per operation (harness 1)." in text


@pytest.mark.parametrize("gpu,harness,ok", [("NVIDIA H200", 2, True), (None, 2, False), ("NVIDIA H200", 1, False)])
def test_check_baseline(tmp_path, gpu, harness, ok):
    path = run_json(tmp_path, "b", [timed("t::a", 1.0, [])], gpu=gpu, harness=harness)
    assert report.main(["--check-baseline", path]) == (0 if ok else 1)


def test_the_committed_baseline_is_never_a_cpu_run():
    """perf/results-h200.json, if it says which GPU took it, says an H200."""
    data = json.loads(report.COMMITTED["json"].read_text())
    run = report.run_info(data)
    assert (run["gpu"] is None and run["harness"] == 1) or "H200" in (run["gpu"] or ""), run


def test_a_slowdown_that_its_same_run_bound_shares_is_the_hosts_not_a_regression(tmp_path, capsys):
    """Lent machines differ: a host row 20 % slower whose launch floor (measured in the same run) is
    20 % slower too is listed apart; one whose floor stayed is a regression, with both changes."""
    old = run_json(tmp_path, "old", [timed("t::host", 30e-6, [row("host path", 30e-6, 20e-6)]),
                                     timed("t::code", 30e-6, [row("step", 30e-6, 20e-6)])], gpu="NVIDIA H200")
    new = run_json(tmp_path, "new", [timed("t::host", 36e-6, [row("host path", 36e-6, 24e-6)]),
                                     timed("t::code", 36e-6, [row("step", 36e-6, 20.4e-6)])], gpu="NVIDIA H200")
    out = tmp_path / "R.md"
    assert report.main([new, "--before", old, "--out", str(out), "--plots", str(tmp_path / "p")]) == 0
    text = out.read_text().split("(median)")[1]
    assert "1 of the 2 benchmarks in both runs regressed." in text
    assert ("- regressed +20.0%: t::code (median 30 µs -> 36 µs, +17.6% against its same-run bound; rows: step)"
            in text)
    assert "1 more were slower, but by at most 10% against their bound measured in the same run" in text
    assert "- slower +20.0%: t::host (median 30 µs -> 36 µs, its same-run bound +20.0%; rows: host path)" in text
    printed = capsys.readouterr().out
    assert "report: regressed +20.0%: t::code" in printed and "t::host" not in printed
    gate = [new, "--before", old, "--out", str(out), "--plots", str(tmp_path / "p"), "--fail-on-regression"]
    assert report.main(gate) == 1, "the gate of .ci/gpu perf: a regression against its same-run bound fails"
    host_only = run_json(tmp_path, "host", [timed("t::host", 36e-6, [row("host path", 36e-6, 24e-6)]),
                                            timed("t::code", 30e-6, [row("step", 30e-6, 20e-6)])], gpu="NVIDIA H200")
    assert report.main([host_only, *gate[1:]]) == 0, "a slower host whose same-run floor is as slow passes the gate"
