"""Which modules? Names, globs, index ranges, and discovery of the main block sequence.

Nothing here changes a model.
"""

from __future__ import annotations

import difflib
import fnmatch
import operator
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .._plumbing.errors import AmbiguousNameError, InvalidOptionError, UnknownModuleError
from .blocks import find_blocks

Pattern = str | int | slice
_RANGE = re.compile(r"^\[?(-?\d*):(-?\d*)\]?$")
_GLOB_CHARS = set("*?[")
_ROOT_BLOCK = " matches the model itself, not a block inside it; expected e.g. blocks='*'."


def blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's main repeated block sequence, in order.

    The sequence is an ``nn.ModuleList`` / ``nn.Sequential`` (its members with parameters; in
    a flat one of single layers, the layers of its most frequent class, never norm layers), or
    a run of consecutive same-class composite children (CNN stages), holding the most
    parameters. Two or more comparable stacks that do not contain each other (encoder and
    decoder, two towers) raise :class:`AmbiguousBlocksError` with a ``blocks=`` line to paste;
    a module that looks like one block of a bigger model raises :class:`NoBlocksError`.

    >>> import gradgate as gg
    >>> from torch import nn
    >>> gg.blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)))
    ['0', '2']
    >>> gg.blocks(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.Linear(4, 1)))
    ['0', '2', '3']
    """
    check_module(model)
    return find_blocks(model)


def check_module(model: object) -> None:
    """Raise unless ``model`` is an ``nn.Module`` whose parameters and buffers have shapes."""
    if not isinstance(model, nn.Module):
        raise UnknownModuleError(
            f"expected a torch.nn.Module, got {type(model).__name__} ({model!r:.60}). Pass the "
            "model itself (for a DDP or compiled model, the wrapper or its .module both work)."
        )
    lazy = _first_lazy(model)
    if lazy is not None:
        name, module = lazy
        raise UnknownModuleError(
            f"{type(model).__name__} is not initialized yet: {name!r} ({type(module).__name__})"
            " is a lazy parameter whose shape its first forward decides, and gradgate needs "
            "the shapes to find blocks, freeze and plan. Expected an initialized model: run one "
            "forward first (model(example_input)), then make this call."
        )


def _first_lazy(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(qualified name, module) of the first uninitialized (lazy) parameter or buffer."""
    for prefix, module in model.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in tensors:
            if nn.parameter.is_lazy(tensor):
                return (f"{prefix}.{name}" if prefix else name), module
    return None


def select(model: nn.Module, *patterns: Pattern) -> list[str]:
    """Module names matched by exact names, globs or index ranges, in model order.

    * ``"encoder.layer.3"`` — an exact name, also as a dotted suffix of the full name
      (``"encoder.layer.3"`` finds ``"bert.encoder.layer.3"``);
    * ``"encoder.layer.*"`` — ``*`` matches within one name segment, ``**`` any number;
    * ``"h.0:4"`` / ``"h.-2:"`` — a range over the numbered children of a container;
    * ``3`` / ``slice(-2, None)`` — positions in :func:`blocks`.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(5)])
    >>> gg.select(net, "1:3", -1)
    ['1', '2', '4']
    """
    check_module(model)
    patterns = check_patterns("select", patterns, model=model)
    return [name for name, _ in resolve_modules(model, patterns)]


def resolve_modules(model: nn.Module, patterns: Iterable[Pattern]) -> list[tuple[str, nn.Module]]:
    """(name, module) for every module matched by the patterns, unique, in model order."""
    wanted: set[str] = set()
    for pattern in patterns:
        wanted.update(_match(model, pattern, include_parameters=False))
    return [(name, module) for name, module in model.named_modules() if name in wanted]


def resolve_parameters(
    model: nn.Module, patterns: Iterable[Pattern]
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Parameter]]]:
    """Matched modules and every parameter under them or matched directly, unique, in order."""
    wanted: set[str] = set()
    for pattern in patterns:
        wanted.update(_match(model, pattern, include_parameters=True))
    modules = [(name, module) for name, module in model.named_modules() if name in wanted]
    prefixes = tuple(f"{name}." for name, _ in modules)
    chosen = [
        (name, param)
        for name, param in model.named_parameters()
        if name in wanted or "" in wanted or name.startswith(prefixes)
    ]
    return modules, chosen


