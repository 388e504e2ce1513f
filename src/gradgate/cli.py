"""The ``gradgate`` command line: one parser; each command adds its own sub-command.

>>> parser = build_parser()
>>> parser.parse_args(["demo", "--epochs", "2"]).epochs
2
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

from . import _bench, _demo
from ._memory import plan_command as _plan_command
from ._plumbing.errors import GradgateError

DESCRIPTION = "gradgate decides where gradients flow in a PyTorch model, and proves it."
EPILOG = 'Run "gradgate COMMAND --help" for the options of a command.'

# Optional packages a command may need, and the extra that installs them.
_EXTRA_OF = {"sklearn": "demo", "matplotlib": "demo", "tqdm": "demo", "transformers": "bench"}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: what is wrong, and where help is; a flag
    means only itself (no abbreviations: ``--learn`` is never ``--learn-embeddings``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The one parser of ``gradgate``; each command (demo, bench, plan) adds its sub-command."""
    parser = _Parser(
        prog="gradgate",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", metavar="COMMAND", title="commands"),
    )
    _demo.add_command(commands)
    _bench.add_command(commands)
    _plan_command.add_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (``argv`` defaults to ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exit:  # --help, --version and option errors
        return exit.code if isinstance(exit.code, int) else 1
    if args.command is None:
        parser.print_help()
        return 0
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
