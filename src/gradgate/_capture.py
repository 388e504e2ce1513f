"""What are the inner gradients? Gradients of the loss with respect to module outputs.

A forward hook registers a tensor hook on every output tensor that requires grad; the tensor
hook stores the gradient when the ordinary backward reaches it. No ``retain_graph``, no second
backward, nothing kept but the gradients asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from ._errors import NoTensorError
from ._handles import Handle
from ._select import Pattern, resolve_modules


class _Call:
    """The gradients of one call of a module, laid out like its output (or input)."""

    def __init__(self, spec: Any, count: int) -> None:
        self.spec = spec
        self.slots: list[torch.Tensor | None] = [None] * count

    def value(self) -> Any:
        return tree_unflatten(self.slots, self.spec)


class GradStore(Mapping[str, Any]):
    """Gradients by module name: one value per module, or a list when it ran several times.

    A value has the structure of what the module returned (a tensor, a tuple, a dict); an
    entry is ``None`` where no gradient reached it (not a tensor, did not require grad, or
    did not influence the loss).
    """

    def __init__(self) -> None:
        self._calls: dict[str, list[_Call]] = {}

    def calls(self, name: str) -> list[Any]:
        """The gradients of every call of module ``name``, in forward (call) order."""
        return [call.value() for call in self._calls[name]]

    def __getitem__(self, name: str) -> Any:
        values = self.calls(name)
        return values[0] if len(values) == 1 else values

    def __iter__(self) -> Iterator[str]:
        return iter(self._calls)

    def __len__(self) -> int:
        return len(self._calls)

    def clear(self) -> None:
        """Forget every captured gradient (for instance between training steps)."""
        self._calls.clear()

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
                handles.append(leaf.register_hook(_store(call, index)))
        return handles

    def __repr__(self) -> str:
        counts = ", ".join(f"{name!r}: {len(calls)} call(s)" for name, calls in self._calls.items())
        return f"<gradgate.GradStore {{{counts}}}>"


def _store(call: _Call, index: int) -> Any:
    def hook(grad: torch.Tensor) -> None:
        call.slots[index] = grad

    return hook


class CaptureHandle(Handle, Mapping[str, Any]):
    """The result of :func:`capture_grads`: a mapping of output gradients and a handle.

    ``handle[name]`` / ``handle.outputs[name]`` are the gradients with respect to the
    module's output, ``handle.inputs[name]`` those with respect to its inputs (with
    ``inputs=True``; positional then keyword arguments, as a ``(args, kwargs)`` pair).
    """

    def __init__(self, description: str) -> None:
        super().__init__(self._remove_hooks, description=description)
        self.outputs = GradStore()
        self.inputs = GradStore()
        self._module_hooks: list[RemovableHandle] = []
        self._tensor_hooks: list[RemovableHandle] = []

    def __getitem__(self, name: str) -> Any:
        return self.outputs[name]

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
        for hook in self._module_hooks + self._tensor_hooks:
            hook.remove()
        self._module_hooks = []
        self._tensor_hooks = []


def capture_grads(model: nn.Module, *patterns: Pattern, inputs: bool = False) -> CaptureHandle:
    """Capture d loss / d (module output) for the matched modules in the next backwards.

    One ordinary ``backward()`` fills the result; a module called several times gives a list
    of gradients in call order. With ``inputs=True`` the gradients with respect to each call's
    input tensors are kept too (``grads.inputs[name]``). The result is a handle: ``remove()``
    or leaving the ``with`` block takes every hook off; the gradients stay readable.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    >>> with gg.capture_grads(net, "0") as grads:
    ...     net(torch.randn(4, 3)).sum().backward()
    >>> grads["0"].shape
    torch.Size([4, 2])
    >>> torch.allclose(grads["0"], net[1].weight.expand(4, 2))
    True
    """
    matched = resolve_modules(model, patterns)
    handle = CaptureHandle(f"capture_grads {', '.join(map(repr, patterns))}")
    for name, module in matched:
        handle._module_hooks.append(module.register_forward_hook(_on_output(handle, name)))
        if inputs:
            handle._module_hooks.append(
                module.register_forward_pre_hook(_on_input(handle, name), with_kwargs=True)
            )
    return handle


def _on_output(handle: CaptureHandle, name: str) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        handle._tensor_hooks.extend(handle.outputs._record(name, output))

    return hook


def _on_input(handle: CaptureHandle, name: str) -> Any:
    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        handle._tensor_hooks.extend(handle.inputs._record(name, (args, kwargs)))

    return hook
