"""Command line: ``python -m kvcanary doctor`` | ``python -m kvcanary demo [...]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcanary", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="versions, compiled archs, cache, GPUs and a launch round-trip")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import run
        return run()
    return 2


if __name__ == "__main__":
    sys.exit(main())
