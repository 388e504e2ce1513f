"""``gradgate plan CONFIG.json --batch B --seq S``: memory per depth of a transformers config,
built on the ``meta`` device (no weights, no download) and planned as :func:`gradgate.estimate`
plans, for CUDA. With ``--memory``, every depth around the budget is planned, so that the
answer is the largest depth that fits, not only one of 0, 1, 2, 4, ...
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._plumbing.errors import InvalidDepthError, InvalidOptionError
from .budget import needed_bytes, parse_bytes, plan_around
from .configs import (
    check_seq,
    default_blocks,
    embedding_names,
    example_inputs,
    meta_model,
    quiet_transformers,
    read_config,
)
from .memory_plan import MemoryPlan, MemoryRow, format_bytes
from .options import OPTIMIZERS, default_depths

if TYPE_CHECKING:
    from .estimate import StepPlanner


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``plan`` to the ``gradgate`` command line."""
    parser = commands.add_parser(
        "plan",
        help="memory per depth of a transformers config, and the largest depth that fits",
        description="Plan the memory of one training step per depth (the last k blocks "
        "learn) for a transformers config file: the model is built on the meta device, so "
        "a 70B config is planned on a laptop. The whole step is simulated (forward with the "
        "loss, backward, optimizer step), for a CUDA device. Decoder-only, encoder-decoder and "
        'vision configs. Needs transformers: pip install "gradgate[bench]".',
    )
    parser.add_argument("config", type=Path, metavar="CONFIG.json", help="a config.json file")
    parser.add_argument(
        "--batch", type=_positive_int, required=True, metavar="B", help="batch size"
    )
    parser.add_argument(
        "--seq", type=_positive_int, metavar="S", help="sequence length (text models)"
    )
    parser.add_argument(
        "--memory",
        metavar="SIZE",
        help="memory budget, e.g. 24GiB: plan the depths around it, print the largest that fits",
    )
    parser.add_argument(
        "--headroom",
        metavar="SIZE",
        help="kept free on top of the peak (default: 512MiB + 5%% of the peak)",
    )
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument(
        "--dtype",
        metavar="DTYPE",
        help="parameter dtype, e.g. bf16 (default: the config's, else fp32)",
    )
    precision.add_argument(
        "--amp",
        choices=("bf16", "fp16"),
        help="fp32 weights, the forward under torch.autocast in this dtype",
    )
    parser.add_argument(
        "--masters",
        choices=("fp32",),
        help="fp32 masters and optimizer state for the learners only (gg.optim.LearnerMasters)",
    )
    parser.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="adamw", help="the optimizer (default: adamw)"
    )
    parser.add_argument(
        "--depths",
        type=_depths_text,
        metavar="LIST",
        help="depths to plan: 0,1,2,8 or ranges 0-4,8 or all (default: 0, 1, 2, 4, ... all)",
    )
    parser.add_argument(
        "--learn-embeddings",
        action="store_true",
        help="the input embeddings learn too, at every depth",
    )
    parser.add_argument(
        "--checkpointing",
        action="store_true",
        help="with gradient checkpointing (transformers' gradient_checkpointing_enable)",
    )
    parser.add_argument(
        "--blocks",
        nargs="+",
        metavar="PATTERN",
        help="the block sequence, e.g. 'decoder.block.*' (default: found; for an "
        "encoder-decoder, the encoder's blocks then the decoder's)",
    )
    parser.set_defaults(run=_run_command)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1, e.g. 2048")
    return value


def _depths_text(text: str) -> list[tuple[int, int]] | str:
    """``"all"``, or ``0,1,2`` / ``0-4,8`` as inclusive (first, last) ranges."""
    if text.strip() == "all":
        return "all"
    ranges = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not (first.isdigit() and (not last or last.isdigit())):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a list of depths; expected e.g. 0,1,2,8 or 0-4,8 or all"
            )
        ranges.append((int(first), int(last or first)))
    return ranges


def _run_command(args: argparse.Namespace) -> int:
    budget = None if args.memory is None else parse_bytes(args.memory)
    headroom = None if args.headroom is None else parse_bytes(args.headroom)
    plan = plan_config(
        args.config,
        batch=args.batch,
        seq=args.seq,
        dtype=args.dtype,
        amp=args.amp,
        masters=args.masters,
        optimizer=args.optimizer,
        depths=args.depths,
        learn_embeddings=args.learn_embeddings,
        checkpointing=args.checkpointing,
        blocks=args.blocks,
        budget=budget,
        headroom=headroom,
    )
    print(plan.table())
    if budget is not None:
        print(verdict(plan, args.memory, budget, headroom))
    return 0


