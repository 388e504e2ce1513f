"""``gradgate plan CONFIG.json --batch B --seq S``: memory per depth (or learning set) of a
transformers config, built on the ``meta`` device (no weights, no download) and planned as
:func:`gradgate.estimate` plans, for CUDA. With ``--memory``, every depth around the budget is
planned, so that the answer is the largest depth that fits, not only one of 0, 1, 2, 4, ...;
``--learn``, ``--freeze`` and ``--badam`` plan what the API's ``learn=`` and a frozen module
plan. Errors and warnings speak in flags (``--dtype bf16``), not in Python keywords.
"""

from __future__ import annotations

import argparse
import difflib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._plumbing.errors import GradgateWarning, InvalidDepthError, InvalidOptionError
from .budget import needed_bytes, parse_bytes, plan_around
from .configs import (
    check_seq,
    default_blocks,
    embedding_names,
    example_inputs,
    head_names,
    is_vision,
    meta_model,
    quiet_transformers,
    read_config,
)
from .learners import freeze_patterns, learn_sets, learn_text, learning_text
from .memory_plan import MemoryPlan, MemoryRow, format_bytes
from .options import DTYPES, LOW, OPTIMIZERS, default_depths, dtype_option, parameter_dtype
from .sharding.flags import add_flags, check_flags, whole_number

if TYPE_CHECKING:
    from .estimate import StepPlanner

