"""perf/report.py on a hand-made benchmark JSON (CPU): the table, and the --before column."""

from __future__ import annotations

import json

from . import report


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
