"""What learns in the rows of ``gradgate plan``: ``--learn`` sets read and checked, and
``--freeze`` patterns, against the model (their errors in flags); the learners of a planned
row in words (``model.layers.29-31, model.norm and lm_head``)."""

from __future__ import annotations

import difflib
from argparse import ArgumentTypeError
from collections.abc import Sequence

from torch import nn

from .._plumbing.errors import InvalidDepthError, UnknownModuleError
from .._select.names import select

_SHOWN = 8  # modules named in a row's learners before "and N more"


def learn_text(text: str) -> tuple[str, list[int | str]]:
    """``0,1`` / ``2-5`` / ``model.embed_tokens`` / ``model.layers.*.mlp``: positions,
    inclusive ranges and module names, with the text as typed (for messages)."""
    items: list[int | str] = []
    for part in (part.strip() for part in text.split(",")):
        first, dash, last = part.partition("-")
        if part.isdigit():
            items.append(int(part))
        elif dash and first.isdigit() and last.isdigit():
            items += range(int(first), int(last) + 1)
        elif part:
            items.append(part)
        else:
            raise ArgumentTypeError(
                f"{text!r} has an empty item; expected block positions, ranges and module "
                "names separated by commas, e.g. --learn 0,1 or --learn 2-5,model.norm"
            )
    return text, items


def freeze_patterns(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Freeze (``requires_grad=False``) the modules ``patterns`` match, for every row; their
    names. ``model`` is the command's own meta model."""
    names: list[str] = []
    for pattern in patterns:
        for name in _matched(model, pattern, "--freeze"):
            if name not in names:
                names.append(name)
                model.get_submodule(name).requires_grad_(False)
    return names


def learn_sets(
    model: nn.Module,
    blocks: Sequence[str],
    learn: Sequence[tuple[str, list[int | str]]],
    badam: bool,
) -> list[frozenset[int | str]]:
    """The ``--learn`` sets, checked (positions in range, names that match a module); with
    ``--badam`` and no ``--learn``, block 0 alone: the deepest backward of BAdam's cycle."""
    if badam and not learn:
        return [frozenset({0})] if blocks else []
    sets = []
    for text, items in learn:
        for item in items:
            if isinstance(item, int) and not 0 <= item < len(blocks):
                raise InvalidDepthError(
                    f"--learn {text}: block {item} is out of range: the model has "
                    f"{len(blocks)} blocks; expected positions 0..{len(blocks) - 1} (or module "
                    "names), e.g. --learn 0 or --learn 0,1."
                )
            if isinstance(item, str):
                _matched(model, item, f"--learn {text}:")
        sets.append(frozenset(items))
    return sets


def _matched(model: nn.Module, pattern: str, flag: str) -> list[str]:
    try:
        return select(model, pattern)
    except UnknownModuleError:
        names = [name for name, _ in model.named_modules() if name]
        close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.75)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        raise UnknownModuleError(
            f"{flag} {pattern!r} matches no module of {type(model).__name__}; {hint}expected a "
            "module name (or a dotted suffix of one) or a glob such as 'model.layers.*.mlp'."
        ) from None


def learning_text(learners: Sequence[str], trainable: Sequence[str], blocks: Sequence[str]) -> str:
    """``learners`` (parameter names) in words: blocks whose trainable parameters all learn
    as ranges of positions (``model.layers.29-31``), other modules by name, in model order.

    >>> learning_text(["emb.w", "h.2.w", "h.3.w", "h.3.b", "ln.w", "head.w"],
    ...               ["emb.w", "h.0.w", "h.1.w", "h.2.w", "h.3.w", "h.3.b", "ln.w", "head.w"],
    ...               ["h.0", "h.1", "h.2", "h.3"])
    'emb, h.2-3, ln and head'
    >>> learning_text(["h.1.up.w"], ["h.0.up.w", "h.1.up.w", "h.1.down.w"], ["h.0", "h.1"])
    'h.1.up'
    """
    prefixes = [f"{block}." for block in blocks]
    order = {name: index for index, name in enumerate(trainable)}
    whole: list[int] = []
    for index, prefix in enumerate(prefixes):
        inside = [name for name in trainable if name.startswith(prefix)]
        if inside and all(name in learners for name in inside):
            whole.append(index)
    covered = tuple(prefixes[index] for index in whole)
    found: dict[str, int] = {}  # a part in words -> where it starts, in model order
    for run in _runs(whole, blocks):
        found[run[0]] = min(order.get(n, 0) for n in trainable if n.startswith(run[1]))
    for name in learners:
        module = name.rpartition(".")[0] or name
        if not (covered and name.startswith(covered)) and module not in found:
            found[module] = order.get(name, len(order))
    parts = sorted(found, key=found.__getitem__)
    if not parts:
        return "nothing"
    if len(parts) > _SHOWN:
        parts = [*parts[: _SHOWN - 1], f"{len(parts) - _SHOWN + 1} more modules"]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _runs(positions: list[int], blocks: Sequence[str]) -> list[tuple[str, str]]:
    """Consecutive blocks ``prefix.i`` .. ``prefix.j`` as ``prefix.i-j``, each with the prefix
    of its first block's parameters."""
    runs: list[list[int]] = []
    for index in positions:
        if runs and index == runs[-1][-1] + 1 and _next(blocks[runs[-1][-1]], blocks[index]):
            runs[-1].append(index)
        else:
            runs.append([index])
    shown = []
    for run in runs:
        first, last = blocks[run[0]], blocks[run[-1]]
        text = first if len(run) == 1 else f"{first}-{last.rpartition('.')[2]}"
        shown.append((text, f"{first}."))
    return shown


def _next(before: str, after: str) -> bool:
    """``after`` is ``before``'s numbered neighbour under the same parent (``h.3``, ``h.4``)."""
    parent, _, number = before.rpartition(".")
    other_parent, _, other = after.rpartition(".")
    return parent == other_parent and number.isdigit() and other.isdigit()