Depths = list[tuple[str, int, int]] | str  # (as typed, first, last) ranges, or "all"


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``plan`` to the ``gradgate`` command line."""
    parser = commands.add_parser(
        "plan",
        help="memory per depth of a transformers config, and the largest depth that fits",
        description="Plan the memory of one training step per depth (the last k blocks "
        "learn) or per learning set for a transformers config file: the model is built on "
        "the meta device, so a 70B config is planned on a laptop. The whole step is simulated "
        "(forward with the loss, backward, optimizer step), for a CUDA device. Decoder-only, "
        'encoder-decoder and vision configs. Needs transformers: pip install "gradgate[bench]".',
        allow_abbrev=False,  # a flag means only itself: --learn is never --learn-embeddings
    )
    parser.add_argument("config", type=Path, metavar="CONFIG.json", help="a config.json file")
    parser.add_argument(
        "--batch", type=whole_number("--batch", "batch size", 8), required=True, metavar="B",
        help="batch size",
    )  # fmt: skip
    parser.add_argument(
        "--seq", type=whole_number("--seq", "sequence length", 2048), metavar="S",
        help="sequence length (text models; a vision config takes its image size)",
    )  # fmt: skip
    parser.add_argument(
        "--memory",
        metavar="SIZE",
        help="memory budget, e.g. 24GiB: plan the depths around it, print what fits",
    )
    parser.add_argument(
        "--headroom",
        metavar="SIZE",
        help="kept free on top of the peak (default: 512MiB + 5%% of the peak)",
    )
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument(
        "--dtype",
        type=_dtype_text,
        metavar="DTYPE",
        help="parameter dtype: bf16, fp16 or fp32 (default: the config's, else fp32)",
    )
    precision.add_argument(
        "--amp",
        choices=("bf16", "fp16"),
        help="fp32 weights, the forward under torch.autocast in this dtype",
    )
    parser.add_argument(
        "--masters",
        choices=("fp32", "none"),
        help="fp32: fp32 masters and optimizer state for the learners only "
        "(gg.optim.LearnerMasters); none: no masters (the default, but with --badam)",
    )
    parser.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="adamw", help="the optimizer (default: adamw)"
    )
    parser.add_argument(
        "--depths",
        type=_depths_text,
        metavar="LIST",
        help="depths to plan: 0,1,2,8 or ranges 0-4,8 or all (default: 0, 1, 2, 4, ... all; "
        "none with --learn or --badam)",
    )
    parser.add_argument(
        "--learn",
        action="append",
        type=learn_text,
        metavar="SET",
        help="a row where these learn: block positions, ranges and module names or globs, "
        "e.g. --learn 0 --learn 0,1 --learn 2-5,model.embed_tokens (one row each, as "
        "gg.estimate(learn=[...]); what runs after the blocks learns too, unless frozen)",
    )
    parser.add_argument(
        "--learn-embeddings",
        action="store_true",
        help="the input embeddings learn too, in every row",
    )
    parser.add_argument(
        "--freeze",
        action="extend",
        nargs="+",
        metavar="PATTERN",
        help="modules frozen in every row (names or globs), e.g. --freeze lm_head",
    )
    parser.add_argument(
        "--badam",
        action="store_true",
        help="BAdam: one block learns at a time (a row with block 0, the deepest backward, "
        "unless --learn gives others), the LM head frozen, --masters fp32 unless given",
    )
    parser.add_argument(
        "--checkpointing",
        action="store_true",
        help="with gradient checkpointing (transformers' activation_checkpointing_enable, "
        "gradient_checkpointing_enable before 5.23)",
    )
    add_flags(parser)
    parser.add_argument(
        "--blocks",
        nargs="+",
        metavar="PATTERN",
        help="the block sequence, e.g. 'decoder.block.*' (default: found; for an "
        "encoder-decoder, the encoder's blocks then the decoder's)",
    )
    parser.set_defaults(run=_run_command)


def _dtype_text(text: str) -> str:
    name = text.strip().lower().removeprefix("torch.")
    if name not in DTYPES:
        close = [n for n in DTYPES if n.startswith(name)] or difflib.get_close_matches(
            name, DTYPES, n=1
        )
        hint = f"did you mean {close[0]}? " if close else ""
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dtype; {hint}expected bf16, fp16 or fp32 (or bfloat16, "
            "float16, float32), e.g. --dtype bf16"
        )
    return name


def _depths_text(text: str) -> Depths:
    """``"all"``, or ``0,1,2`` / ``0-4,8`` as inclusive ranges, each with its text."""
    if text.strip() == "all":
        return "all"
    ranges = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not (first.isdigit() and (not last or last.isdigit())):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a list of depths; expected e.g. 0,1,2,8 or 0-4,8 or all"
            )
        ranges.append((part.strip(), int(first), int(last or first)))
    return ranges


def _run_command(args: argparse.Namespace) -> int:
    budget = None if args.memory is None else parse_bytes(args.memory, "--memory")
    headroom = None if args.headroom is None else parse_bytes(args.headroom, "--headroom")
    found = plan_config(
        args.config,
        batch=args.batch,
        seq=args.seq,
        dtype=args.dtype,
        amp=args.amp,
        masters=args.masters,
        optimizer=args.optimizer,
        depths=args.depths,
        learn=args.learn,
        learn_embeddings=args.learn_embeddings,
        freeze=args.freeze,
        badam=args.badam,
        checkpointing=args.checkpointing,
        blocks=args.blocks,
        budget=budget,
        headroom=headroom,
        gpus=args.gpus,
        shard=args.shard,
        deepspeed=args.deepspeed,
    )
    print(found.plan.table())
    if budget is not None:
        print(verdict(found, args.memory, budget, headroom))
    return 0


@dataclass
class ConfigPlan:
    """What ``gradgate plan`` planned: the plan, the depth each depth row stands for (with
    ``--learn-embeddings`` they are learning sets), and what learns in each row, in words."""

    plan: MemoryPlan
    depths: dict[MemoryRow, int] = field(default_factory=dict)
    learning: dict[MemoryRow, str] = field(default_factory=dict)
    head: str | None = None  # the LM head, where it learns in the depth rows


def plan_config(
    path: Path,
    *,
    batch: int,
    seq: int | None = None,
    dtype: str | None = None,
    amp: str | None = None,
    masters: str | None = None,
    optimizer: str = "adamw",
    depths: Depths | None = None,
    learn: list[tuple[str, list[int | str]]] | None = None,
    learn_embeddings: bool = False,
    freeze: list[str] | None = None,
    badam: bool = False,
    checkpointing: bool = False,
    blocks: list[str] | None = None,
    budget: int | None = None,
    headroom: int | None = None,
    gpus: int = 1,
    shard: str | None = None,
    deepspeed: Path | None = None,
) -> ConfigPlan:
    """Build the config's model on the meta device and plan it for ``batch`` x ``seq``: the
    depths asked (with a budget, also every depth around it), the learning sets asked, then a
    full fine-tune. With ``gpus`` and ``shard``, every row is one GPU's bytes."""
    from .estimate import StepPlanner  # the planner loads torch: on first use

    check_flags(gpus, shard, deepspeed)
    if badam and masters is None and amp is None:
        masters = "fp32"  # BAdam's recipe: low-precision weights, fp32 masters for one block
    masters = None if masters == "none" else masters
    if amp is not None and masters is not None:
        raise InvalidOptionError(
            "--masters fp32 keeps float32 masters of low-precision weights, and --amp keeps "
            "float32 weights: expected --dtype bf16 --masters fp32, or --amp alone."
        )
    with quiet_transformers():
        config = read_config(path)
        if seq is not None and is_vision(config):
            warnings.warn(
                f"--seq {seq} is ignored: a vision config takes its image size from the config "
                f"(image_size={config.image_size}), not from --seq.",
                GradgateWarning,
                stacklevel=2,
            )
        check_seq(config, seq)
        model = meta_model(config, checkpointing=checkpointing)
        weights = "fp32" if amp else dtype or _config_dtype(config)  # autocast: fp32 weights
        _check_masters(model, weights, masters, badam)
        frozen = freeze_patterns(model, [*(freeze or []), *(head_names(model) if badam else [])])
        inputs = example_inputs(model, config, batch, seq)
        planner = StepPlanner(
            model,
            (),
            inputs,
            optimizer=optimizer,
            dtype=weights,
            amp=amp,
            masters=masters,
            device="cuda",
            blocks=blocks if blocks is not None else default_blocks(model),
            world=gpus,
            shard=shard,
            deepspeed=None if deepspeed is None else str(deepspeed),
        )
        with planner:
            extra = embedding_names(model) if learn_embeddings else []
            sets = learn_sets(model, planner.block_names, learn or [], badam)
            found = _plan_rows(planner, depths, sets, extra, budget, headroom)
            found.head = next(iter(_learning(model, head_names(model))), None)
    found.plan.notes += _frozen_notes(frozen)
    return found


