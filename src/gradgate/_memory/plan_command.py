"""``gradgate plan CONFIG.json --batch B --seq S``: memory per depth of a transformers config,
built on the ``meta`` device (no weights, no download) and planned by :func:`gradgate.estimate`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .._plumbing.errors import InvalidOptionError
from .memory_plan import MemoryPlan, format_bytes, parse_bytes

_OPTIMIZERS = ("adamw", "adam", "sgd_momentum", "sgd")


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``plan`` to the ``gradgate`` command line."""
    parser = commands.add_parser(
        "plan",
        help="memory per depth of a transformers config, and the largest depth that fits",
        description="Plan the memory of one training step per depth (the last k blocks "
        "learn) for a transformers config file: the model is built on the meta device, so "
        "a 70B config is planned on a laptop. Causal language models include their loss. "
        'Needs transformers: pip install "gradgate[bench]".',
    )
    parser.add_argument("config", type=Path, metavar="CONFIG.json", help="a config.json file")
    parser.add_argument(
        "--batch", type=_positive_int, required=True, metavar="B", help="batch size"
    )
    parser.add_argument(
        "--seq", type=_positive_int, required=True, metavar="S", help="sequence length"
    )
    parser.add_argument(
        "--memory",
        metavar="SIZE",
        help="memory budget, e.g. 24GiB: print the largest depth that fits",
    )
    parser.add_argument(
        "--dtype",
        metavar="DTYPE",
        help="parameter dtype, e.g. bf16 (default: the config's, else fp32)",
    )
    parser.add_argument(
        "--optimizer", choices=_OPTIMIZERS, default="adamw", help="optimizer state (default: adamw)"
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


def _run_command(args: argparse.Namespace) -> int:
    budget = None if args.memory is None else parse_bytes(args.memory)
    plan = plan_config(
        args.config, batch=args.batch, seq=args.seq, dtype=args.dtype, optimizer=args.optimizer
    )
    print(plan.table())
    if budget is not None:
        print(_verdict(plan, args.memory, budget))
    return 0


def plan_config(
    path: Path, *, batch: int, seq: int, dtype: str | None = None, optimizer: str = "adamw"
) -> MemoryPlan:
    """Build the config's model on the meta device and plan it for ``batch`` x ``seq`` tokens."""
    import torch

    from .estimate import estimate

    config = _read_config(path)
    model = _meta_model(config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    inputs: dict[str, Any] = {"input_ids": ids}
    if type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        inputs["labels"] = ids  # the loss is part of the step: logits in fp32, log-softmax
    return estimate(model, **inputs, optimizer=optimizer, dtype=dtype or _config_dtype(config))


def _read_config(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise InvalidOptionError(
            f"cannot read {str(path)!r} as a config ({reason}); expected the path of a "
            "transformers config.json, e.g. one saved by config.save_pretrained(folder)."
        ) from None
    model_type = data.pop("model_type", None) if isinstance(data, dict) else None
    if not isinstance(model_type, str):
        raise InvalidOptionError(
            f'{str(path)!r} has no "model_type"; expected a transformers config.json with '
            'e.g. "model_type": "llama".'
        )
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as error:
        raise InvalidOptionError(f"{str(path)!r}: {error}") from None


def _meta_model(config: Any) -> Any:
    import torch
    import transformers

    names = getattr(config, "architectures", None) or []
    with torch.device("meta"):
        for name in names:
            if isinstance(getattr(transformers, name, None), type):
                return getattr(transformers, name)(config)
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a language model: the bare model
            return transformers.AutoModel.from_config(config)


def _config_dtype(config: Any) -> str | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _verdict(plan: MemoryPlan, text: str, budget: int) -> str:
    best = plan.fits(budget)
    if best is not None:
        return f"largest depth that fits in {text}: {best}"
    smallest = min(plan.rows, key=lambda row: row.peak_bytes)
    return (
        f"no depth fits in {text}: the smallest predicted peak is "
        f"{format_bytes(smallest.peak_bytes)} (depth {smallest.depth})"
    )
