"""Campaign output: the terminal matrix, a JSON file and a PNG heat map (matplotlib, if installed)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def cell_text(cell: dict) -> str:
    if not cell["covered"]:
        return "not covered"
    exercised = cell["detected"] + cell["missed"]
    text = f"{cell['detected']}/{exercised}" + ("  MISS" if cell["missed"] else "")
    return text + (f" +{cell['not_exercised']} n.e." if cell["not_exercised"] else "")


def format_table(result: dict, clean: list[dict] | None = None) -> str:
    """The class x mode matrix: detected/exercised per cell, then latency and clean runs."""
    modes, cells = result["modes"], result["cells"]
    lines = [f"kvcanary fault-injection campaign: backend {result['backend']}, {result['injections']} "
             f"injection(s) per class x mode, seed {result['seed']}, {result['seconds']} s",
             f"{'class':<29}" + "".join(f"{m:<17}" for m in modes) + "latency: fault / read -> report"]
    for c in result["classes"]:
        row = [cells[f"{c}/{m}"] for m in modes]
        lat = [x["latency_max"] for x in row if x.get("latency_max") is not None]
        means = [x["latency_mean"] for x in row if x.get("latency_mean") is not None]
        reads = [x["read_latency_max"] for x in row if x.get("read_latency_max") is not None]
        lat_text = f"max {max(lat)} mean {sum(means) / len(means):.1f} / max {max(reads)}" if lat else "-"
        lines.append(f"{c:<4} {result['titles'][c]:<24}" + "".join(f"{cell_text(x):<17}" for x in row) + lat_text)
    lines += ["cells: detected / exercised injections (the fault landed and was read); n.e. = never "
              "read, not counted.",
              "latency in engine steps: from the corruption to the first report (max, mean), and from the "
              "first read of the corrupted content to the first report (max; 0 = the step that read it).",
              *not_covered_lines(result)]
    bad = [r for r in result["runs"] if r["clean_violations"] or r["error"]]
    if bad:
        lines.append(f"WARNING: {len(bad)} injection(s) with violations before the fault or engine errors")
    for r in harness_errors(result)[:3]:
        lines.append(f"ERROR: {r['cls']}/{r['mode']} seed {r['seed']} failed before its fault landed: {r['error']}")
    for c in clean or []:
        lines.append(f"clean run ({c['hash_mode']}): {c['verified_slots']:,} verified slots, "
                     f"{c['protected_tokens']:,} protected tokens, {c['false_positives']} false positive(s), "
                     f"{c['steps']} steps" + (f" over {c['runs']} runs" if c.get("runs", 1) > 1 else "")
                     + f", {c['seconds']} s")
    return "\n".join(lines)


def not_covered_lines(result: dict) -> list[str]:
    """One line per hash mode with cells it cannot see (classes, then why), and the PARTIAL
    window note when PARTIAL ran; nothing for a mode that sees every class it ran."""
    lines = []
    for m in result["modes"]:
        off = [(c, result["cells"][f"{c}/{m}"]["note"]) for c in result["classes"]
               if not result["cells"][f"{c}/{m}"]["covered"]]
        if off:
            why = "; ".join(dict.fromkeys(note.split(";")[0] for _, note in off))
            lines.append(f"not covered in {m}: {', '.join(c for c, _ in off)} ({why}; see docs/faults.md).")
    if "partial" in result["modes"]:
        lines.append(result["partial_note"] + ".")
    return lines


def harness_errors(result: dict) -> list[dict]:
    """Injections whose engine raised before the fault landed: the sim or the library is broken
    there (a corrupted engine tripping over itself comes after its fault)."""
    return [r for r in result.get("runs", ()) if r["error"] and r["injected_step"] is None]


def passed(result: dict, clean: list[dict] | None = None) -> bool:
    """Every exercised injection of a covered pair detected, nothing reported on clean runs, no
    engine error before a fault landed."""
    return (all(x["missed"] == 0 and x["clean_violations"] == 0 for x in result["cells"].values() if x["covered"])
            and all(c["false_positives"] == 0 for c in clean or []) and not harness_errors(result))


def result_line(ok: bool) -> str:
    """The campaign's last line, from :func:`passed`."""
    return "result: " + ("every exercised injection of a covered class was caught; no false positives" if ok
                         else "MISSES OR FALSE POSITIVES, see above")


def write_json(result: dict, clean: list[dict] | None, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({**result, "clean_runs": clean or []}, f, indent=1, sort_keys=True, default=str)
    return path


def heatmap(result: dict, path: str) -> str | None:
    """PNG of detection rate per class x mode; None when matplotlib is not installed. Each cell
    shows detected/exercised (+ not exercised); its colour is the rate (colour bar), grey where
    the mode cannot see the class or no injection was exercised."""
    try:  # matplotlib is optional
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = heatmap_figure(result)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def heatmap_figure(result: dict):
    """The matplotlib Figure of :func:`heatmap` (needs matplotlib)."""
    import matplotlib.pyplot as plt  # on first use: matplotlib is optional
    from matplotlib.patches import Patch
    classes, modes = result["classes"], result["modes"]
    rate = np.full((len(classes), len(modes)), np.nan)
    fig, ax = plt.subplots(figsize=(4.2 + 1.5 * len(modes), 1.9 + 0.42 * len(classes)))
    for i, c in enumerate(classes):
        for j, m in enumerate(modes):
            cell = result["cells"][f"{c}/{m}"]
            if cell["covered"] and cell["rate"] is not None:
                rate[i, j] = cell["rate"]
            dark = cell["covered"] and cell["rate"] is not None and (cell["rate"] > 0.8 or cell["rate"] < 0.2)
            ax.text(j, i, cell_text(cell).replace(" +", "\n+"), ha="center", va="center", fontsize=8,
                    color="white" if dark else "black")
    ax.set_facecolor("#dddddd")  # not covered / nothing exercised
    image = ax.imshow(np.ma.masked_invalid(rate), cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(modes)), modes)
    ax.set_yticks(range(len(classes)), [f"{c} {result['titles'][c]}" for c in classes])
    ax.set_xlabel("hash mode (none: identity only; partial: first 16 bytes per source; all: every byte)",
                  fontsize=8)
    ax.set_ylabel("fault class (docs/faults.md)")
    bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    bar.set_label("detection rate = detected / exercised")
    fig.legend(handles=[Patch(facecolor="#dddddd", edgecolor="#999999",
                              label="grey: not covered by the mode, or nothing exercised")],
               loc="lower center", fontsize=8, frameon=False)
    ax.set_title(f"kvcanary detection rate ({result['backend']} backend, {result['injections']} "
                 f"injection(s) per cell)\ncell text: detected/exercised, +n.e. = injected but never read",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # room for the legend below
    return fig


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal, or when forced)."""

    def __init__(self, enabled: bool | None = None, width: int = 30, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width = width

    def __call__(self, done: int, total: int, label: str = "") -> None:
        if not self.enabled or total <= 0:
            return
        fill = int(self.width * done / total)
        self.stream.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {done}/{total} {label:<16}")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
