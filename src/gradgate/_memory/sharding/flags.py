"""``gradgate plan``'s options for several GPUs: ``--gpus``, ``--shard`` and ``--deepspeed``,
and the check that they agree; the whole-number type its counts share (``--gpus``, ``--batch``,
``--seq``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from ..._plumbing.errors import InvalidOptionError
from ..options import SHARDS


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--gpus N``, ``--shard ENGINE`` and ``--deepspeed DS_CONFIG.json``."""
    parser.add_argument(
        "--gpus",
        type=whole_number("--gpus", "number of GPUs", 4),
        default=1,
        metavar="N",
        help="GPUs the step runs on; with --shard every row is one GPU's bytes (default: 1)",
    )
    parser.add_argument(
        "--shard",
        choices=SHARDS,
        help="how the GPUs divide the model: ddp (replicas), fsdp2 (fully_shard on each block "
        "and the model), zero1, zero2 or zero3 (DeepSpeed); needs --gpus 2 or more",
    )
    parser.add_argument(
        "--deepspeed",
        type=Path,
        metavar="DS_CONFIG.json",
        help="a DeepSpeed config whose zero_optimization buckets the plan follows (with "
        "--shard zero1, zero2 or zero3; default: DeepSpeed's own defaults)",
    )


def whole_number(flag: str, what: str, example: int) -> Callable[[str], int]:
    """An argparse type for a count >= 1, its error naming ``what`` with an example."""

    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number >= 1; expected the {what}, e.g. {flag} {example}"
            )
        return value

    return whole


def check_flags(gpus: int, shard: str | None, deepspeed: Path | None) -> None:
    """--gpus, --shard and --deepspeed agree, or the command says how to make them."""
    if shard is not None and gpus < 2:
        raise InvalidOptionError(
            f"--shard {shard} divides the step among GPUs, but --gpus is {gpus}; expected "
            f"--gpus N with N >= 2 (e.g. --gpus 4 --shard {shard}), or no --shard for one GPU."
        )
    if shard is None and gpus > 1:
        raise InvalidOptionError(
            f"--gpus {gpus} needs to know how the GPUs divide the model; expected --shard "
            f"{' | '.join(SHARDS)} (e.g. --gpus {gpus} --shard fsdp2)."
        )
    if deepspeed is not None and not (shard or "").startswith("zero"):
        raise InvalidOptionError(
            f"--deepspeed {deepspeed} sets DeepSpeed ZeRO's buckets, but --shard is {shard}; "
            "expected --shard zero1, zero2 or zero3 with it, or no --deepspeed."
        )
