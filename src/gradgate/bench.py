"""``gradgate bench``: full backprop, late freezing, the requires_grad idiom, gradgate and the
hand-written ideal, measured in one process, interleaved (DESIGN §5).

Prints a table, writes JSON (``{"machine", "results", "compile"}``) and a PNG plot::

    gradgate bench --quick --json gradgate-out/bench.json --plot gradgate-out/bench.png
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ._bench.workloads import FACTORIES, Size


def parser() -> argparse.ArgumentParser:
    """The command line of ``gradgate bench``.

    >>> parser().parse_args(["--quick"]).quick
    True
    """
    p = argparse.ArgumentParser(prog="gradgate bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes and depths (< 3 min)")
    p.add_argument("--tiny", action="store_true", help="toy sizes, for smoke tests")
    p.add_argument("--json", type=Path, default=Path("gradgate-out/bench.json"))
    p.add_argument("--plot", type=Path, default=Path("gradgate-out/bench.png"))
    p.add_argument("--repeats", type=int, help="timed steps per configuration")
    p.add_argument("--models", nargs="+", choices=list(FACTORIES), help="subset of the models")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile section")
    p.add_argument(
        "--compile-backend",
        default="aot_eager",
        help="torch.compile backend for the compile section (graph counts do not depend on it)",
    )
    p.add_argument("--no-overheads", action="store_true", help="skip the overhead figures")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str]) -> int:
    """Run the benchmark; returns the exit status."""
    from ._bench import report
    from ._bench.run import Options, run

    args = parser().parse_args(list(argv))
    if args.repeats is not None and args.repeats < 1:
        from ._errors import InvalidOptionError

        raise InvalidOptionError(f"--repeats {args.repeats}; expected an integer >= 1.")
    size: Size = "tiny" if args.tiny else "quick" if args.quick else "full"
    options = Options(
        size=size,
        repeats=args.repeats or {"full": 7, "quick": 3, "tiny": 2}[size],
        warmup=1,
        models=args.models or list(FACTORIES),
        compile=not args.no_compile,
        compile_backend=args.compile_backend,
        compile_blocks={"full": 12, "quick": 8, "tiny": 4}[size],
        overheads=not args.no_overheads,
        progress=not args.no_progress,
    )
    document = run(options)
    print(report.table(document))
    report.write_json(document, args.json)
    report.plot(document, args.plot)
    print(f"\nwrote {args.json} and {args.plot}", file=sys.stderr)
    return 0
