"""Turn a ``pytest perf/ --benchmark-json=FILE`` result into a results table and PNG plots.

    python perf/results.py RUN.json [--out FILE.md] [--plots DIR] [--before OLD.json] [--regression PCT]
    python perf/results.py RUN.json --update-committed    # an H200 run becomes the committed results
    python perf/results.py --check-baseline OLD.json      # exit 0: usable by --benchmark-compare

The table has one line per row the benchmarks reported (``extra_info["rows"]``): benchmark,
measured, bound (and what it is), ratio, target, pass/fail. With matplotlib installed it also
writes ``throughput.png`` (entries/s vs entries per launch, one line per series) and
``ratio.png`` (each row's ratio to its bound, log scale); without it the plots are skipped.
By default both go to perf/out/ (git-ignored). The committed perf/RESULTS.md, perf/plots/ and
perf/results-h200.json are written only with ``--update-committed``, and only from a run whose
GPU was an H200 (perf/conftest.py records the GPU in the JSON's machine_info): a run on a
machine without a GPU never replaces them.

``--before OLD.json`` adds each row's measurement in that run, and, when both runs measured one
operation per benchmark (harness 2: pytest-benchmark's stats are the operation's time), lists
the benchmarks whose median grew by more than ``--regression`` percent (default 10), with their
rows: the same test pytest-benchmark's ``--benchmark-compare-fail=median:10%`` makes, less the
benchmarks whose same-run bounds grew as much (another lent machine: listed apart).
Standalone: imports neither kvcanary nor the suite.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = 2  # 1: one pedantic round per benchmark timed the whole measurement; 2: the operation
OUT = HERE / "out"
COMMITTED = {"out": HERE / "RESULTS.md", "plots": HERE / "plots", "json": HERE / "results-h200.json"}
COMMITTED_GPU = "H200"


def fmt(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        for scale, suffix in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if abs(value) >= scale or suffix == "µs":
                return f"{value / scale:.3g} {suffix}"
    if unit == "B/s":
        return f"{value / 1e9:.4g} GB/s"
    if unit == "entries/s":
        return f"{value / 1e6:.4g} M entries/s"
    return f"{value:.4g} {unit}"


def load_rows(data: dict) -> list[dict]:
    """Every reported row, in benchmark order; benchmarks without rows get one from their stats."""
    rows = []
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info") or {}
        if info.get("rows"):
            rows += info["rows"]
        else:
            median = (bench.get("stats") or {}).get("median")
            rows.append(dict(name=bench.get("fullname", bench.get("name")), measured=median,
                             unit="s", bound=None, bound_name="", ratio=None, target=None, ok=None))
    return rows


MODEL_STEP = "model decode step (1.1B Llama-shaped, graph), "
README_SHAPES = (("bs1x4096", "1 × 4096"), ("bs8x4096", "8 × 4096"), ("bs64x2048", "64 × 2048"),
                 ("bs256x2048", "256 × 2048"))


def readme_cost_table(rows: list[dict]) -> list[str]:
    """The README's "What it costs" table (perf/doc_figures.py writes it), from the model-step rows of a run (the committed one):
    the step without the canary, and what each canary configuration adds (``layers="first"`` as
    its overhead row, the others as added time and its share of the step)."""
    by = {r["name"]: r["measured"] for r in rows}
    out = ['| batch × cached tokens | step without canary | `layers="first"` | `layers="all"` | '
           '`layers="all"`, `fingerprint_every=8` |', "|---|---:|---:|---:|---:|"]
    for shape, label in README_SHAPES:
        step = by[f"{MODEL_STEP}{shape}, no canary"]
        first = by[f"{MODEL_STEP}{shape}: canary layers=first PARTIAL, overhead"]
        cells = []
        for what in ("layers=all PARTIAL", "layers=all PARTIAL fingerprint_every=8"):
            t = by[f"{MODEL_STEP}{shape}: canary {what}, added time"]
            cells.append(f"+{fmt(t, 's')} ({100 * t / step:.1f} %)")
        out.append(f"| {label} | {fmt(step, 's')} | +{100 * first:.1f} % | {cells[0]} | {cells[1]} |")
    return out


def readme_prefill_sentence(rows: list[dict]) -> str:
    """The README's sentence on the eager prefill chunk, from the same run."""
    by = {r["name"]: r["measured"] for r in rows}
    chunk = "model prefill chunk (1.1B Llama-shaped, eager), 1x8192 new tokens, canary "
    return (f"An eager 8192-token prefill chunk took {fmt(by[chunk + 'off'], 's')} without the canary and "
            f"{fmt(by[chunk + 'layers=first PARTIAL'], 's')} with `layers=\"first\"`.")