def plan_config(
    path: Path,
    *,
    batch: int,
    seq: int | None = None,
    dtype: str | None = None,
    amp: str | None = None,
    masters: str | None = None,
    optimizer: str = "adamw",
    depths: list[tuple[int, int]] | str | None = None,
    learn_embeddings: bool = False,
    checkpointing: bool = False,
    blocks: list[str] | None = None,
    budget: int | None = None,
    headroom: int | None = None,
) -> MemoryPlan:
    """Build the config's model on the meta device and plan it for ``batch`` x ``seq``: the
    depths asked (with a budget, also every depth around it), then a full fine-tune."""
    from .estimate import StepPlanner  # the planner loads torch: on first use

    if amp is not None and masters is not None:
        raise InvalidOptionError(
            "--masters fp32 keeps float32 masters of low-precision weights, and --amp keeps "
            "float32 weights: expected --dtype bf16 --masters fp32, or --amp alone."
        )
    with quiet_transformers():
        config = read_config(path)
        check_seq(config, seq)
        model = meta_model(config, checkpointing=checkpointing)
        inputs = example_inputs(model, config, batch, seq)
        planner = StepPlanner(
            model,
            (),
            inputs,
            optimizer=optimizer,
            dtype="fp32" if amp else dtype or _config_dtype(config),  # autocast: fp32 weights
            amp=amp,
            masters=masters,
            device="cuda",
            blocks=blocks if blocks is not None else default_blocks(model),
        )
        with planner:
            extra = embedding_names(model) if learn_embeddings else []
            fits = None if budget is None else _fits(budget, headroom)
            rows = _depth_rows(planner, depths, extra, fits)
            full = planner.row(None)
    plan = planner.result([rows[depth] for depth in sorted(rows)] + [full])
    for depth, found in rows.items():
        if extra:
            shown = f"{depth} (all blocks)" if depth == planner.blocks else str(depth)
            plan.labels[found] = f"{shown} + embeddings"
    return plan


def _depth_rows(
    planner: StepPlanner,
    depths: list[tuple[int, int]] | str | None,
    extra: list[str],
    fits: Callable[[MemoryRow], bool] | None,
) -> dict[int, MemoryRow]:
    """The rows asked for, by depth; with ``fits``, also those around the budget."""
    n = planner.blocks

    def row(depth: int) -> MemoryRow:
        if not extra:
            return planner.row(depth)
        return planner.row(frozenset([*range(n - depth, n), *extra]))

    rows = {depth: row(depth) for depth in _chosen(depths, n)}
    if fits is not None:
        plan_around(rows, row, n, fits)
    return rows


def _fits(budget: int, headroom: int | None) -> Callable[[MemoryRow], bool]:
    def fits(row: MemoryRow) -> bool:
        return needed_bytes(row, "cuda", headroom) <= budget

    return fits


def _chosen(depths: list[tuple[int, int]] | str | None, n: int) -> list[int]:
    if depths is None:
        return default_depths(n)
    if isinstance(depths, str):  # "all"
        return list(range(n + 1))
    chosen: list[int] = []
    for first, last in depths:
        if not 0 <= first <= last <= n:
            raise InvalidDepthError(
                f"--depths {first}-{last} is out of range: the model has {n} blocks; "
                f"expected depths in 0..{n}, e.g. --depths 0-{n} or --depths all."
            )
        chosen += range(first, last + 1)
    return sorted(set(chosen))


def _config_dtype(config: Any) -> str | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def verdict(plan: MemoryPlan, text: str, budget: int, headroom: int | None = None) -> str:
    """The answer to ``--memory``: the largest depth that fits, the full fine-tune's fate."""
    rows = [row for row in plan.rows if row.depth is not None or row.learn is not None]
    full = [row for row in plan.rows if row.depth is None and row.learn is None]

    def needs(row: MemoryRow) -> int:
        return needed_bytes(row, plan.device, headroom)

    fitting = [row for row in rows if needs(row) <= budget]
    how = (
        "peak + headroom: 512 MiB + 5% of the peak"
        if headroom is None
        else (f"peak + headroom {format_bytes(headroom)}")
    )
    if fitting:
        best = max(fitting, key=lambda row: _depth(plan, row))
        best_row = f"{_depth(plan, best)} ({format_bytes(needs(best))})"
        answer = f"largest depth that fits in {text} ({how}): {best_row}"
    else:
        smallest = min(rows, key=lambda row: row.peak_bytes)
        answer = (
            f"no depth fits in {text} ({how}): the smallest is "
            f"{format_bytes(needs(smallest))} (depth {_depth(plan, smallest)})"
        )
    for row in full:
        fate = "fits" if needs(row) <= budget else "does not fit"
        answer += f"\na full fine-tune {fate} ({format_bytes(needs(row))})"
    return answer


def _depth(plan: MemoryPlan, row: MemoryRow) -> int:
    if row.depth is not None:
        return row.depth
    learn = row.learn or frozenset()
    return sum(isinstance(item, int) for item in learn)
