"""The ``gradgate`` command line: ``demo`` (the main job) and ``bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the chosen command; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["bench"]:  # the bench parses its own options
        from .bench import main as bench_main

        return bench_main(args_list[1:])
    parser = argparse.ArgumentParser(prog="gradgate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train with a per-minibatch depth and show the proof")
    demo.add_argument("--out", default="gradgate-out", help="folder for the HTML report")
    demo.add_argument("--epochs", type=int, default=6, help="epochs of the digits training run")
    commands.add_parser("bench", help="the performance benchmark (gradgate bench --help)")
    args = parser.parse_args(args_list)
    if args.command == "demo":
        from ._demo import run_demo

        return run_demo(out=args.out, epochs=args.epochs)
    return 2
