"""A transformers config as a model to plan: built on the ``meta`` device, with example inputs
for its kind (decoder-only, encoder-decoder, vision) and the blocks to cut over."""

from __future__ import annotations

import contextlib
import difflib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from .._plumbing.errors import InvalidOptionError
from .._select.names import blocks as find_blocks

_POSITIONS = ("max_position_embeddings", "n_positions", "max_positions", "n_ctx")
# class-name endings -> the labels' shape: one per sequence or one per token
_PER_EXAMPLE = ("ForSequenceClassification", "ForImageClassification")
_PER_TOKEN = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers logs only errors inside (its notes on a config are not the plan's)."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def read_config(path: Path) -> Any:
    """The transformers config in ``path``; a bad file or an unknown ``model_type`` raises one
    short line (with close matches)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

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
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else "see transformers"
        raise InvalidOptionError(
            f"{str(path)!r}: model_type {model_type!r} is not one transformers knows; {hint}"
        )
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, TypeError) as error:
        first = str(error).strip().splitlines()[0][:200]
        raise InvalidOptionError(f"{str(path)!r}: {first}") from None


def check_seq(config: Any, seq: int | None) -> None:
    """Refuse a sequence longer than the config's positions (naming the limit)."""
    if seq is None or is_vision(config):
        return
    for name in _POSITIONS:
        limit = getattr(config, name, None)
        if isinstance(limit, int) and limit > 0:
            if seq > limit:
                raise InvalidOptionError(
                    f"--seq {seq} is longer than this model's positions: its config says "
                    f"{name}={limit}; expected --seq {limit} or less."
                )
            return


def is_vision(config: Any) -> bool:
    return hasattr(config, "image_size") and hasattr(config, "num_channels")


def meta_model(config: Any, *, checkpointing: bool = False) -> nn.Module:
    """The config's model on the ``meta`` device, in train mode (a fine-tune), with gradient
    checkpointing (non-reentrant) if asked."""
    import torch
    import transformers

    names = getattr(config, "architectures", None) or []
    with torch.device("meta"):
        model = next(
            (
                getattr(transformers, name)(config)
                for name in names
                if isinstance(getattr(transformers, name, None), type)
            ),
            None,
        )
        if model is None:
            model = _auto_model(transformers, config)
    if checkpointing:  # transformers 5 renamed it; 4.x has the old name only
        enable: Any = getattr(model, "activation_checkpointing_enable", None)
        enable = enable or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    return model.train()  # type: ignore[no-any-return]


def _auto_model(transformers: Any, config: Any) -> nn.Module:
    if getattr(config, "is_encoder_decoder", False):
        kinds = ["AutoModelForSeq2SeqLM"]
    elif is_vision(config):
        kinds = ["AutoModelForImageClassification"]
    else:
        kinds = ["AutoModelForCausalLM", "AutoModelForMaskedLM"]
    for kind in kinds:
        try:
            return getattr(transformers, kind).from_config(config)  # type: ignore[no-any-return]
        except ValueError:
            continue
    return transformers.AutoModel.from_config(config)  # type: ignore[no-any-return]


def example_inputs(model: nn.Module, config: Any, batch: int, seq: int | None) -> dict[str, Any]:
    """``meta`` inputs for one step: token ids (or pixels from the config's image size) and
    labels where the model computes its loss from them."""
    import torch

    if is_vision(config):
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        shape = (batch, config.num_channels, size, size)
        inputs: dict[str, Any] = {"pixel_values": torch.empty(shape, device="meta")}
    else:
        if seq is None:
            raise InvalidOptionError(
                f"a {type(model).__name__} reads tokens: expected --seq S, the sequence length."
            )
        inputs = {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device="meta")}
        if getattr(config, "is_encoder_decoder", False):  # a target as long as the source
            inputs["decoder_input_ids"] = inputs["input_ids"]
    name = type(model).__name__
    if name.endswith(_PER_EXAMPLE):
        inputs["labels"] = torch.zeros(batch, dtype=torch.long, device="meta")
    elif name.endswith(_PER_TOKEN) and "input_ids" in inputs:
        inputs["labels"] = inputs["input_ids"]  # the loss is part of the step
    return inputs


def default_blocks(model: nn.Module) -> list[str] | None:
    """An encoder-decoder's blocks: the encoder's, then the decoder's, in the order they run
    (the last k of them learn at depth k); ``None`` for one stack (found as usual)."""
    get_encoder = getattr(model, "get_encoder", None)
    get_decoder = getattr(model, "get_decoder", None)
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    if not (callable(get_encoder) and callable(get_decoder)):
        return None
    names = {id(module): name for name, module in model.named_modules()}
    found = []
    for stack in (get_encoder(), get_decoder()):
        found += [f"{names[id(stack)]}.{block}" for block in find_blocks(stack)]
    return found


def embedding_names(model: nn.Module) -> list[str]:
    """The input embedding's module name (what ``--learn-embeddings`` adds to each row)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    return [name for name, module in model.named_modules() if module is embedding][:1]


def head_names(model: nn.Module) -> list[str]:
    """The output embedding's module name (the LM head ``--badam`` freezes), if there is one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return []
    return [name for name, module in model.named_modules() if module is head][:1]
