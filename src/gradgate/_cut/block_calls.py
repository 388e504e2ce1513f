"""What happens to one block call: frozen for the call, skipped (DropBP), checked."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction

from .._plumbing.autograd import leaf_variable, tensors_in, walk
from .._plumbing.errors import (
    BlockCallError,
    BlockCallWarning,
    CheckpointAfterCutWarning,
    SharedParameterWarning,
    warn,
)
from .._plumbing.frames_compile import runs_compiled
from .._plumbing.torch_internals import DISTRIBUTED_WORLD, maybe_in_backward


def require_a_forward(model: nn.Module) -> None:
    if isinstance(model, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)):
        raise BlockCallError(
            f"a {type(model).__name__} has no forward of its own, so a gate on it would never "
            "run. Gate the model that calls it, e.g. gg.BackpropGate(model) or "
            "gg.BackpropGate(model, blocks='transformer.h.*')."
        )
    forward = inspect.unwrap(model.forward)
    if inspect.isgeneratorfunction(forward) or inspect.isasyncgenfunction(forward):
        raise BlockCallError(
            f"{type(model).__name__}.forward is a generator: its blocks run after forward has "
            "returned, while it is being iterated, where no gate can follow them. Return the "
            "outputs (a list or tuple) instead of yielding them, or gate a module whose forward "
            "returns."
        )


def distributed_running() -> bool:
    if _WORLD is not None:
        return _WORLD._default_pg is not None
    return _PROCESS_GROUP_STARTED is not None and _PROCESS_GROUP_STARTED()


# read at every forward: torch.distributed is available or not for the whole process
_PROCESS_GROUP_STARTED = (
    torch.distributed.is_initialized if torch.distributed.is_available() else None
)
_WORLD = (
    DISTRIBUTED_WORLD
    if _PROCESS_GROUP_STARTED is not None and hasattr(DISTRIBUTED_WORLD, "_default_pg")
    else None
)


def has_graph(output: Any) -> bool:
    tensors = tensors_in(output)
    return not tensors or any(t.requires_grad for t in tensors)


def freeze_for_call(module: nn.Module, keep: frozenset[int] = frozenset()) -> list[nn.Parameter]:
    """Freeze a module's trainable parameters for one call, all but those whose id is in keep."""
    return freeze_in(modules_within(module), keep)


def modules_within(module: nn.Module, around: frozenset[int] = frozenset()) -> list[nn.Module]:
    """A module and its submodules, each once, but those whose id is in ``around`` (and what is
    inside them).

    It runs in forwards, so it walks the module dictionaries itself: ``modules()`` costs several
    times as much (a generator per level, names built and dropped).
    """
    modules, seen = [module], {id(module)}
    for current in modules:  # grows while it is walked
        for child in current._modules.values():
            if child is None or id(child) in around or id(child) in seen:
                continue
            seen.add(id(child))
            modules.append(child)
    return modules


def freeze_in(modules: list[nn.Module], keep: frozenset[int]) -> list[nn.Parameter]:
    """Freeze the trainable parameters of ``modules`` (their own, not their submodules'), all
    but those whose id is in ``keep``; returns them, to be given back."""
    frozen: list[nn.Parameter] = []
    for module in modules:
        for param in module._parameters.values():
            if param is not None and param.requires_grad and id(param) not in keep:
                param.requires_grad_(False)
                frozen.append(param)
    return frozen


def pass_around(name: str, args: Any, kwargs: Any, output: Any) -> Any:
    """DropBP: the block's value, with the gradient of its input passed through unchanged."""
    inputs = tensors_in((args, kwargs))
    if not inputs:
        raise BlockCallError(f"skipped block {name!r} got no tensor input to pass around.")
    x = inputs[0]
    outputs = tensors_in(output)
    if not outputs or outputs[0].shape != x.shape:
        shape = tuple(outputs[0].shape) if outputs else None
        raise BlockCallError(
            f"block {name!r} cannot be skipped: its output shape {shape} differs from its "
            f"input shape {tuple(x.shape)}, so there is no residual path for the gradient. "
            "Skip only residual blocks (output = input + f(input))."
        )
    if not x.requires_grad:
        return output
    through = outputs[0].detach() + (x - x.detach())  # value of the block, gradient of identity
    return _replace_first_tensor(output, through)


