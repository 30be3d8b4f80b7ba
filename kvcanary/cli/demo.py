"""``python -m kvcanary demo``: inject every fault class of docs/faults.md into a simulated paged-KV
serving engine guarded by a KvCanary and print what the canary caught, class x hash mode.

Runs on the GPU when the CUDA driver finds one (``--backend auto``), else on the CPU reference
backend. ``--jobs`` (default ``auto``: one worker process per usable CPU on the CPU backend, none
on the GPU) runs the independent injections, and that many clean runs sharing the clean-run slot
count, in spawned worker processes. ``--out DIR`` also writes ``campaign.json`` and, with
matplotlib installed, ``campaign.png``. Bad flags raise :class:`~kvcanary.errors.ValidationError`
(the command line prints it as one line and exits 2: :class:`Parser` does the same for what argparse
itself refuses, a flag it does not know or a value that is not a number).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import (KvCanaryError, NoCudaDriverError, ValidationError, ValidationTypeError)
from ..runtime import driver
from ..sim import campaign, output, workers
from ..sim.clean import clean_run
from ..sim.faults import CLASSES, MODES

EVERY = "every"  # --modes / --classes: every hash mode / every class


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one ``kv-canary:`` line on stderr (exit code 2, no usage block)."""

    def error(self, message: str):
        if "kv-canary:" in message:  # a flag's own type check (see _integer / _one_of)
            text = message[message.index("kv-canary:"):]
        else:
            text = (f"kv-canary: expected the commands and flags --help lists, got: {message}. Fix: run "
                    f"`{self.prog} --help`")
        self.exit(2, f"{self.prog}: error: {text}\n")


def _integer(flag: str, example: str, lo: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or (lo is not None and value < lo):
            want = "an integer" + ("" if lo is None else f" >= {lo}")
            raise argparse.ArgumentTypeError(f"kv-canary: {flag} must be {want}, got {text!r}. Fix: e.g. "
                                             f"{flag} {example}")
        return value
    return parse


def _one_of(flag: str, options: tuple[str, ...]):
    def parse(text: str) -> str:
        if text.lower() not in options:
            raise argparse.ArgumentTypeError(f"kv-canary: {flag} must be one of {', '.join(options)}, got {text!r}. "
                                             f"Fix: e.g. {flag} {options[0]}")
        return text.lower()
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--injections", type=_integer("--injections", "5"), default=5, metavar="N",
                   help="seeded injections per class x mode, >= 1 (default 5)")
    p.add_argument("--classes", default=EVERY,
                   help="comma-separated fault classes, e.g. K1,K5,K12 (default every: K1..K14, K5b)")
    p.add_argument("--modes", default=EVERY,
                   help="comma-separated hash modes: none, partial, all (all = hash mode ALL alone); "
                        "default every = none,partial,all")
    p.add_argument("--backend", type=_one_of("--backend", ("auto", "cpu", "gpu")), default="auto",
                   metavar="{auto,cpu,gpu}", help="gpu if a CUDA device answers, else the CPU reference (default auto)")
    p.add_argument("--out", default=None, metavar="DIR", help="also write campaign.json (and campaign.png)")
    p.add_argument("--clean-slots", type=_integer("--clean-slots", "1000000"), default=1_000_000, metavar="N",
                   help="verified slots of the clean run that counts false positives (0: skip it)")
    p.add_argument("--seed", type=_integer("--seed", "0", lo=0), default=0, metavar="N",
                   help="seed of the injections and workloads, >= 0 (default 0)")
    p.add_argument("--report", type=_one_of("--report", ("log", "raise")), default="log", metavar="{log,raise}",
                   help="how violations reach the campaign: export callback or CanaryViolationError")
    p.add_argument("--progress", type=_one_of("--progress", ("auto", "on", "off")), default="auto",
                   metavar="{auto,on,off}",
                   help="a one-line progress bar on stderr: auto (default: when stderr is a terminal), on, off")
    p.add_argument("--jobs", default="auto", metavar="N",
                   help="worker processes for the injections and the clean run: auto (default: one per "
                        "usable CPU on the CPU backend, none on the GPU), 0 (one per usable CPU), "
                        "1 (none: run in this process) or a count")


