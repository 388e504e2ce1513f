"""What a cut's prefix is: the cut's position in a gate's plan, the modules that run before it
(their weights are what the entries depend on), what is known about each cut, and the parts of
a prefix that make its output random or batch-dependent (dropout, BatchNorm in train mode)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..block_calls import modules_within
from .rows import Template

_DROPOUT = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
_BATCH_NORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_RANDOM_WORDS = ("dropout", "drop_prob", "drop_path", "layerdrop")


def cut_of(gate: Any) -> int | None:
    """Where the cached input is taken: the position of the first block that learns (or holds a
    learning module) in the gate's plan, ``n`` when only what runs after the blocks learns
    (then the last block's output is cached); ``None`` when nothing can be skipped: no plan, no
    block before the cut, or a learning module outside the blocks that runs before the cut."""
    if not gate.active or gate._learn is None:
        return None
    n = len(gate._points)
    cut = min([gate._first_opener(), *(p for p in gate._extra_blocks if p not in gate._skip)])
    for index in gate._extra_outside:
        after = gate._stacks.first_block_after(index)
        if after < cut or (after == cut and cut < n):
            return None
    return cut or None


@dataclass
class CutState:
    """What a cache knows about one cut position."""

    position: int
    modules: list[nn.Module] | None = None  # every module whose tensors the prefix reads
    tensors: list[torch.Tensor] | None = None  # theirs, walked again after a registration
    walked: int = -1  # the cache's registration count when they were walked
    names: list[str] | None = None  # the prefix modules by name (whole) and roots (own tensors)
    fingerprint: tuple[int, ...] | None = None  # weights_state when the entries were stored
    leaves: list[int] | None = None  # which tensors of the cut point's values are cached
    spec: str | None = None  # the cut point's call, as a structure (args and keywords)
    templates: dict[int, Template] = field(default_factory=dict)  # stand-ins for blocks
    flops: float | None = None  # forward FLOPs of the prefix's blocks per sample
    uncacheable: str | None = None  # why this cut is never served
    checked: bool = False  # a batch with hits was checked here
    probed: bool = False  # a miss looked at what the prefix's outputs reach
    sub_batches: bool | None = None  # the blocks before the cut compute a sample alike in any
    # batch (measured at the first batch of hits and misses): such batches run the misses only


def prefix_modules(
    gate: Any, positions: set[int], outside: set[int]
) -> tuple[list[nn.Module], list[str]]:
    """The modules whose tensors a prefix reads: the blocks at ``positions`` and the modules
    around the blocks at ``outside`` (gate._stacks.outside indices) with everything inside
    them, and the model and the containers of the blocks (their own tensors only: they may use
    them anywhere). Also their names, to find them again in a later run."""
    model = gate._model
    names = {id(m): name for name, m in model.named_modules()}
    whole = [gate._points[p][1] for p in sorted(positions)]
    whole += [gate._stacks.outside[i] for i in sorted(outside)]
    roots = [model, *(model.get_submodule(name) for name in sorted(gate._containers))]
    modules = [m for module in whole for m in modules_within(module)] + roots
    listed = [names[id(m)] for m in whole] + ["." + names[id(m)] for m in roots]
    return _unique(modules), listed


def modules_named(model: nn.Module, listed: list[str]) -> list[nn.Module] | None:
    """The modules :func:`prefix_modules` named (``None`` if one is missing)."""
    found = []
    for name in listed:
        try:
            module = model.get_submodule(name.removeprefix("."))
        except AttributeError:
            return None
        found += [module] if name.startswith(".") else modules_within(module)
    return _unique(found)


def _unique(modules: list[nn.Module]) -> list[nn.Module]:
    return list({id(m): m for m in modules}.values())


def named_tensors(model: nn.Module, listed: list[str]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of the named prefix modules, by qualified name (for the content hash)."""
    found: dict[str, torch.Tensor] = {}
    for name in listed:
        module = model.get_submodule(name.removeprefix("."))
        base = name.removeprefix(".")
        recurse = not name.startswith(".")
        for kind in (module.named_parameters, module.named_buffers):
            for sub, tensor in kind(prefix=base, recurse=recurse):
                found.setdefault(sub, tensor)
    return sorted(found.items())


def watch_registrations(ids: set[int], callback: Callable[[], object]) -> list[Any]:
    """Have ``callback()`` run when a parameter, buffer or module is assigned to a module whose
    id is in ``ids`` (kept up to date by the caller); returns the global hooks' handles. The
    callback (a bound method) is held weakly."""
    from torch.nn.modules import module as torch_module

    method = weakref.WeakMethod(callback)  # type: ignore[arg-type]

    def registered(module: nn.Module, name: str, value: object) -> None:
        if id(module) in ids:
            alive = method()
            if alive is not None:
                alive()
        # None: torch assigns the value as given

    handles = []
    for kind in ("parameter", "buffer", "module"):
        register = getattr(torch_module, f"register_module_{kind}_registration_hook", None)
        if register is not None:
            handles.append(register(registered))
    return handles


def random_parts(modules: list[nn.Module], names: dict[int, str], mode: str) -> list[str]:
    """The parts of a prefix whose output is random or depends on the batch: dropout with
    ``p > 0`` and BatchNorm, in train mode (``mode``: the gate's ``prefix_mode``: ``'eval'``
    runs the prefix in eval mode, ``'train'`` in train mode), and modules with a dropout-like
    rate above 0 (attention dropout, drop path, LayerDrop)."""
    if mode == "eval":
        return []
    found = []
    for module in modules:
        if not (module.training or mode == "train"):
            continue
        name = names.get(id(module), type(module).__name__) or "(the model)"
        if isinstance(module, _DROPOUT) and module.p > 0:
            found.append(f"{name} ({type(module).__name__}, p={module.p})")
        elif isinstance(module, _BATCH_NORM):
            found.append(f"{name} ({type(module).__name__} in train mode)")
        else:
            for attribute, value in vars(module).items():
                if (
                    isinstance(value, float)
                    and value > 0
                    and any(word in attribute for word in _RANDOM_WORDS)
                ):
                    found.append(f"{name} ({attribute}={value})")
                    break
    return found


def random_message(found: list[str], position: int, blocks: list[str]) -> str:
    listed = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    where = blocks[position] if position < len(blocks) else "the end of the blocks"
    return (
        f"the prefix before the cut at {where!r} is random or depends on the batch in train "
        f"mode: {listed}. A cached entry keeps one draw (or one batch's statistics), so hits "
        "would differ from running the prefix: the cache is exact only for a deterministic "
        "prefix. Put the frozen part in eval mode (backbone.eval(), or "
        "gg.BackpropGate(..., prefix_mode='eval')); check= then finds any difference left."
    )
