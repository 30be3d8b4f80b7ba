"""Merge fault-injection campaigns run in parts (``kvcanary demo --classes ... --out PART``, e.g.
one device call per group of classes) into one result, its table, heat map and a summary small
enough to commit.

    python -m kvcanary.sim.merge PART1/campaign.json PART2/campaign.json ... --out DIR

The parts must share backend, seed and injections per cell; each class x mode cell must come from
one part only. Cells are rebuilt from the injections' records (the same summary a one-shot
campaign computes); a part that is itself a summary (``campaign-summary.json``, e.g. one committed
by an earlier session) gives its cells as they are. Clean runs are merged by
:func:`clean.merge_clean_runs` per hash mode.
``DIR/campaign-summary.json`` keeps the cells, the clean runs and only the injections that were
not detected although exercised, or that failed (replay them by seed); ``DIR/campaign.json``
keeps every record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import ValidationError
from . import campaign, output
from .clean import merge_clean_runs
from .faults import CLASSES, MODES


def merge(parts: list[dict]) -> tuple[dict, list[dict]]:
    """One campaign result (and its clean runs) from results of disjoint class x mode cells."""
    if not parts:
        raise ValidationError("kv-canary: merge needs at least one campaign part, got none. Fix: pass the "
                              "campaign.json of each part")
    same = ("backend", "seed", "injections")
    for i, p in enumerate(parts[1:], start=1):
        for k in same:
            if p[k] != parts[0][k]:
                raise ValidationError(f"kv-canary: campaign parts must share {k}, got {parts[0][k]!r} in part 0 and "
                                      f"{p[k]!r} in part {i}. Fix: run every part with the same --{k} (and backend)")
    runs, cells, owner, given = [], {}, {}, {}
    for i, p in enumerate(parts):
        if "runs" not in p:  # a committed summary: its cells as they are, its kept records
            given.update(p["cells"])
        for name, cell in p["cells"].items():
            if name in owner:
                raise ValidationError(f"kv-canary: campaign cell {name} is in parts {owner[name]} and {i}, expected "
                                      f"each cell in one part. Fix: give each part its own --classes")
            owner[name] = i
        runs += p.get("runs", p.get("kept_runs", []))
    classes = [c for c in CLASSES if any(c in p["classes"] for p in parts)]
    modes = [m for m in MODES if any(m in p["modes"] for p in parts)]
    for c in classes:
        for m in modes:
            name = f"{c}/{m}"
            if name not in owner:
                continue
            cells[name] = given[name] if name in given else \
                campaign.cell(c, m, [r for r in runs if r["cls"] == c and r["mode"] == m])
    titles = {c: t for p in parts for c, t in p["titles"].items()}
    result = dict(backend=parts[0]["backend"], seed=parts[0]["seed"], injections=parts[0]["injections"],
                  classes=classes, modes=modes, titles=titles, partial_note=parts[0]["partial_note"], cells=cells,
                  runs=runs, seconds=round(sum(p["seconds"] for p in parts), 2))
    clean_by_mode = {}
    for p in parts:
        for c in p.get("clean_runs", []):
            clean_by_mode.setdefault(c["hash_mode"], []).append(c)
    clean = []
    for mode, cs in clean_by_mode.items():
        merged = cs[0] if len(cs) == 1 else merge_clean_runs(cs)
        clean.append({**merged, "hash_mode": mode, "seconds": round(sum(c["seconds"] for c in cs), 2),
                      "runs": sum(c.get("runs", 1) for c in cs)})
    return result, clean


def summary(result: dict, clean: list[dict]) -> dict:
    """``result`` without the records of injections that were detected or never exercised."""
    keep = [r for r in result["runs"] if r["outcome"] == "missed" or r["error"] or r["clean_violations"]]
    keep = list({(r["cls"], r["mode"], r["seed"]): r for r in keep}.values())
    return {**{k: v for k, v in result.items() if k != "runs"}, "clean_runs": clean, "kept_runs": keep,
            "note": "per-injection records of detected and not-exercised injections left out; "
                    "kept_runs: every missed, failed or early-reporting injection (replay by cls, mode, seed)"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcanary.sim.merge", description=__doc__.splitlines()[0])
    p.add_argument("parts", nargs="+", help="campaign.json of each part")
    p.add_argument("--out", required=True, metavar="DIR", help="where campaign.json, campaign-summary.json, "
                   "campaign.txt and campaign.png go")
    args = p.parse_args(argv)
    try:
        parts = []
        for path in args.parts:
            with open(path) as f:
                try:
                    parts.append(json.load(f))
                except json.JSONDecodeError as exc:
                    raise ValidationError(f"kv-canary: {path} must be a campaign JSON, got text that is not JSON "
                                          f"({exc}). Fix: pass the campaign.json the demo wrote with --out") from None
        result, clean = merge(parts)
    except KeyError as exc:
        print(f"{p.prog}: error: kv-canary: every part must be a campaign.json (or campaign-summary.json), got one "
              f"without {exc}. Fix: pass the files the demo wrote with --out", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{p.prog}: error: kv-canary: every part must be a readable file, got {exc}. Fix: pass the "
              f"campaign.json files the demo wrote with --out", file=sys.stderr)
        return 2
    except ValidationError as exc:  # a part that is not JSON or does not fit the others
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    table = output.format_table(result, clean)
    ok = output.passed(result, clean)
    table += "\n" + output.result_line(ok)
    with open(os.path.join(args.out, "campaign.txt"), "w") as f:
        f.write(table + "\n")
    output.write_json(result, clean, os.path.join(args.out, "campaign.json"))
    with open(os.path.join(args.out, "campaign-summary.json"), "w") as f:
        json.dump(summary(result, clean), f, indent=1, sort_keys=True, default=str)
    output.heatmap(result, os.path.join(args.out, "campaign.png"))
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
