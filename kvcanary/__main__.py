"""Command line: ``python -m kvcanary doctor`` | ``python -m kvcanary demo [...]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcanary", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="versions, compiled archs, cache, GPUs and a launch round-trip")
    from .demo import add_arguments
    add_arguments(sub.add_parser("demo", help="inject the fault classes K1-K13 into a simulated serving "
                                 "engine and print what the canary caught (GPU if found, else CPU)"))
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import run
        return run()
    if args.command == "demo":
        from .demo import run
        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
