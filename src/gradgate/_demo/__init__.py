"""``gradgate demo``: common questions answered by running code, with an HTML report.

Sections: which gradients backward computes (conv stacks, audited and drawn); a real training
run on scikit-learn's bundled digits, full backprop against a random depth per minibatch;
four more questions (intermediate gradients, a frozen layer that still moves, actor-critic,
which depth fits a GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .._plumbing.errors import InvalidOptionError, MissingExtraError
from .._plumbing.progress import Progress

if TYPE_CHECKING:
    from ._answers import Answer
    from ._digits import Run
    from ._scenarios import Scenario

DEFAULT_OUT = Path("gradgate-out")


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo`` to the ``gradgate`` command line."""
    parser = commands.add_parser(
        "demo",
        help="answer the common questions with measured evidence, write an HTML report",
        description="Answer the common questions about where gradients flow with code run "
        "just now, print the evidence and write one offline HTML report "
        '(FOLDER/gradgate-demo.html). Needs: pip install "gradgate[demo]"; graphs need '
        "Graphviz's dot program.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="FOLDER",
        help="folder for the report, created if missing (default: %(default)s)",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_int,
        default=6,
        metavar="N",
        help="epochs of the digits training run (default: %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(run=_run_command)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1; e.g. --epochs 6")
    return value


def _run_command(args: argparse.Namespace) -> int:
    run_demo(out=args.out, epochs=args.epochs, progress=not args.no_progress)
    return 0


def require_extras() -> None:
    """Raise :class:`MissingExtraError` with the pip command if the demo's packages are absent."""
    missing = [
        {"sklearn": "scikit-learn"}.get(module, module)
        for module in ("sklearn", "matplotlib")
        if not _installed(module)
    ]
    if missing:
        raise MissingExtraError(
            f"the demo needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'}"
            ' not installed; install them with: pip install "gradgate[demo]"'
        )


def _installed(module: str) -> bool:
    """Whether ``import module`` would find it, without importing it (a ``None`` entry in
    ``sys.modules`` blocks an import, as Python itself treats it)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def writable_folder(out: Path) -> Path:
    """Create ``out`` if needed and check that a file can be written there."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".gradgate-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise InvalidOptionError(
            f"--out {str(out)!r}: cannot write a report there ({reason}); expected a folder "
            "you can write to, e.g. --out ./gradgate-out"
        ) from None
    return out


def run_demo(*, out: str | Path, epochs: int = 6, seed: int = 0, progress: bool = True) -> Path:
    """Run every section, print the evidence, write the HTML report; returns its path."""
    if epochs < 1:
        raise InvalidOptionError(f"epochs={epochs}; expected a whole number >= 1, e.g. 6")
    require_extras()
    folder = writable_folder(Path(out))
    from ._answers import answers
    from ._digits import train_digits
    from ._page import write_report
    from ._scenarios import conv_scenarios

    start = time.perf_counter()
    bar = Progress(total=4, description="gradgate demo", enabled=progress)
    scenarios = conv_scenarios()
    bar.advance("questions on conv stacks audited")
    runs = train_digits(epochs=epochs, seed=seed)
    bar.advance("digits trained")
    found = answers()
    bar.advance("more questions answered")
    path = write_report(folder, scenarios, runs, found)
    bar.advance("report written")
    bar.close()
    _print_summary(scenarios, runs, found)
    print(f"\nreport written in {time.perf_counter() - start:.0f} s: {path.resolve()}")
    return path


def _print_summary(scenarios: list[Scenario], runs: list[Run], found: list[Answer]) -> None:
    from ._tables import summary

    print("gradgate demo: where do gradients flow, and what does backward compute?\n")
    for scenario in scenarios:
        print(f"Q: {scenario.question}\n   {summary(scenario.report)}")
    full, gated = runs
    print("\nQ: Does training with a random depth per minibatch still learn? (digits)")
    for run in runs:
        print(f"   {run.summary()}")
    print(
        f"   random depth: {gated.backward_flops / full.backward_flops:.2f}x the backward "
        f"FLOPs of full backprop, median step {gated.median_step / full.median_step:.2f}x "
        "(steps interleaved in one process)"
    )
    for answer in found:
        print(f"\nQ: {answer.question}\n   {answer.sentence}")
