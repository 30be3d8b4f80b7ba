"""The measured figures of the README and the guides, generated from the committed results, so the
text cannot drift from them.

    python perf/doc_figures.py            # rewrite every figures region from the committed results
    python perf/doc_figures.py --check    # exit 1 (naming the regions) when a region differs

A region is the lines between ``<!-- figures: NAME -->`` and ``<!-- /figures -->`` in README.md or a
markdown file under docs/; :data:`FIGURES` names what writes each. The sources are the committed
H200 benchmark run (``perf/results-h200.json``, the rows ``perf/results.py`` reads) and the committed
fault campaign (``results/campaign-gpu-h200-300.json``). ``tests/test_doc_figures.py`` fails when a
region differs from what this writes, and when README.md or a guide has a measured figure (µs, ms,
%, a ratio) outside a region. Standalone: imports neither kvcanary nor the suite.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from results import COMMITTED, fmt, load_rows, readme_cost_table, readme_prefill_sentence  # noqa: E402

CAMPAIGN = ROOT / "results" / "campaign-gpu-h200-300.json"
REGION = re.compile(r"(<!-- figures: ([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)


def documents() -> list[Path]:
    """The files that may hold regions: README.md and every markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in rows}


def model_step(rows: list[dict], campaign: dict) -> list[str]:
    """The graph-captured model step without the canary and what each configuration adds."""
    return readme_cost_table(rows) + ["", readme_prefill_sentence(rows)]


def _times(value: float) -> str:
    return f"{value:.2f}×"


def transformers(rows: list[dict], campaign: dict) -> list[str]:
    """transformers' continuous batching: the generation loop and the whole ``generate_batch`` (what a
    user waits for: manager, cache, warm-up and captures included), with and without the canary."""
    by = by_name(rows)
    out = ["| model (bf16 Llama) | canary | generation loop | vs without | added a step | whole `generate_batch` | vs without |",
           "|---|---|---:|---:|---:|---:|---:|"]
    fast = "CUDA graphs + async batching"
    for model in ("8x1024", "4x256"):
        label = model.replace("x", " layers × ")
        for what, tag in (('`layers="first"`', "layers=first"), ('`layers="all"`', "layers=all"),
                          ('`layers="first"`, `mode="fail_request"`', "layers=first, mode=fail_request")):
            loop = by[f"transformers {model}: generation loop, {fast}, canary {tag}"]
            step = by.get(f"transformers {model}: added time per step, {fast}, {tag}")
            whole = by.get(f"transformers {model}: whole generate_batch, {fast}, {tag}")
            cells = [fmt(loop["measured"], "s"), _times(loop["ratio"]),
                     "-" if step is None else fmt(step["measured"], "s"),
                     "-" if whole is None else fmt(whole["measured"], "s"),
                     "-" if whole is None else _times(whole["ratio"])]
            out.append(f"| {label} | {what} | " + " | ".join(cells) + " |")
    plain = by["transformers 8x1024: plain engine's loop without the canary (what turning the fast settings off would cost)"]
    out += ["", f"Without CUDA graphs and async batching the 8-layer model's loop takes {fmt(plain['measured'], 's')} "
                f"without the canary, {_times(plain['ratio'])} the fast configuration's."]
    return out


def verdicts(rows: list[dict], campaign: dict) -> list[str]:
    """The request verdicts' cost: the fused verify with them on, over off."""
    by = by_name(rows)
    ratios = [by[f"verify fused {h}, decode bs256x4096: request verdicts on / off"]["ratio"]
              for h in ("identity", "partial", "all")]
    return [f"On the H200 the fused verify at decode bs 256 × 4096 runs at {min(ratios):.2f}-{max(ratios):.2f}× "
            "with the verdicts on as off (identity, partial, all)."]


