"""``python -m kvcanary demo``: inject every fault class of FAULTS.md into a simulated paged-KV
serving engine guarded by a KvCanary and print what the canary caught, class x hash mode.

Runs on the GPU when the CUDA driver finds one (``--backend auto``), else on the CPU reference
backend; the default run takes well under a minute on a 2-core CPU machine. ``--jobs N`` runs the
independent injections (and N clean runs that share the clean-run slot count) in N spawned worker
processes. ``--out DIR`` also writes ``campaign.json`` and, with matplotlib installed, ``campaign.png``.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--injections", type=int, default=5, help="seeded injections per class x mode (default 5)")
    p.add_argument("--classes", default="all", help="comma-separated classes, e.g. K1,K5,K12 (default all)")
    p.add_argument("--modes", default="none,partial,all", help="comma-separated hash modes (default all three)")
    p.add_argument("--backend", choices=("auto", "cpu", "gpu"), default="auto",
                   help="gpu if a CUDA device answers, else the CPU reference (default auto)")
    p.add_argument("--out", default=None, metavar="DIR", help="also write campaign.json (and campaign.png)")
    p.add_argument("--clean-slots", type=int, default=1_000_000,
                   help="verified slots of the clean run that counts false positives (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", choices=("log", "raise"), default="log",
                   help="how violations reach the campaign: export callback or CanaryViolationError")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="worker processes for the injections and the clean run (default 1: none; "
                        "0: one per CPU)")


def pick_backend(choice: str) -> str:
    if choice != "auto":
        return choice
    from . import driver
    from .errors import KvCanaryError
    try:
        return "gpu" if driver.device_count() > 0 else "cpu"
    except KvCanaryError:
        return "cpu"


def _split(text: str, allowed: tuple, what: str) -> list[str]:
    items = list(allowed) if text == "all" else [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"kv-canary: --{what} takes a comma-separated subset of {','.join(allowed)}, "
                         f"got {text!r}")
    return items


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    """Run the campaign and the clean run; 0 when every exercised covered injection was caught
    and the clean run reported nothing."""
    from .sim import campaign, report
    from .sim.faults import CLASSES, MODES
    classes, modes = _split(args.classes, CLASSES, "classes"), _split(args.modes, MODES, "modes")
    try:
        jobs = campaign.resolve_jobs(args.jobs)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    backend = pick_backend(args.backend)
    progress = report.Progress(None if args.progress == "auto" else args.progress == "on")
    print(f"kvcanary demo: {len(classes)} class(es) x {len(modes)} mode(s), {args.injections} injection(s) "
          f"each, backend {backend}" + (f", {jobs} worker processes" if jobs > 1 else ""), file=out, flush=True)
    result = campaign.run_campaign(classes, modes, args.injections, backend=backend, seed=args.seed,
                                   report=args.report, progress=progress, jobs=jobs)
    clean = []
    if args.clean_slots > 0:
        clean.append(campaign.clean_run(args.clean_slots, hash_mode=modes[-1], backend=backend,
                                        seed=args.seed, progress=progress, jobs=jobs))
    print(report.format_table(result, clean), file=out)
    if args.out:
        files = [report.write_json(result, clean, os.path.join(args.out, "campaign.json"))]
        png = report.heatmap(result, os.path.join(args.out, "campaign.png"))
        files.append(png or "(no PNG: pip install matplotlib)")
        print("wrote " + ", ".join(files), file=out)
    ok = report.passed(result, clean)
    print("result: " + ("every exercised injection of a covered class was caught; no false positives" if ok
                        else "MISSES OR FALSE POSITIVES, see above"), file=out)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcanary demo", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
