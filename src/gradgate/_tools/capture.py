"""What are the inner gradients? Gradients of the loss with respect to module outputs.

A forward hook registers a tensor hook on every output tensor that requires grad; the tensor
hook stores the gradient when the ordinary backward reaches it. No ``retain_graph``, no second
backward, nothing kept but the gradients asked for.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._plumbing.errors import (
    GradientNotReadyError,
    InvalidOptionError,
    NoTensorError,
    UnknownCaptureError,
)
from .._plumbing.handles import Handle
from .._plumbing.hook_set import HookSet
from .._plumbing.hooks import GateHook
from .._plumbing.tagging import runs_itself
from .._plumbing.torch_internals.trees import tree_flatten, tree_unflatten
from .._select.names import Pattern, check_module, check_patterns, resolve_modules


class _Call:
    """The gradients of one call of a module, laid out like its output (or input)."""

    def __init__(self, spec: Any, count: int) -> None:
        self.spec = spec
        self.slots: list[torch.Tensor | None] = [None] * count
        self.waiting = 0  # tensors of this call that require grad (a hook on each)
        self.arrived = 0

    def value(self) -> Any:
        return tree_unflatten(self.slots, self.spec)


class GradStore(Mapping[str, Any]):
    """Gradients by module name, filled by the ordinary backward.

    ``store[name]`` is the gradient of the module's *latest* call: always one value, shaped
    like what the module returned (a tensor, a tuple, a dict), with ``None`` for parts no
    gradient reached. ``store.calls(name)`` lists every call since the capture started (or
    since ``clear()``), in call order. A name may be the full module name or the pattern as it
    was given. Reading a module whose latest call has no gradient yet raises
    :class:`GradientNotReadyError` (a ``KeyError``, so ``store.get(name)`` gives ``None``);
    an unknown name raises :class:`UnknownCaptureError` (also a ``KeyError``) with close
    matches.
    """

    def __init__(self, names: list[str] | None = None, aliases: dict[str, str] | None = None):
        self._names = list(names or [])
        self._aliases = dict(aliases or {})
        self._calls: dict[str, list[_Call]] = {}

    def calls(self, name: str) -> list[Any]:
        """The gradients of every call of module ``name``, in forward (call) order."""
        return [call.value() for call in self._calls.get(self._resolve(name), [])]

    def __getitem__(self, name: str) -> Any:
        full = self._resolve(name)
        calls = self._calls.get(full)
        if not calls:
            raise GradientNotReadyError(
                f"module {full!r} has not run yet since the capture started (or since clear()), "
                "so there is no gradient to read; expected a forward and a backward first: "
                "run the model, then loss.backward(), then read it."
            )
        latest = calls[-1]
        if latest.arrived == 0:
            raise GradientNotReadyError(_not_ready_message(full, latest))
        return latest.value()

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return self._aliases.get(name, name) in self._calls

    def __iter__(self) -> Iterator[str]:
        return iter(self._calls)

    def __len__(self) -> int:
        return len(self._calls)

    def clear(self) -> None:
        """Forget every captured gradient (for instance between training steps)."""
        self._calls.clear()

    def _resolve(self, name: str) -> str:
        full = self._aliases.get(name, name) if isinstance(name, str) else name
        if full in self._names or full in self._calls:
            return full
        close = difflib.get_close_matches(str(name), self._names, n=3, cutoff=0.4)
        close += [n for n in self._names if isinstance(name, str) and n.endswith(f".{name}")]
        hint = f" Did you mean {', '.join(repr(c) for c in dict.fromkeys(close))}?" if close else ""
        raise UnknownCaptureError(
            f"{name!r} was not captured; expected one of the captured module names "
            f"{self._names[:6]!r}.{hint} To capture another module, add it to capture_grads."
        )

    def _record(self, name: str, value: Any) -> list[RemovableHandle]:
        leaves, spec = tree_flatten(value)
        if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise NoTensorError(
                f"module {name!r} produced {type(value).__name__}, which holds no tensor, so "
                "it has no gradient to capture; expected a tensor or a tuple/list/dict of "
                "tensors. Capture a module that returns tensors instead."
            )
        call = _Call(spec, len(leaves))
        self._calls.setdefault(name, []).append(call)
        handles = []
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                call.waiting += 1
                handles.append(leaf.register_hook(_store(call, index)))
        return handles

    def __repr__(self) -> str:
        counts = ", ".join(f"{name!r}: {len(calls)} call(s)" for name, calls in self._calls.items())
        return f"<gradgate.GradStore {{{counts}}}>"


def _not_ready_message(name: str, call: _Call) -> str:
    if call.waiting == 0:
        return (
            f"the latest call of module {name!r} produced no tensor that requires grad (it ran "
            "under torch.no_grad / inference_mode, before a cut, or with frozen inputs and "
            "parameters), so no gradient will reach it and its output did not require grad; "
            "expected it to run with a graph. Move the cut or the freeze below it."
        )
    return (
        f"no gradient has reached the output of module {name!r} from its latest call yet; "
        "expected loss.backward() on a loss computed from it first. If the loss does not "
        "depend on it, no gradient will come: grads.calls(name) shows None then."
    )


def _store(call: _Call, index: int) -> Any:
    def hook(grad: torch.Tensor) -> None:
        call.slots[index] = grad
        call.arrived += 1

    return hook


class CaptureHandle(Handle, Mapping[str, Any]):
    """The result of :func:`capture_grads`: a mapping of output gradients and a handle.

    ``handle[name]`` / ``handle.outputs[name]`` are the gradients with respect to the
    module's output, ``handle.inputs[name]`` those with respect to its inputs (with
    ``inputs=True``; positional then keyword arguments, as a ``(args, kwargs)`` pair).
    """

    def __init__(self, description: str, names: list[str], aliases: dict[str, str]) -> None:
        super().__init__(self._remove_hooks, description=description)
        self.outputs = GradStore(names, aliases)
        self.inputs = GradStore(names, aliases)
        self._module_hooks = HookSet()
        self._tensor_hooks: list[RemovableHandle] = []

    def __getitem__(self, name: str) -> Any:
        return self.outputs[name]

    def __contains__(self, name: object) -> bool:
        return name in self.outputs

    def __iter__(self) -> Iterator[str]:
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)

    def calls(self, name: str) -> list[Any]:
        """Output gradients of every call of module ``name``, in call order."""
        return self.outputs.calls(name)

    def clear(self) -> None:
        """Forget every captured gradient; the hooks stay in place."""
        self.outputs.clear()
        self.inputs.clear()
        for hook in self._tensor_hooks:
            hook.remove()
        self._tensor_hooks = []

    def _remove_hooks(self) -> None:
        self._module_hooks.remove()
        for hook in self._tensor_hooks:
            hook.remove()
        self._tensor_hooks = []

    def _on_output(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        self._tensor_hooks.extend(self.outputs._record(name, output))

    def _on_input(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._tensor_hooks.extend(self.inputs._record(name, (args, kwargs)))


def capture_grads(model: nn.Module, *patterns: Pattern, inputs: bool = False) -> CaptureHandle:
    """Capture d loss / d (module output) for the matched modules in the next backwards.

    One ordinary ``backward()`` fills the result. ``grads[name]`` is the gradient of the
    module's latest call (one value, every step); ``grads.calls(name)`` lists every call in
    call order (a module run twice per forward, or several steps without ``clear()``). Reading
    before a backward reached it raises :class:`GradientNotReadyError`. Names are the full
    module names or the patterns as given; ``''`` names the model itself. With ``inputs=True``
    the gradients with respect to each call's input tensors are kept too
    (``grads.inputs[name]``). The result is a handle: ``remove()`` or leaving the ``with``
    block takes every hook off; the gradients stay readable. A copy of the model
    (``deepcopy``, ``pickle``, ``torch.save``) carries none of its hooks.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    >>> with gg.capture_grads(net, "0") as grads:
    ...     net(torch.randn(4, 3)).sum().backward()
    >>> grads["0"].shape
    torch.Size([4, 2])
    >>> torch.allclose(grads["0"], net[1].weight.expand(4, 2))
    True
    """
    check_module(model)
    patterns = check_patterns("capture_grads", patterns, model=model, allow_root=True)
    if not isinstance(inputs, bool):
        raise InvalidOptionError(
            f"inputs={inputs!r} has type {type(inputs).__name__}; expected True (also keep the "
            "gradients with respect to each call's inputs) or False."
        )
    matched = resolve_modules(model, patterns)
    aliases = {}
    for pattern in patterns:
        if isinstance(pattern, str) and len(found := resolve_modules(model, [pattern])) == 1:
            aliases[pattern] = found[0][0]
    names = [name for name, _ in matched]
    handle = CaptureHandle(f"capture_grads {', '.join(map(repr, patterns))}", names, aliases)
    for name, module in matched:
        if not runs_itself(module):
            continue  # a container is never called: a hook on it would never run
        handle._module_hooks.post(module, GateHook(handle, "_on_output", name))
        if inputs:
            handle._module_hooks.pre(module, GateHook(handle, "_on_input", name), with_kwargs=True)
    return handle