def sglang_stager(rows: list[dict], campaign: dict) -> list[str]:
    """The manager's host time per step with SglangBatchStager against sglang_batch."""
    by = by_name(rows)
    shapes = ("decode bs1x1024", "decode bs64x1024", "decode bs256x1024", "prefill 4x512")
    staged = [by[f"host path: manager, SglangBatchStager, {s}"]["measured"] for s in shapes]
    plain = [by[f"host path: manager, sglang_batch, {s}"]["measured"] for s in shapes]
    return [f"On the H200 a step's host time with the stager is {fmt(min(staged), 's')}-{fmt(max(staged), 's')} "
            f"against {fmt(min(plain), 's')}-{fmt(max(plain), 's')} with `sglang_batch`."]


def campaign_line(rows: list[dict], campaign: dict) -> list[str]:
    """The committed H200 fault campaign in one sentence."""
    cells = campaign["cells"].values()
    covered = [c for c in cells if c["covered"]]
    caught = sum(c["detected"] for c in covered)
    late = sum(c["detected"] for c in covered if c["read_latency_max"] > 0)
    missed = sum(c["missed"] for c in covered)
    clean = sum(r["verified_slots"] for r in campaign["clean_runs"])
    false = sum(r["false_positives"] for r in campaign["clean_runs"])
    return [f"On the H200, {campaign['injections']} injections per class and hash mode "
            f"({len(campaign['classes'])} classes, {campaign['classes'][0]}–{campaign['classes'][-1]}; {len(campaign['modes'])} "
            f"modes): {caught} caught, "
            f"{caught - late} of them in the step that first read the corrupted data, {missed} missed; "
            f"{clean / 1e6:.1f} M clean verified slots gave {false} false positives."]


def import_time(rows: list[dict], campaign: dict) -> list[str]:
    """``import kvcanary`` with a warm cache and an empty one."""
    by = by_name(rows)
    warm = by["import kvcanary, warm cache"]["measured"]
    cold = next(r for n, r in by.items() if n.startswith("import kvcanary, empty cache"))
    cpus = re.search(r"(\d+) CPUs", cold["name"])
    return [f"On the H200 machine `import kvcanary` took {fmt(warm, 's')} with a warm cache and "
            f"{fmt(cold['measured'], 's')} with an empty one ({cpus.group(1) if cpus else '?'} CPUs compiling)."]


FIGURES = {"model-step": model_step, "transformers": transformers, "verdicts": verdicts,
           "sglang-stager": sglang_stager, "campaign": campaign_line, "import": import_time}


def sources() -> tuple[list[dict], dict]:
    return load_rows(json.loads(COMMITTED["json"].read_text())), json.loads(CAMPAIGN.read_text())


def render(text: str, rows: list[dict], campaign: dict) -> str:
    """``text`` with every region's lines written anew; an unknown region name is an error."""
    def region(m: re.Match) -> str:
        name = m.group(2)
        if name not in FIGURES:
            raise SystemExit(f"doc_figures: unknown region {name!r}; known: {', '.join(FIGURES)}")
        return m.group(1) + "\n".join(FIGURES[name](rows, campaign)) + "\n" + m.group(4)
    return REGION.sub(region, text)


def stale() -> list[str]:
    """The documents whose regions differ from the committed results."""
    rows, campaign = sources()
    return [str(p.relative_to(ROOT)) for p in documents() if render(p.read_text(), rows, campaign) != p.read_text()]


def rewrite() -> str:
    """Every region written anew from the committed results; what was done, in words."""
    try:
        rows, campaign = sources()
        texts = {p: render(p.read_text(), rows, campaign) for p in documents()}
    except KeyError as missing:
        return f"the docs' figures kept: the committed run has no row {missing}"
    changed = [p for p, text in texts.items() if text != p.read_text()]
    for p in changed:
        p.write_text(texts[p])
    return f"the docs' figures rewritten in {', '.join(str(p.relative_to(ROOT)) for p in changed) or 'none (up to date)'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a region differs (nothing is written)")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        print("doc_figures: " + (f"stale: {', '.join(bad)} (run python perf/doc_figures.py)" if bad else "up to date"))
        return 1 if bad else 0
    print(f"doc_figures: {rewrite()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