def _learning(model: Any, names: list[str]) -> list[str]:
    """Those of the modules ``names`` with a parameter that requires grad."""
    return [n for n in names if any(p.requires_grad for p in model.get_submodule(n).parameters())]


def _check_masters(model: Any, weights: str | None, masters: str | None, badam: bool) -> None:
    """``--masters fp32`` over low-precision weights only, said in flags."""
    planned = dtype_option(weights) or parameter_dtype(model)
    if masters is None or planned in LOW:
        return
    name = str(planned).removeprefix("torch.")
    why = "--badam plans" if badam else "--masters fp32 keeps"
    raise InvalidOptionError(
        f"{why} float32 masters of low-precision weights, but the planned weights are {name} "
        f"({'--dtype ' + weights if weights else 'the config gives no dtype'}); pass --dtype "
        "bf16 (or fp16) for bf16 weights with fp32 masters, or --amp bf16 without --masters "
        f"for {name} weights under autocast{', or --masters none' if badam else ''}."
    )


def _plan_rows(
    planner: StepPlanner,
    depths: Depths | None,
    sets: list[frozenset[int | str]],
    extra: list[str],
    budget: int | None,
    headroom: int | None,
) -> ConfigPlan:
    """Plan the depths asked for (with a budget, also those around it), the learning sets and
    a full fine-tune; note what learns in each."""
    n, learning = planner.blocks, {}
    trainable = planner.trainable

    def planned(plan: int | frozenset[int | str] | None) -> MemoryRow:
        row = planner.row(plan)
        learning[row] = learning_text(planner.learners, trainable, planner.block_names)
        return row

    def depth_row(depth: int) -> MemoryRow:
        if not extra:
            return planned(depth)
        return planned(frozenset([*range(n - depth, n), *extra]))

    by_depth: dict[int, MemoryRow] = {}
    if depths is not None or not sets:
        by_depth = {depth: depth_row(depth) for depth in _chosen(depths, n)}
    if budget is not None and by_depth:

        def fits(row: MemoryRow) -> bool:
            return needed_bytes(row, "cuda", headroom) <= budget

        plan_around(by_depth, depth_row, n, fits)
    set_rows = [planned(frozenset([*items, *extra])) for items in sets]
    full = planned(None)
    plan = planner.result([*(by_depth[d] for d in sorted(by_depth)), *set_rows, full])
    for depth, row in by_depth.items():
        if extra:
            shown = f"{depth} (all blocks)" if depth == n else str(depth)
            plan.labels[row] = f"{shown} + embeddings"
    for row in set_rows:
        if extra:
            plan.labels[row] = f"{row.label} + embeddings"
    depth_of = {row: depth for depth, row in by_depth.items()}
    return ConfigPlan(plan, depth_of, learning)