def resolve_blocks(
    model: nn.Module, spec: Sequence[Pattern] | str | None
) -> list[tuple[str, nn.Module]]:
    """The block list to use: auto-discovered when ``spec`` is None, else the given patterns."""
    if spec is None:
        names = blocks(model)
        lookup = dict(model.named_modules())
        return [(name, lookup[name]) for name in names]
    spec = _pattern("blocks=", spec, allow_root=False)  # numpy / 0-d tensor positions
    if isinstance(spec, nn.Module) or not isinstance(spec, (str, int, slice, Sequence)):
        raise UnknownModuleError(
            f"blocks={spec!r:.80} ({type(spec).__name__}); expected block names, globs or "
            "positions, e.g. blocks='encoder.layer.*' or blocks=['h.0', 'h.1'], or None to find "
            "them with gg.blocks(model)."
        )
    if not isinstance(spec, (str, int, slice)) and len(spec) == 0:
        raise UnknownModuleError(
            f"blocks={spec!r} names no block; expected at least one block name, glob or "
            "position, e.g. blocks=['h.0', 'h.1'], or None to find them with gg.blocks(model)."
        )
    given = spec
    spec = check_patterns(
        "blocks=", (spec,) if isinstance(spec, (str, int, slice)) else tuple(spec), model=model
    )
    found: dict[int, tuple[str, nn.Module]] = {}
    for pattern in spec:
        for name, module in resolve_modules(model, [pattern]):
            if module is model:
                raise UnknownModuleError(f"blocks={spec!r:.80}: {pattern!r}{_ROOT_BLOCK}")
            if id(module) in found:  # it would count twice in depth and run its hooks twice
                raise InvalidOptionError(
                    f"blocks={given!r:.100} names the block {name!r} twice (directly, by a glob "
                    "or by position); expected each block once, in the order they run "
                    "(gg.blocks(model) lists the blocks it finds)."
                )
            found[id(module)] = (name, module)
    return list(found.values())


def find_module(model: nn.Module, name: str | int) -> tuple[str, nn.Module]:
    """Exactly one module for an exact name (or dotted suffix) or a block position; errors
    when ambiguous."""
    matches = resolve_modules(model, [name])
    if len(matches) > 1:
        listed = ", ".join(repr(found) for found, _ in matches[:6])
        raise AmbiguousNameError(
            f"{name!r} matches {len(matches)} modules of {type(model).__name__} ({listed}); "
            "expected exactly one. Give the full qualified name."
        )
    return matches[0]


def ancestors(name: str) -> list[str]:
    """Proper ancestors of a qualified module name, innermost first, ending with the root ``""``.

    >>> ancestors("encoder.layer.3")
    ['encoder.layer', 'encoder', '']
    """
    if not name:
        return []
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)] + [""]


def _match(model: nn.Module, pattern: Pattern, *, include_parameters: bool) -> list[str]:
    if isinstance(pattern, bool) or not isinstance(pattern, (str, int, slice)):
        raise UnknownModuleError(
            f"pattern {pattern!r} has type {type(pattern).__name__}; expected a module name, "
            "a glob such as 'layer.*', a range such as 'layer.0:4', a block index or a slice."
        )
    if not isinstance(pattern, str):
        return _match_block_positions(model, pattern)
    segments = pattern.split(".") if pattern else []
    try:
        from_root = _walk(model, "", segments, include_parameters)
        if from_root:
            return from_root
        anywhere: list[str] = []
        if segments:
            for name, module in model.named_modules():
                if name:
                    anywhere.extend(_walk(module, name, segments, include_parameters))
    except _RangeOutOfBounds as bad:
        owner, segment, n = bad.args
        where, full = (repr(owner), f"{owner}.") if owner else (type(model).__name__, "")
        raise UnknownModuleError(
            f"the range {pattern!r} does not fit: {where} has {n} numbered children (0..{n - 1}),"
            f" and {segment!r} reaches past them; expected bounds in -{n}..{n}, e.g. "
            f"'{full}0:{n}' for all of them or '{full}-2:' for the last two."
        ) from None
    if not anywhere:
        raise UnknownModuleError(_unknown_message(model, pattern, include_parameters))
    is_exact = not (_GLOB_CHARS & set(pattern)) and not any(_RANGE.match(s) for s in segments)
    if is_exact and len(set(anywhere)) > 1 and not include_parameters:
        listed = ", ".join(repr(found) for found in sorted(set(anywhere))[:6])
        raise AmbiguousNameError(
            f"{pattern!r} matches {len(set(anywhere))} modules of {type(model).__name__} "
            f"({listed}); expected exactly one. Give the full qualified name or a glob."
        )
    return anywhere


def _match_block_positions(model: nn.Module, pattern: int | slice) -> list[str]:
    names = find_blocks(model)
    if isinstance(pattern, slice):
        return names[pattern]
    if not -len(names) <= pattern < len(names):
        raise UnknownModuleError(
            f"block index {pattern} is out of range: {type(model).__name__} has "
            f"{len(names)} blocks; expected an index in {-len(names)}..{len(names) - 1} "
            "(gg.blocks(model) lists them)."
        )
    return [names[pattern]]


def _walk(
    module: nn.Module, prefix: str, segments: list[str], include_parameters: bool
) -> list[str]:
    if not segments:
        return [prefix]
    head, rest = segments[0], segments[1:]
    join = (lambda child: f"{prefix}.{child}") if prefix else (lambda child: child)
    found: list[str] = []
    if head == "**":
        found.extend(_walk(module, prefix, rest, include_parameters))
        for child_name, child in module.named_children():
            found.extend(_walk(child, join(child_name), segments, include_parameters))
        return found
    children = dict(module.named_children())
    range_match = _RANGE.match(head)
    if range_match and ":" in head:
        numbered = sorted((n for n in children if n.isdigit()), key=int)
        start, stop = (int(v) if v else None for v in range_match.groups())
        count = len(numbered)
        if count and any(b is not None and not -count <= b <= count for b in (start, stop)):
            raise _RangeOutOfBounds(prefix, head, count)
        names = numbered[start:stop]
    else:
        names = [n for n in children if fnmatch.fnmatchcase(n, head)]
    for child_name in names:
        found.extend(_walk(children[child_name], join(child_name), rest, include_parameters))
    if include_parameters and not rest:
        for param_name, _ in module.named_parameters(recurse=False):
            if fnmatch.fnmatchcase(param_name, head):
                found.append(join(param_name))
    return found


