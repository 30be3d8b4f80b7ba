"""kvcanary's command line: ``doctor`` (what is installed, compiled and answering) and ``demo``
(the fault-injection campaign). Run it as ``python -m kvcanary`` or as the ``kvcanary`` script."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__, abi
from .cli.demo import Parser, add_arguments, run_cli
from .cli.doctor import run as run_doctor


def prog_name(argv0: str | None = None) -> str:
    """The name the user typed: ``kvcanary`` for the console script, else ``python -m kvcanary``
    (``-m`` puts this file's path in argv[0])."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    return "kvcanary" if os.path.splitext(os.path.basename(argv0))[0] == "kvcanary" else "python -m kvcanary"


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description="kvcanary: a canary for the paged KV cache of LLM serving engines.")
    parser.add_argument("--version", action="version",
                        version=f"kvcanary {__version__} (canary format v{abi.FORMAT_VERSION})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{doctor,demo}")
    parser.commands = {"doctor": sub.add_parser(
        "doctor", help="versions, compiled archs, cache, GPUs and a launch round-trip",
        description="Print versions, compiled archs, the compile cache, the GPUs and a launch "
                    "round-trip; exit 1 when something needed is broken.")}
    parser.commands["demo"] = demo = sub.add_parser(
        "demo", help="inject the fault classes K1-K13 into a simulated serving engine and print what the canary "
                     "caught (GPU if found, else CPU)",
        description="Inject the fault classes K1-K13 into a simulated serving engine and print what the canary "
                    "caught, per class and hash mode; exit 1 on a miss or a false positive.")
    add_arguments(demo)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    prog = prog or prog_name()
    parser = build_parser(prog)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # the command's own parser names it: "kvcanary demo: error: ..."
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # a bad flag was printed as one kv-canary line (--help, --version: exit 0)
        if exc.code == 2:
            return 2
        raise
    if args.command == "doctor":
        return run_doctor()
    return run_cli(args, f"{prog} demo")


if __name__ == "__main__":
    sys.exit(main())