def _chosen(depths: Depths | None, n: int) -> list[int]:
    if depths is None:
        return default_depths(n)
    if isinstance(depths, str):  # "all"
        return list(range(n + 1))
    chosen: list[int] = []
    for text, first, last in depths:
        if not 0 <= first <= last <= n:
            raise InvalidDepthError(
                f"--depths {text} is out of range: the model has {n} blocks; expected depths "
                f"in 0..{n}, e.g. --depths 0-{n} or --depths all."
            )
        chosen += range(first, last + 1)
    return sorted(set(chosen))


def _frozen_notes(frozen: list[str]) -> list[str]:
    if not frozen:
        return []
    return [
        "full fine-tune: no cut, every parameter learns but the frozen ones, embeddings included",
        f"frozen in every row: {', '.join(frozen)}",
    ]


def _config_dtype(config: Any) -> str | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def verdict(found: ConfigPlan, text: str, budget: int, headroom: int | None = None) -> str:
    """The answer to ``--memory``: the largest depth that fits, each learning set's fate, the
    full fine-tune's; each with what learns in it."""
    plan = found.plan

    def needs(row: MemoryRow) -> int:
        return needed_bytes(row, plan.device, headroom)

    def where(row: MemoryRow) -> str:
        return f", where {found.learning[row]} learn" if row in found.learning else ""

    if plan.shard is not None:
        text = f"{text} per GPU ({plan.world} GPUs, {plan.shard})"
    how = (
        "peak + headroom: 512 MiB + 5% of the peak"
        if headroom is None
        else f"peak + headroom {format_bytes(headroom)}"
    )
    lines = []
    depth_rows = list(found.depths)
    fitting = [row for row in depth_rows if needs(row) <= budget]
    if fitting:
        best = max(fitting, key=lambda row: found.depths[row])
        lines.append(
            f"largest depth that fits in {text} ({how}): {found.depths[best]} "
            f"({format_bytes(needs(best))}){where(best)}"
        )
    elif depth_rows:
        smallest = min(depth_rows, key=lambda row: row.peak_bytes)
        lines.append(
            f"no depth fits in {text} ({how}): the smallest is {format_bytes(needs(smallest))} "
            f"(depth {found.depths[smallest]}{where(smallest)})"
        )
        if found.head is not None:  # it learns at every depth
            lines.append(
                f"{found.head} learns at every depth: --freeze {found.head} (or --badam) plans "
                "it frozen"
            )
    for row in plan.rows:
        if row in found.depths:
            continue
        fate = "fits" if needs(row) <= budget else "does not fit"
        if row.learn is None:
            lines.append(f"a full fine-tune {fate} ({format_bytes(needs(row))}){where(row)}")
        else:
            name = plan.labels.get(row, row.label)
            lines.append(f"{name} {fate} in {text} ({how}): {format_bytes(needs(row))}{where(row)}")
    return "\n".join(lines)
