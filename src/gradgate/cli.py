"""The ``gradgate`` command line: one parser; each command adds its own sub-command.

>>> parser = build_parser()
>>> parser.parse_args(["demo", "--epochs", "2"]).epochs
2
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, cast

from . import _demo
from ._errors import GradgateError

DESCRIPTION = """\
gradgate decides where gradients flow in a PyTorch model, and proves it.

commands:
  gradgate demo     answer the common questions with measured evidence, write an HTML report
  gradgate bench    compare full backprop, freezing by hand, gradgate and the ideal

Run "gradgate COMMAND --help" for a command's options."""

# Optional packages a command may need, and the extra that installs them.
_EXTRA_OF = {"sklearn": "demo", "matplotlib": "demo", "tqdm": "demo", "transformers": "bench"}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: what is wrong, and where help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The one parser of ``gradgate``; ``demo`` and ``bench`` add their own sub-commands."""
    parser = _Parser(
        prog="gradgate",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", metavar="COMMAND", title="commands"),
    )
    _demo.add_command(commands)
    _add_bench(commands)
    return parser


def _add_bench(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``gradgate bench``: its options are parsed by :func:`gradgate.bench.main` for now."""
    bench = commands.add_parser(
        "bench",
        add_help=False,
        help="compare full backprop, freezing by hand, gradgate and the ideal (bench --help)",
    )
    bench.set_defaults(run=None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (``argv`` defaults to ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
        if args.command is None:
            parser.print_help()
            return 0
        if args.run is None:  # bench, until it adds its own sub-command
            from .bench import main as bench_main

            return _guarded(args.command, lambda: bench_main(rest))
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exit:  # --help, --version and option errors
        return exit.code if isinstance(exit.code, int) else 1
    return _guarded(args.command, lambda: int(args.run(args)))


def _guarded(command: str, run: Callable[[], int]) -> int:
    """Run a command; a gradgate error or a missing optional package becomes one line."""
    try:
        return int(run())
    except GradgateError as error:
        return _fail(command, str(error))
    except ModuleNotFoundError as error:
        top = (error.name or "").partition(".")[0]
        if top not in _EXTRA_OF:
            raise
        extra = _EXTRA_OF[top]
        return _fail(
            command,
            f"needs the optional package {top!r}, which is not installed; "
            f'install it with: pip install "gradgate[{extra}]"',
        )


def _fail(command: str, message: str) -> int:
    print(f"gradgate {command}: error: {message}", file=sys.stderr)
    return 1


def _version() -> str:
    import torch

    from . import __version__

    return f"gradgate {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"