def ratio_text(r: dict | None) -> str:
    return "-" if r is None or r.get("ratio") is None else f"{r['ratio']:.3g}x"


def table(rows: list[dict], before: dict[str, dict] | None = None) -> list[str]:
    """The results table; with ``before`` (rows of an earlier run by name) a column with the
    earlier run's measurement and ratio of the same row."""
    extra = before is not None
    lines = ["| benchmark | measured | bound | ratio | target | result |" + (" before |" if extra else ""),
             "|---|---:|---|---:|---|---|" + ("---:|" if extra else "")]
    for r in rows:
        bound = fmt(r.get("bound"), r.get("unit", "s"))
        if r.get("bound_name"):
            bound = f"{bound} ({r['bound_name']})" if r.get("bound") is not None else r["bound_name"]
        verdict = {True: "pass", False: "**FAIL**", None: ""}[r.get("ok")]
        line = (f"| {r['name']} | {fmt(r.get('measured'), r.get('unit', 's'))} | {bound} | "
                f"{ratio_text(r)} | {r.get('target') or '-'} | {verdict} |")
        if extra:
            old = before.get(r["name"])
            line += " - |" if old is None else f" {fmt(old.get('measured'), old.get('unit', 's'))} ({ratio_text(old)}) |"
        lines.append(line)
    return lines


def header(data: dict, rows: list[dict]) -> list[str]:
    machine = data.get("machine_info") or {}
    commit = data.get("commit_info") or {}
    checked = [r for r in rows if r.get("ok") is not None]
    passed = sum(1 for r in checked if r["ok"])
    run = run_info(data)
    return ["# kvcanary benchmark results", "",
            "Generated by `perf/results.py` from a `pytest perf/ --benchmark-json` run. Each benchmark",
            "times one operation and its pytest-benchmark median is the row's measurement (or the",
            "rate or bandwidth derived from it): GPU rows from CUDA events (L2 flushed, host launch",
            "gaps hidden behind a spin gate), host rows from perf_counter. Every bound was measured",
            "in the same run. Ratio = measured / bound unless the row says otherwise (speedup and",
            "bandwidth rows: higher is better).", "",
            f"- when: {data.get('datetime', '?')}",
            f"- commit: {commit.get('id', '?')[:12]}{' (dirty)' if commit.get('dirty') else ''}",
            f"- host: {machine.get('node', '?')}, {machine.get('cpu', {}).get('brand_raw', '?')}, "
            f"Python {machine.get('python_version', '?')}",
            f"- GPU: {run['gpu'] or 'none (' + str(run['no_gpu_reason'] or 'not recorded').split(' (')[0] + ')'}",
            f"- targets: {passed} of {len(checked)} met", ""]


def run_info(data: dict) -> dict:
    """Harness version and GPU of a run (runs before harness 2 recorded neither)."""
    info = (data.get("machine_info") or {}).get("kvcanary_perf") or {}
    return {"harness": info.get("harness", 1), "gpu": info.get("gpu"), "no_gpu_reason": info.get("no_gpu_reason")}


def medians(data: dict) -> dict[str, tuple[float, list[dict]]]:
    """fullname -> (median seconds, its rows) of the benchmarks that ran."""
    out = {}
    for bench in data.get("benchmarks", []):
        median = (bench.get("stats") or {}).get("median")
        if median is not None:
            out[bench.get("fullname", bench.get("name"))] = (median, (bench.get("extra_info") or {}).get("rows", []))
    return out