class _RangeOutOfBounds(Exception):
    """(owner, segment, count): a range whose bounds pass the owner's numbered children."""


def _unknown_message(model: nn.Module, pattern: str, include_parameters: bool) -> str:
    names = [name for name, _ in model.named_modules() if name]
    if include_parameters:
        names += [name for name, _ in model.named_parameters()]
    close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
    close += [n for n in names if n.endswith(pattern.split(".")[-1]) and n not in close][:3]
    hint = f" Did you mean {', '.join(repr(c) for c in close[:3])}?" if close else ""
    what = "module or parameter" if include_parameters else "module"
    return (
        f"{pattern!r} matches no {what} of {type(model).__name__}; expected a qualified name "
        f"(or a dotted suffix of one), a glob or a range.{hint} gg.select(model, '**') lists all."
    )


# -- pattern checks ------------------------------------------------------------------------
def check_patterns(
    function: str,
    patterns: tuple[Any, ...],
    *,
    model: Any = None,
    allow_root: bool = False,
    allow_none: bool = False,
) -> tuple[Any, ...]:
    """The patterns with integer-like block indices made ``int``; refuses ``''`` and, unless
    ``allow_none`` (an empty set of patterns means "nothing"), no pattern at all.

    ``allow_root`` lets ``''`` name the model itself (where a name is a key, as in capture).
    With ``model``, a slice over its blocks must stay within them (``slice(0, 0)`` is the
    empty set; ``slice(10, 20)`` on four blocks is refused).

    >>> check_patterns("freeze", ("encoder", __import__("numpy").int64(2)))
    ('encoder', 2)
    """
    if not patterns and not allow_none:
        raise InvalidOptionError(
            f"{function}() got no pattern; expected at least one module or parameter name, "
            f"glob or range, e.g. {function}(model, 'encoder.layer.0'). For every module of "
            f"the model pass '**': {function}(model, '**')."
        )
    checked = tuple(_pattern(function, pattern, allow_root) for pattern in patterns)
    positional = [p for p in checked if isinstance(p, (int, slice)) and not isinstance(p, bool)]
    if model is not None and positional:
        count = len(blocks(model))
        for pattern in positional:
            if isinstance(pattern, slice):
                check_block_slice(function, pattern, count)
            elif not -count <= pattern < count:
                raise UnknownModuleError(
                    f"{function}() got the block index {pattern}, but the model has {count} "
                    f"blocks; expected an index in -{count}..{count - 1}, e.g. -1 for the last "
                    "block (gg.blocks(model) lists them)."
                )
    return checked


def check_block_slice(function: str, pattern: slice, count: int) -> None:
    """Refuse a slice over ``count`` blocks whose bounds or step are not integers in range.

    >>> check_block_slice("freeze", slice(-2, None), 4)
    >>> check_block_slice("freeze", slice(2, 9), 4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gradgate.UnknownModuleError: freeze() got the block slice slice(2, 9, None), ...
    """
    bounds = (pattern.start, pattern.stop)
    step = pattern.step
    ints = all(b is None or (isinstance(b, int) and not isinstance(b, bool)) for b in bounds)
    good_step = step is None or (isinstance(step, int) and not isinstance(step, bool) and step)
    in_range = ints and all(b is None or -count <= b <= count for b in bounds)  # type: ignore[operator]
    if not (ints and good_step and in_range):
        raise UnknownModuleError(
            f"{function}() got the block slice {pattern!r}, which does not fit the model's "
            f"{count} blocks; expected integer bounds in -{count}..{count} and a non-zero "
            f"step, e.g. slice(-2, None) for the last two blocks (gg.blocks(model) lists them)."
        )


def _pattern(function: str, pattern: Any, allow_root: bool) -> Any:
    if isinstance(pattern, str):
        if not pattern.strip() and not (allow_root and pattern == ""):
            raise UnknownModuleError(
                f"{function}() got the pattern {pattern!r}, which names no module; expected a "
                "module or parameter name, a glob such as 'layer.*' or a range such as "
                f"'layer.0:4'. For every module of the model pass '**'."
            )
        return pattern
    if isinstance(pattern, (bool, slice)) or not hasattr(pattern, "__index__"):
        return pattern  # slices as given; other types are refused by the selection with a hint
    if isinstance(pattern, torch.Tensor) and (pattern.dim() or pattern.dtype == torch.bool):
        return pattern  # a bool tensor or a one-element vector is not a position
    try:
        return operator.index(pattern)  # numpy integers, 0-d integer tensors
    except TypeError:
        return pattern