class ResidualPaths:
    """Skipped blocks whose residual path was seen in their own graph: each is checked once,
    at its first skipped call whose input carries a graph (that call keeps its graph). A block
    that runs compiled is not checked: its graph is one opaque node, and a first call in a
    state of its own would compile a graph of its own, its later calls another, after any
    warm-up over the same plans."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def trace(self, position: int, args: Any, module: nn.Module) -> bool:
        """Whether this skipped call keeps its graph for the check."""
        if position in self.seen or runs_compiled(module):
            return False
        inputs = tensors_in(args)
        return bool(inputs) and inputs[0].requires_grad

    def check(
        self, traced: bool, position: int, name: str, args: Any, kwargs: Any, output: Any
    ) -> Any:
        """The output, with no graph once checked; raises when there is no residual path."""
        if not traced:
            return output
        output = require_residual_path(name, args, kwargs, output)
        self.seen.add(position)
        return output


def require_residual_path(name: str, args: Any, kwargs: Any, output: Any) -> Any:
    """Raise unless the block's own graph has a path of additions and views from its output
    back to its input (the residual a skipped block's gradient passes through); returns the
    output with no graph. Opaque nodes (compiled, reentrant checkpoint, custom functions) are
    taken on trust."""
    inputs, outputs = tensors_in((args, kwargs)), tensors_in(output)
    if not inputs or not outputs or outputs[0] is inputs[0]:
        return _detached(output)
    x, out = inputs[0], outputs[0]
    if out.shape != x.shape:
        return _detached(output)  # pass_around refuses it, naming the shapes
    if not x.requires_grad:  # a later pre-hook ran the block on a copy with no graph (ZeRO-3)
        return _detached(output)
    found: list[str] = []

    def follow(node: Any) -> bool:
        if node is x.grad_fn or leaf_variable(node) is x:
            found.append("input")
            return False
        kind = type(node).__name__.rstrip("0123456789").removesuffix("Backward")
        if isinstance(node, BackwardCFunction) or "Compiled" in kind or "Checkpoint" in kind:
            found.append("opaque")
            return False
        return kind in _RESIDUAL_STEPS

    if out.grad_fn is not None:
        for _ in walk([out.grad_fn], enter=follow):
            if found:
                break
    if not found:
        raise BlockCallError(
            f"block {name!r} cannot be skipped: its output has no residual path back to its "
            f"input (only additions and views: output = input + f(input)), so passing the "
            "gradient around it as the identity would give earlier blocks a gradient of "
            "nothing. Skip only residual blocks; expected a block such as a transformer layer."
        )
    return _detached(output)


_RESIDUAL_STEPS = frozenset(
    {
        *("Add", "Sub", "View", "UnsafeView", "Reshape", "ReshapeAlias", "Expand", "Clone"),
        *("ToCopy", "Alias", "Transpose", "T", "Permute", "Squeeze", "Unsqueeze"),
        *("SqueezeDim", "UnsqueezeDim"),
    }
)


def _detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, (tuple, list)) and type(output) in (tuple, list):
        return type(output)(_detached(item) for item in output)
    if isinstance(output, dict) and type(output) is dict:
        return {key: _detached(value) for key, value in output.items()}
    return output


def _replace_first_tensor(output: Any, tensor: torch.Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return tensor
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (
            type(output)((tensor, *output[1:]))
            if type(output) is tuple
            else (output.__class__(tensor, *output[1:]))
        )
    if isinstance(output, list) and output and isinstance(output[0], torch.Tensor):
        return [tensor, *output[1:]]
    raise BlockCallError(
        f"a skipped block returned {type(output).__name__}; expected a tensor or a tuple whose "
        "first element is the hidden state."
    )


def blocks_sharing_parameters(points: list[tuple[str, nn.Module]]) -> list[bool]:
    """For each block, whether one of its parameters also belongs to another block."""
    owners: dict[int, set[int]] = {}
    for position, (_, block) in enumerate(points):
        for param in block.parameters():
            owners.setdefault(id(param), set()).add(position)
    return [any(len(owners[id(p)]) > 1 for p in block.parameters()) for _, block in points]


def shared_parameter_owners(model: nn.Module) -> list[tuple[nn.Parameter, list[nn.Module]]]:
    """Parameters owned by two or more different modules (tied weights), with their owners."""
    owners: dict[int, tuple[nn.Parameter, list[nn.Module]]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            entry = owners.setdefault(id(param), (param, []))
            if all(module is not m for m in entry[1]):
                entry[1].append(module)
    return [(param, mods) for param, mods in owners.values() if len(mods) > 1]


def check_block_output_learns(name: str, block: nn.Module, output: Any) -> bool:
    """Warn (and say so) when a learning block has trainable parameters but no output graph."""
    tensors = tensors_in(output)
    if not torch.is_grad_enabled() or not tensors or any(t.requires_grad for t in tensors):
        return False
    if any(p.requires_grad for p in block.parameters()):
        warn(
            f"the learning block {name!r} has trainable parameters but its output does not "
            "require grad, so they will get no gradient. The usual cause is reentrant "
            "activation checkpointing inside the block: its input comes from the cut and does "
            "not require grad. Fix: torch.utils.checkpoint.checkpoint(..., use_reentrant=False).",
            CheckpointAfterCutWarning,
        )
        return True
    return False


NOTHING_LEARNS = (
    "nothing that runs after the cut has trainable parameters (nothing runs after the last "
    "block, or all of it has requires_grad=False, e.g. a frozen head with adapters only in "
    "cut-off blocks), so the output has no graph and backward would fail. Choose a larger "
    "depth, or unfreeze a module after the cut."
)


def warn_learners_not_run(gate: Any, frame: Any, never_opened: bool) -> bool:
    """When nothing learned: name the learning blocks that did not run and the trainable
    learning modules (they ran with no graph, or not at all), else the generic warning."""
    names = {id(m): n for n, m in gate._model.named_modules()}
    missing = [
        name
        for position, (name, _) in enumerate(gate._points)
        if gate._learns(position) and position not in gate._skip and position not in frame.ran
    ] + [names.get(id(m), "?") for m in gate._extra if any(p.requires_grad for p in m.parameters())]
    if missing:
        listed = ", ".join(repr(n) for n in missing)
        warn(
            f"nothing learns in this forward: the learning module(s) {listed} never ran. They "
            f"are registered in {type(gate._model).__name__} but its forward did not call them "
            "(or LayerDrop skipped them this step), so the output has no graph. Plan over "
            "modules the forward calls (gg.blocks(model) lists the blocks), or call them.",
            BlockCallWarning,
        )
        return True
    if never_opened:
        warn_never_opened()
    return False


def outside_call(name: str, model: nn.Module) -> str:
    """What to say when a planned block ran outside its gated model's call (unless autograd is
    recomputing it for activation checkpointing, during backward)."""
    if maybe_in_backward():
        return ""
    return (
        f"block {name!r} ran outside a call of the gated {type(model).__name__}, so the plan "
        "(depth, learn, skip) does not apply to it: it learns fully. Call the gated model itself, "
        "or gate the module you call."
    )


def warn_never_opened() -> None:
    warn(
        "the cut never opened in this forward, so nothing in it learns: no learning block ran "
        "(LayerDrop skipped every block of the stack, or the plan names blocks that did not "
        "run), and no module ran that earlier forwards of this gate saw run after the stack "
        "(gradgate learns that from a forward in which the stack ran). Lower the layerdrop "
        "probability, run one forward in eval mode first, or choose a plan with a block that "
        "always runs.",
        BlockCallWarning,
    )


def warn_shared_straddles(
    model: nn.Module, shared_uses: dict[int, dict[bool, nn.Module]], warned: set[str]
) -> None:
    """Once per gate: a tied parameter was used before the cut and after it in one forward."""
    straddling = [uses for uses in shared_uses.values() if len(uses) == 2]
    if not straddling:
        return
    warned.add("shared")
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    before, after = (names.get(id(straddling[0][k]), "?") for k in (False, True))
    warn(
        f"a parameter shared by {before!r} and {after!r} is used before the cut and again after "
        f"it: only the use after the cut (by {after!r}) gets a gradient, so its .grad differs "
        "from full backprop. Untie the weights, or accept the partial gradient (the usual "
        "choice for tied embeddings).",
        SharedParameterWarning,
    )


def describe_plan(learn: Any, skip: frozenset[int], extra: tuple[nn.Module, ...] = ()) -> str:
    """A plan as a user sets it: ``depth=2``, ``learn={1, 3}``, ``skip={2}``, ``depth=None``.

    >>> describe_plan(range(2, 4), frozenset({0})), describe_plan(None, frozenset())
    ('depth=2 skip={0}', 'depth=None')
    """
    if isinstance(learn, range):
        plan = f"depth={len(learn)}"
    elif learn is None and not extra:
        plan = "" if skip else "depth=None"
    else:
        named = ["..."] if extra else []
        plan = "learn={" + ", ".join([*map(str, sorted(learn or ())), *named]) + "}"
    skipped = "skip={" + ", ".join(map(str, sorted(skip))) + "}" if skip else ""
    return " ".join(part for part in (plan, skipped) if part)


def plan_changed_message(gate: Any, learn: Any, skip: frozenset[int], extra: Any) -> str:
    old = describe_plan(learn, skip, extra)
    new = describe_plan(gate._learn, gate._skip, gate._extra)
    model = type(gate._model).__name__
    return (
        f"the plan of the gate on {model} changed after a forward (from {old} to {new}) and "
        "before its backward, with no forward in between: this backward follows the plan "
        f"that forward ran under ({old}), so {new} does nothing for it. Set the plan before "
        "the forward: gate.depth = k, then loss = loss_fn(model(x)), then loss.backward(). "
        "(Micro-batches with a plan each are fine: each forward follows the plan set before it.)"
    )


def unused_context_message(gate: Any) -> str:
    model = type(gate._model).__name__
    if type(gate).__name__ == "StopGradient":
        call = f"gg.stop_gradient_at(model, {gate._points[0][0]!r})"
    else:
        call = f"gg.backprop_depth(model, {describe_plan(gate._learn, gate._skip)})"
    return (
        f"`with {call}` on a {model} exited, and no forward of {model} ran inside it: a plan "
        "acts on the forwards run inside the `with` block, where the graph is recorded, not on "
        "a backward (the forward before the block recorded its graph with no cut). Run the "
        f"forward inside it: `with {call}: loss = loss_fn(model(x), y)`, then "
        "`loss.backward()`."
    )


def input_graph_message(model: nn.Module, learn: Any) -> str:
    """What to say when a gated module's input carries a graph: point to the module that
    runs it (the outermost one on the call stack), the model to gate instead."""
    outer, name = _caller_holding(model)
    kind = type(model).__name__
    plan = f"depth={len(learn)}" if isinstance(learn, range) else "depth=..."
    where = (
        f"{name!r} of {type(outer).__name__} runs after modules that recorded one"
        if outer is not None
        else "the code that calls it ran with grad before it"
    )
    model_is = f"the {type(outer).__name__}" if outer is not None else "the model that runs both"
    return (
        f"the gated {kind}'s input already carries a graph ({where}), so no cut inside {kind} "
        "can stop what ran before it: that learns fully, whatever the plan. Gate the model "
        f"that contains it instead, gg.BackpropGate(model, {plan}) with model {model_is} "
        "(gg.blocks(model) lists the blocks a depth counts), or run what comes before it "
        "under torch.no_grad() if nothing there should learn."
    )


def _caller_holding(model: nn.Module) -> tuple[nn.Module | None, str]:
    """The outermost module on the call stack that holds ``model``, and its name there."""
    found: tuple[nn.Module | None, str] = (None, "")
    frame = sys._getframe(1)
    while frame is not None:
        caller = frame.f_locals.get("self")
        if isinstance(caller, nn.Module) and caller is not model:
            name = next((n for n, m in caller.named_modules() if m is model), None)
            if name is not None:
                found = (caller, name)
        frame = frame.f_back  # type: ignore[assignment]
    return found