def bound_change(new_rows: list[dict], old_rows: list[dict]) -> float | None:
    """How many times slower a benchmark's same-run bounds were than in the earlier run: the median
    of new / old bound over its rows of both runs timed in seconds against a bound of the same
    name (the launch floor of a host row, a probe of a kernel row), or None without such a row.
    Lent machines differ: a median that grew with its bound measured the host, not the code."""
    old = {r["name"]: r for r in old_rows}
    changes = sorted(r["bound"] / o["bound"] for r in new_rows if (o := old.get(r["name"])) is not None
                     and r.get("unit") == o.get("unit") == "s" and r.get("bound_name") == o.get("bound_name")
                     and (r.get("bound") or 0) > 0 and (o.get("bound") or 0) > 0)
    return changes[len(changes) // 2] if changes else None


def regressions(data: dict, old: dict, threshold_pct: float) -> tuple[list[str], list[str]]:
    """(lines for RESULTS.md, one line per regressed benchmark): benchmarks of both runs whose
    median grew by more than ``threshold_pct`` percent, also relative to their same-run bounds
    (:func:`bound_change`); those whose bounds grew with them are listed apart, as the host's.
    Empty, with a note, unless both runs are harness 2 (before it, a benchmark's stats timed the
    whole measurement)."""
    if run_info(data)["harness"] < 2 or run_info(old)["harness"] < 2:
        return ["", f"No median comparison: the earlier run's pytest-benchmark stats are not per operation "
                    f"(harness {run_info(old)['harness']})."], []
    new_m, old_m = medians(data), medians(old)
    common = [name for name in new_m if name in old_m and old_m[name][0] > 0]
    bad, host = [], []
    for name in common:
        grew = new_m[name][0] / old_m[name][0]
        if (grew - 1) * 100 <= threshold_pct:
            continue
        rows = "; ".join(r["name"] for r in new_m[name][1]) or "-"
        line = f"{(grew - 1) * 100:+.1f}%: {name} (median {fmt(old_m[name][0], 's')} -> {fmt(new_m[name][0], 's')}"
        bounds = bound_change(new_m[name][1], old_m[name][1])
        if bounds is None:
            bad.append(f"regressed {line}; rows: {rows})")
        elif (grew / bounds - 1) * 100 > threshold_pct:
            bad.append(f"regressed {line}, {(grew / bounds - 1) * 100:+.1f}% against its same-run bound; rows: {rows})")
        else:
            host.append(f"slower {line}, its same-run bound {(bounds - 1) * 100:+.1f}%; rows: {rows})")
    lines = ["", f"## Benchmarks slower than the earlier run by more than {threshold_pct:g}% (median)", "",
             f"{len(bad)} of the {len(common)} benchmarks in both runs regressed."]
    lines += ([""] + [f"- {b}" for b in bad]) if bad else []
    if host:
        lines += ["", f"{len(host)} more were slower, but by at most {threshold_pct:g}% against their bound measured "
                      f"in the same run (the machine, not the code):", ""] + [f"- {h}" for h in host]
    return lines, bad


def plots(rows: list[dict], out_dir: Path) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib is not installed; skipping plots", file=sys.stderr)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    series = defaultdict(list)
    for r in rows:
        if r.get("series") and r.get("size") and r.get("entries/s"):
            series[r["series"]].append((r["size"], r["entries/s"]))
    if series:
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, points in sorted(series.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="entries per launch (verified + written)",
               ylabel="entries / s", title="kvcanary throughput vs size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        written.append(out_dir / "throughput.png")
        fig.tight_layout()
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    ratios = [r for r in rows if r.get("ratio") and r["ratio"] > 0]
    if ratios:
        fig, ax = plt.subplots(figsize=(9, max(3, 0.25 * len(ratios))))
        colors = {True: "tab:green", False: "tab:red", None: "tab:gray"}
        ax.barh(range(len(ratios)), [r["ratio"] for r in ratios], color=[colors[r.get("ok")] for r in ratios])
        ax.set_yticks(range(len(ratios)), [r["name"] for r in ratios], fontsize=6)
        ax.invert_yaxis()
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set(xscale="log", xlabel="ratio to bound (green: target met, red: missed, gray: no target)",
               title="kvcanary: ratio to the bound measured in the same run")
        written.append(out_dir / "ratio.png")
        fig.tight_layout()
        fig.savefig(written[-1], dpi=80)  # one bar per row: ~290 rows stay under 1 MB
        plt.close(fig)
    return written


def check_baseline(path: Path) -> tuple[bool, str]:
    """Whether ``path`` can be the --benchmark-compare baseline: harness 2, from a GPU run."""
    if not path.is_file():
        return False, f"{path} does not exist"
    run = run_info(json.loads(path.read_text()))
    if run["harness"] < 2:
        return False, f"{path} is a harness-{run['harness']} run (its stats time whole measurements, not operations)"
    if not run["gpu"]:
        return False, f"{path} was taken without a GPU"
    return True, f"{path}: harness {run['harness']}, {run['gpu']}"


def targets(args, data: dict) -> tuple[Path, Path]:
    """Where the table and plots go; refuses the committed paths without --update-committed, and
    --update-committed without an H200 run."""
    committed = {COMMITTED["out"].resolve(), COMMITTED["plots"].resolve()}
    if not args.update_committed:
        out, plots = args.out or OUT / "RESULTS.md", args.plots or OUT / "plots"
        if {out.resolve(), plots.resolve()} & committed:
            raise SystemExit("report: perf/RESULTS.md and perf/plots/ hold the committed H200 results; "
                             "write elsewhere (the default is perf/out/) or pass --update-committed")
        return out, plots
    if args.out or args.plots:
        raise SystemExit("report: --update-committed writes perf/RESULTS.md and perf/plots/; drop --out/--plots")
    gpu = run_info(data)["gpu"]
    if not gpu or COMMITTED_GPU not in gpu:
        raise SystemExit(f"report: --update-committed needs a run on an {COMMITTED_GPU} (perf/conftest.py "
                         f"records the GPU), this run's GPU: {gpu or 'none'}; the committed results stay")
    return COMMITTED["out"], COMMITTED["plots"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, nargs="?", help="pytest-benchmark JSON (--benchmark-json)")
    ap.add_argument("--out", type=Path, help="the table (default perf/out/RESULTS.md)")
    ap.add_argument("--plots", type=Path, help="the plots' directory (default perf/out/plots)")
    ap.add_argument("--before", type=Path, help="an earlier run's JSON: adds its measurement of each row")
    ap.add_argument("--regression", type=float, default=10.0, metavar="PCT",
                    help="with --before: list benchmarks whose median grew by more than PCT percent")
    ap.add_argument("--fail-on-regression", action="store_true",
                    help="with --before: exit 1 when a benchmark regressed against its same-run bound (the "
                         "gate of .ci/gpu perf, which lets pytest run to its summary)")
    ap.add_argument("--update-committed", action="store_true",
                    help="write perf/RESULTS.md, perf/plots/ and perf/results-h200.json (an H200 run only)")
    ap.add_argument("--check-baseline", type=Path, metavar="JSON",
                    help="only say whether JSON can be the --benchmark-compare baseline (exit 0) or not (1)")
    args = ap.parse_args(argv)
    if args.check_baseline is not None:
        ok, why = check_baseline(args.check_baseline)
        print(f"report: {why}")
        return 0 if ok else 1
    if args.json is None:
        ap.error("the run's JSON is required")
    data = json.loads(args.json.read_text())
    out, plot_dir = targets(args, data)
    rows = load_rows(data)
    before, regressed = None, []
    if args.before is not None:
        old = json.loads(args.before.read_text())
        before = {r["name"]: r for r in load_rows(old)}
    lines = header(data, rows) + table(rows, before)
    if before is not None:
        lines[lines.index("| benchmark | measured | bound | ratio | target | result | before |"):0] = [
            f"\"before\": the same row in {args.before.name} ({old.get('datetime', '?')}, commit "
            f"{(old.get('commit_info') or {}).get('id', '?')[:12]}).", ""]
        section, regressed = regressions(data, old, args.regression)
        lines += section
    images = plots(rows, plot_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    if images:
        lines += ["", *(f"![{p.stem}]({p.relative_to(out.parent) if p.is_relative_to(out.parent) else p})"
                        for p in images)]
    out.write_text("\n".join(lines) + "\n")
    if args.update_committed and args.json.resolve() != COMMITTED["json"].resolve():
        COMMITTED["json"].write_text(json.dumps(data, separators=(",", ":")) + "\n")  # compact: ~half the bytes
    if args.update_committed:  # the README's and the guides' figures follow the new committed run
        from doc_figures import rewrite
        print(f"report: {rewrite()}")
    print(f"report: {len(rows)} rows -> {out}" + (f", plots: {', '.join(map(str, images))}" if images else "")
          + (f", {args.json} -> {COMMITTED['json']}" if args.update_committed else ""))
    for line in regressed:
        print(f"report: {line}")
    return 1 if args.fail_on_regression and regressed else 0


if __name__ == "__main__":
    sys.exit(main())
