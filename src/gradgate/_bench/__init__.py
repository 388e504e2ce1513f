"""``gradgate bench``: full backprop, late freezing, the requires_grad idiom, gradgate and the
hand-written ideal, measured in one process, interleaved.

Prints a table naming the device and the command, writes JSON (``machine``, ``results``,
``compile``) and a PNG plot. :func:`add_command` adds the sub-command to ``gradgate``'s
parser; ``python -m gradgate._bench`` runs it on its own. Importing this package is light:
the measuring modules, transformers and matplotlib load when the command runs.

>>> import argparse
>>> parser = argparse.ArgumentParser(prog="gradgate")
>>> add_command(parser.add_subparsers())
>>> args = parser.parse_args(["bench", "--quick", "--device", "cuda", "--amp", "bf16"])
>>> command_line(args)
'gradgate bench --quick --device cuda --amp bf16'
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MODELS = ("transformer", "gpt2", "llama", "conv_stack")
NEEDS_TRANSFORMERS = ("gpt2", "llama")
AMP_CHOICES = ("none", "bf16")
REPEATS = (1, 1000)
WARMUP = (0, 100)
THREADS = (1, 1024)
COMPILE_BACKEND = "aot_eager"
SIZE_REPEATS = {"full": 7, "quick": 9, "tiny": 2}
SIZE_COMPILE_BLOCKS = {"full": 12, "quick": 4, "tiny": 4}
SUMMARY = "compare full backprop, freezing by hand, gradgate and the ideal"


def add_command(subparsers: Any) -> None:
    """Add ``bench`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); the parsed
    namespace's ``run`` runs it and returns the exit status."""
    parser = subparsers.add_parser(
        "bench",
        help=SUMMARY,
        description=__doc__.split("\n\n")[0].replace("``", ""),
    )
    add_options(parser)
    parser.set_defaults(run=run_command)


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``gradgate bench``."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="smaller models, 4 depths, 9 repeats (about a minute)"
    )
    size.add_argument("--tiny", action="store_true", help="toy sizes, for smoke tests")
    parser.add_argument(
        "--device",
        default="cpu",
        type=_device,
        help="where to run: cpu (default), cuda or cuda:N; on CUDA the models are larger, "
        "steps are timed with CUDA events and peak memory is torch.cuda's",
    )
    parser.add_argument(
        "--amp",
        default="none",
        choices=AMP_CHOICES,
        help="run each forward under torch.autocast with this dtype (weights stay float32); "
        "default: none",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODELS,
        metavar="MODEL",
        help=f"a subset of the models ({', '.join(MODELS)}); default: all",
    )
    parser.add_argument(
        "--repeats",
        metavar="N",
        type=_in_range(*REPEATS),
        help="timed steps per configuration (default: 7, 9 with --quick, 2 with --tiny)",
    )
    parser.add_argument(
        "--warmup",
        metavar="N",
        type=_in_range(*WARMUP),
        help="untimed rounds before timing (default: 1 on the CPU, 3 on CUDA)",
    )
    parser.add_argument(
        "--threads",
        metavar="N",
        type=_in_range(*THREADS),
        help="CPU threads for torch (default: torch's own choice); 1 is steadier on a busy machine",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=Path("gradgate-out/bench.json"),
        metavar="PATH",
        help="where to write the results as JSON (default: gradgate-out/bench.json)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path("gradgate-out/bench.png"),
        metavar="PATH",
        help="where to write the PNG plot of step time and FLOPs per depth "
        "(default: gradgate-out/bench.png)",
    )
    parser.add_argument(
        "--no-plot", action="store_true", help="write no plot (needs no matplotlib)"
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print the table as Markdown, as in RESULTS.md"
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="PATH",
        help="measure nothing: print the table (and plot) of a JSON file an earlier run wrote",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile section")
    parser.add_argument(
        "--compile-backend",
        default=COMPILE_BACKEND,
        metavar="NAME",
        help="torch.compile backend of the compile section (default: aot_eager; the graph "
        "counts do not depend on it)",
    )
    parser.add_argument(
        "--no-overheads", action="store_true", help="skip the depth-change and audit overheads"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--schedules",
        action="store_true",
        help="add the schedules section: every schedule in gradgate.schedules side by side "
        "(backward FLOPs, saved bytes, optimizer state)",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="add the distributed section: bytes all-reduced per step by plain DDP and by "
        "gg.distributed.allreduce_trained at several depths (2 gloo processes on the CPU)",
    )
    parser.add_argument(
        "--prefix-cache",
        action="store_true",
        help="add the prefix-cache section: a step with gg.PrefixCache at depth 1 of 12 as a "
        "ratio to the gate alone, from the second epoch (memory, disk) and in the first",
    )


def _in_range(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not allowed; expected an integer from {low} to {high}"
            )
        return value

    return parse


def _device(text: str) -> str:
    if text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected cpu, cuda or cuda:N")


def command_line(args: argparse.Namespace) -> str:
    """The ``gradgate bench`` command that measures what ``args`` asks for (outputs left out)."""
    parts = ["gradgate bench"]
    parts += ["--quick"] if args.quick else ["--tiny"] if args.tiny else []
    parts += [] if args.device == "cpu" else ["--device", args.device]
    parts += [] if args.amp == "none" else ["--amp", args.amp]
    parts += ["--models", *args.models] if args.models else []
    for option in ("repeats", "warmup", "threads"):
        value = getattr(args, option)
        parts += [] if value is None else [f"--{option}", str(value)]
    parts += ["--no-compile"] if args.no_compile else []
    if not args.no_compile and args.compile_backend != COMPILE_BACKEND:
        parts += ["--compile-backend", args.compile_backend]
    parts += ["--no-overheads"] if args.no_overheads else []
    parts += ["--schedules"] if args.schedules else []
    parts += ["--distributed"] if args.distributed else []
    parts += ["--prefix-cache"] if args.prefix_cache else []
    return " ".join(parts)


def run_command(args: argparse.Namespace) -> int:
    """Run ``gradgate bench`` for parsed options; returns the exit status."""
    from . import report
    from .table import render

    if not args.no_plot:
        _require("matplotlib", "--plot (or pass --no-plot)")
    if args.from_json is not None:
        document = report.read_json(args.from_json)
    else:
        document = _measure(args)
        if args.schedules:
            from .sections import schedules

            document["schedules"] = schedules.measure()
        if args.distributed:
            from .sections import distributed

            document["distributed"] = distributed.measure()
        if args.prefix_cache:
            document["prefix_cache"] = _prefix_cache(args)
        report.write_json(document, args.json)
    print(render(document, fmt="markdown" if args.markdown else "text"))
    for section in (s for s in report.SECTIONS if s in document):
        module = importlib.import_module(f"{__name__}.sections.{section}")
        print("\n" + module.table(document[section]))
    written = [] if args.from_json is not None else [str(args.json)]
    if not args.no_plot:
        report.plot(document, args.plot)
        written.append(str(args.plot))
    if written:
        print(f"\nwrote {' and '.join(written)}", file=sys.stderr)
    return 0


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    from .device import resolve
    from .run import Options, run
    from .workloads import Size

    device = resolve(args.device)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    models = list(args.models or MODELS)
    if any(model in NEEDS_TRANSFORMERS for model in models):
        _require(
            "transformers", "the gpt2 and llama models (or pass --models transformer conv_stack)"
        )
    size: Size = "tiny" if args.tiny else "quick" if args.quick else "full"
    options = Options(
        size=size,
        repeats=args.repeats or SIZE_REPEATS[size],
        warmup=args.warmup if args.warmup is not None else 3 if device.type == "cuda" else 1,
        models=models,
        device=str(device),
        amp=None if args.amp == "none" else args.amp,
        compile=not args.no_compile,
        compile_backend=args.compile_backend,
        compile_blocks=SIZE_COMPILE_BLOCKS[size],
        overheads=not args.no_overheads,
        progress=not args.no_progress,
        command=command_line(args),
    )
    return run(options)


def _prefix_cache(args: argparse.Namespace) -> list[dict[str, Any]]:
    from .device import resolve
    from .sections import prefix_cache
    from .workloads import Size

    size: Size = "tiny" if args.tiny else "quick" if args.quick else "full"
    models = tuple(args.models or MODELS)
    return prefix_cache.measure(size=size, models=models, device=resolve(args.device))


def _require(package: str, needed_by: str) -> None:
    if importlib.util.find_spec(package) is None:
        from .._plumbing.errors import MissingExtraError

        raise MissingExtraError(
            f"the optional package {package!r} is not installed and {needed_by} needs it; "
            'install it with: pip install "gradgate[bench]"'
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradgate._bench [options]``: the same command without the ``gradgate`` CLI."""
    from .._plumbing.errors import GradgateError

    parser = argparse.ArgumentParser(
        prog="python -m gradgate._bench", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    add_options(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        return run_command(args)
    except GradgateError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