def pick_backend(choice: str) -> str:
    """"cpu" or "gpu" for ``--backend``; "gpu" with no usable GPU is a ValidationError."""
    if choice == "cpu":
        return "cpu"
    try:
        reason = None if driver.device_count() > 0 else "the CUDA driver reports 0 devices"
    except NoCudaDriverError:
        reason = "no CUDA driver (libcuda) on this machine"
    except KvCanaryError as exc:
        reason = str(exc).splitlines()[0].removeprefix("kv-canary: ")
    if choice == "auto" or reason is None:
        return "cpu" if reason else "gpu"
    raise ValidationError(f"kv-canary: --backend gpu needs a CUDA GPU, got none: {reason}. Fix: --backend "
                          f"cpu (the CPU reference backend), or --backend auto to use a GPU when one answers")


def parse_list(text: str, allowed: tuple[str, ...], flag: str, example: str) -> list[str]:
    """The items of ``allowed`` that the comma-separated ``text`` names, in the order given,
    duplicates dropped, case-insensitive; ``every`` alone names all of ``allowed``."""
    canon = {a.lower(): a for a in allowed}
    words = [w.strip() for w in str(text).split(",") if w.strip()]
    if [w.lower() for w in words] == [EVERY]:
        return list(allowed)
    bad = [w for w in words if w.lower() not in canon]
    if bad or not words:
        got = f"unknown {', '.join(repr(w) for w in bad)} in {text!r}" if bad else f"{text!r}"
        raise ValidationError(f"kv-canary: {flag} takes a comma-separated list of {', '.join(allowed)} "
                              f"(or '{EVERY}' for all of them), got {got}. Fix: e.g. {flag} {example}")
    return list(dict.fromkeys(canon[w.lower()] for w in words))


def check_out_dir(path: str) -> None:
    """``--out``: a folder that exists (it is created) and can be written, checked before any work."""
    try:
        os.makedirs(path, exist_ok=True)
        writable = os.access(path, os.W_OK | os.X_OK)
        reason = "not writable"
    except OSError as exc:
        writable, reason = False, f"{type(exc).__name__}: {exc.strerror or exc}"
    if not writable:
        raise ValidationError(f"kv-canary: --out must be a folder the demo can write, got {path!r} ({reason}). "
                              f"Fix: pass a writable folder, e.g. --out results")


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    """Run the campaign and the clean run; 0 when every exercised covered injection was caught
    and the clean run reported nothing, 1 otherwise. Bad flags raise ValidationError before any
    work starts."""
    classes = parse_list(args.classes, CLASSES, "--classes", "K1,K5,K12")
    modes = parse_list(args.modes, MODES, "--modes", "partial,all")
    campaign.check_injections(args.injections)
    if args.clean_slots < 0:
        raise ValidationError(f"kv-canary: --clean-slots must be >= 0, got {args.clean_slots}. Fix: a slot "
                              f"count such as 1000000, or --clean-slots 0 to skip the clean run")
    if args.out:
        check_out_dir(args.out)
    backend = pick_backend(args.backend)
    jobs = workers.resolve_jobs(args.jobs, backend)
    progress = output.Progress(None if args.progress == "auto" else args.progress == "on")
    print(f"kvcanary demo: {len(classes)} class(es) x {len(modes)} mode(s), {args.injections} injection(s) "
          f"each, backend {backend}" + (f", {jobs} worker processes" if jobs > 1 else ""), file=out, flush=True)
    result = campaign.run_campaign(classes, modes, args.injections, backend=backend, seed=args.seed,
                                   report=args.report, progress=progress, jobs=jobs)
    clean = []
    if args.clean_slots > 0:
        clean.append(clean_run(args.clean_slots, hash_mode=modes[-1], backend=backend, seed=args.seed,
                               progress=progress, jobs=jobs))
    print(output.format_table(result, clean), file=out)
    if args.out:
        files = [output.write_json(result, clean, os.path.join(args.out, "campaign.json"))]
        png = output.heatmap(result, os.path.join(args.out, "campaign.png"))
        files.append(png or "(no PNG: pip install matplotlib)")
        print("wrote " + ", ".join(files), file=out)
    ok = output.passed(result, clean)
    print(output.result_line(ok), file=out)
    return 0 if ok else 1


def run_cli(args: argparse.Namespace, prog: str) -> int:
    """:func:`run` for a command line: a bad flag (or ``--backend gpu`` without a GPU) prints one
    line on stderr and returns 2 instead of a traceback."""
    try:
        return run(args)
    except (ValidationError, ValidationTypeError, NoCudaDriverError) as exc:
        print(f"{prog}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    prog = "python -m kvcanary.cli.demo"
    p = Parser(prog=prog, description=__doc__)
    add_arguments(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:  # a bad flag, printed as one kv-canary line
        if exc.code == 2:
            return 2
        raise
    return run_cli(args, prog)


if __name__ == "__main__":
    sys.exit(main())
