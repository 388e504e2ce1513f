"""How are gradients changed? Per-module gradient transforms, removable.

Every transform acts on one of two kinds of gradient, chosen by ``on``:

* ``"params"`` — the gradients of the module's own parameters (wgrad), changed before they
  are accumulated into ``.grad``; what flows on to earlier layers is untouched;
* ``"input"`` — the gradient flowing out of the module into its inputs (dgrad), i.e. what
  earlier layers receive; the module's own parameter gradients are untouched;
* ``"both"`` — both of the above.

Mechanics: ``"params"`` uses tensor hooks on the parameters; ``"input"`` gives the module a
fresh alias (a view) of each input tensor that requires grad and hooks that alias, so only
this module's contribution to the input gradient is changed (not other uses of the tensor,
such as a residual branch).

Order: transforms on the same module apply in the order they were registered (the first
one sees the raw gradient). Across modules they apply in backward order, later layers first.

Steps: ``when(step)`` decides per forward whether the transform applies. ``step`` counts
forward passes of the ``model`` given (0 for the first forward after the transform was
registered); with ``count="manual"`` it advances only on ``handle.step()``. A forward's
backward uses that forward's decision for ``"input"``; parameter hooks use the decision of
the most recent forward.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._plumbing.errors import InvalidOptionError, NoTensorError, TransformError
from .._plumbing.handles import Handle
from .._plumbing.hook_set import HookSet
from .._plumbing.hooks import GateHook
from .._plumbing.tagging import runs_itself
from .._plumbing.torch_internals.trees import tree_flatten, tree_unflatten
from .._plumbing.validate import check_choice
from .._select.names import Pattern, check_module, check_patterns, resolve_modules

On = Literal["params", "input", "both"]
Count = Literal["forward", "manual"]
GradFn = Callable[[torch.Tensor], torch.Tensor]


class TransformHandle(Handle):
    """Undoes one gradient transform (all its hooks), exactly once; also counts steps."""

    def __init__(
        self, description: str, fn: GradFn, *, when: Callable[[int], object] | None
    ) -> None:
        super().__init__(self._remove_hooks, description=description)
        self._fn = fn
        self._when = when
        self._module_hooks = HookSet()  # copy-safe: a copy of the model carries none of them
        self._hooks: list[RemovableHandle] = []  # tensor hooks on parameters
        self._hooked_params: set[int] = set()
        self._steps = 0
        self._applies_now = True

    @property
    def step_count(self) -> int:
        """The step the next forward will see (forwards so far, or manual ``step()`` calls)."""
        return self._steps

    def step(self) -> None:
        """Advance the step counter by one (the way to count with ``count="manual"``)."""
        self._steps += 1

    def _decide(self, step: int, where: str) -> bool:
        """Whether the forward at ``step`` is transformed (the ``when`` verdict)."""
        if self._when is None:
            return True
        try:
            return bool(self._when(step))
        except Exception as err:
            raise TransformError(
                f"when={self._when!r} raised {type(err).__name__}: {err} at step {step} for "
                f"pattern {where}; expected a function of the step number returning True "
                "(transform) or False (leave the gradient alone)."
            ) from err

    def _remove_hooks(self) -> None:
        self._module_hooks.remove()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # forward hooks (bound through GateHook so that copies of the model drop them)

    def _model_forward(self, where: str, advance: bool, module: nn.Module, args: Any) -> None:
        self._applies_now = self._decide(self._steps, where)
        if advance:
            self._steps += 1

    def _params_forward(self, name: str, module: nn.Module, args: Any) -> None:
        _hook_parameters(self, name, module, self._fn)

    def _input_forward(
        self, name: str, module: nn.Module, args: Any, kwargs: Any
    ) -> tuple[Any, Any]:
        return _alias_inputs(self, name, self._fn, module, args, kwargs)


def grad_transform(
    model: nn.Module,
    pattern: Pattern,
    fn: GradFn,
    *,
    when: Callable[[int], object] | None = None,
    on: On = "params",
    count: Count = "forward",
) -> TransformHandle:
    """Replace gradients of the matched modules by ``fn(grad)``; returns a removable handle.

    ``on`` picks the gradient (see the module docs: ``"params"``, ``"input"`` or
    ``"both"``); ``when(step) -> bool`` picks the steps, counted per forward of ``model``
    (``count="forward"``) or per ``handle.step()`` (``count="manual"``).

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> handle = gg.grad_transform(net, "1", torch.zeros_like, when=lambda s: s % 2 == 0)
    >>> for step in range(2):
    ...     net.zero_grad()
    ...     net(torch.ones(1, 2)).sum().backward()
    ...     print(step, bool(net[1].weight.grad.abs().sum() > 0))
    0 False
    1 True
    >>> handle.remove()
    """
    check_module(model)
    (pattern,) = check_patterns("grad_transform", (pattern,), model=model)
    check_choice("on", on, get_args(On))
    check_choice("count", count, get_args(Count))
    if not callable(fn):
        raise TransformError(
            f"fn={fn!r} is not callable; expected a function taking a gradient tensor and "
            "returning a tensor of the same shape, e.g. lambda g: 0.5 * g."
        )
    if when is not None and not callable(when):
        raise TransformError(
            f"when={when!r} is not callable; expected a function of the step number returning "
            "a bool, e.g. when=lambda step: step % 2 == 0, or None for every step."
        )
    matched = resolve_modules(model, [pattern])
    fn_name = getattr(fn, "__name__", type(fn).__name__)
    if on in ("params", "both"):
        for name, module in matched:
            if not any(True for _ in module.parameters()):
                raise NoTensorError(
                    f"module {name!r} ({type(module).__name__}) has no parameters, so on={on!r} "
                    "has no parameter gradient to transform; expected a module with parameters. "
                    "Use on='input' to change the gradient flowing out of it."
                )
    handle = TransformHandle(f"grad_transform {pattern!r} {fn_name} on={on}", fn, when=when)
    hooks = handle._module_hooks
    for name, module in matched:
        if on in ("params", "both"):
            _hook_parameters(handle, name, module, fn)
            if runs_itself(module):  # a container is never called: the hook above is all
                hooks.pre(module, GateHook(handle, "_params_forward", name))
        if on in ("input", "both") and runs_itself(module):
            hooks.pre(
                module, GateHook(handle, "_input_forward", name), with_kwargs=True, prepend=True
            )
    # Registered last and prepended: decides the step before any module hook of this model.
    hook = GateHook(handle, "_model_forward", repr(pattern), count == "forward")
    if runs_itself(model):
        hooks.pre(model, hook, prepend=True)
    return handle


def scale_grad(
    model: nn.Module,
    pattern: Pattern,
    factor: float,
    *,
    on: On = "params",
    when: Callable[[int], object] | None = None,
) -> TransformHandle:
    """Multiply the matched modules' gradients by ``factor`` (default: parameter gradients).

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 1))
    >>> handle = gg.scale_grad(net, "0", 0.5)
    >>> net(torch.ones(1, 2)).sum().backward()
    >>> net[0].bias.grad
    tensor([0.5000])
    >>> handle.remove()
    """
    factor = _number("factor", factor)
    return grad_transform(model, pattern, _Scale(factor), on=on, when=when)


def reverse_grad(
    model: nn.Module,
    pattern: Pattern,
    lambd: float = 1.0,
    *,
    on: On = "input",
    when: Callable[[int], object] | None = None,
) -> TransformHandle:
    """A gradient-reversal layer: the gradient flowing out of the module becomes ``-lambd × g``.

    By default (``on="input"``) the module itself learns normally and everything before it
    receives the reversed gradient, as in domain-adversarial training (DANN).

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> x = torch.ones(1, 2, requires_grad=True)
    >>> with gg.reverse_grad(net, "1", 2.0):
    ...     net(x).sum().backward()
    >>> reference = torch.autograd.grad(net(x).sum(), x)[0]
    >>> torch.allclose(x.grad, -2.0 * reference)
    True
    """
    lambd = _number("lambd", lambd)
    return grad_transform(model, pattern, _Scale(-lambd), on=on, when=when)


def clip_grad(
    model: nn.Module,
    pattern: Pattern,
    *,
    max_value: float | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    on: On = "params",
    when: Callable[[int], object] | None = None,
) -> TransformHandle:
    """Clip gradients by value (to ``[-max_value, max_value]``) or by norm, per gradient tensor.

    Exactly one of ``max_value`` / ``max_norm``. The norm is taken per tensor (each parameter
    gradient, or each input gradient), not over the whole module; for one global norm use
    ``torch.nn.utils.clip_grad_norm_`` after ``backward()``.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 1))
    >>> handle = gg.clip_grad(net, "0", max_value=0.5)
    >>> net(torch.full((1, 2), 3.0)).sum().backward()
    >>> net[0].weight.grad, net[0].bias.grad
    (tensor([[0.5000, 0.5000]]), tensor([0.5000]))
    >>> handle.remove()
    """
    if (max_value is None) == (max_norm is None):
        raise InvalidOptionError(
            f"clip_grad got max_value={max_value!r} and max_norm={max_norm!r}; expected exactly "
            "one of them, e.g. clip_grad(model, 'encoder', max_norm=1.0)."
        )
    fn: GradFn
    if max_value is not None:
        fn = _ClipValue(_positive("max_value", max_value))
    else:
        assert max_norm is not None
        fn = _ClipNorm(_positive("max_norm", max_norm), _norm_type(norm_type))
    return grad_transform(model, pattern, fn, on=on, when=when)


def zero_grad_of(
    model: nn.Module,
    pattern: Pattern,
    *,
    on: On = "params",
    when: Callable[[int], object] | None = None,
) -> TransformHandle:
    """Replace the matched modules' gradients by zeros (default: parameter gradients).

    The parameters' ``.grad`` become zero *tensors*, so an optimizer with momentum or weight
    decay still moves them. To stop parameters from learning, use :func:`gradgate.freeze`
    (their ``.grad`` stays ``None``) instead.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 1))
    >>> with gg.zero_grad_of(net, "0"):
    ...     net(torch.ones(1, 2)).sum().backward()
    >>> net[0].weight.grad
    tensor([[0., 0.]])
    """
    return grad_transform(model, pattern, torch.zeros_like, on=on, when=when)


# -- the hooks --------------------------------------------------------------------------------


def _hook_parameters(handle: TransformHandle, name: str, module: nn.Module, fn: GradFn) -> None:
    if not handle.active:
        return
    for param_name, param in module.named_parameters():
        if param.requires_grad and id(param) not in handle._hooked_params:
            handle._hooked_params.add(id(param))
            where = f"{name}.{param_name}" if name else param_name
            handle._hooks.append(param.register_hook(_param_hook(handle, where, fn)))


def _param_hook(handle: TransformHandle, where: str, fn: GradFn) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        if not handle._applies_now:
            return None
        return _apply(fn, grad, where)

    return hook


def _alias_inputs(
    handle: TransformHandle, name: str, fn: GradFn, module: nn.Module, args: Any, kwargs: Any
) -> tuple[Any, Any]:
    leaves, spec = tree_flatten((args, kwargs))
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise NoTensorError(
            f"module {name!r} ({type(module).__name__}) received no tensor input, so "
            "there is no gradient flowing out of it to transform; expected a module "
            "called with tensors. Use on='params' for its parameter gradients."
        )
    if not handle._applies_now:
        return args, kwargs
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and torch.is_grad_enabled():
            alias = leaf.view_as(leaf)
            alias.register_hook(lambda grad: _apply(fn, grad, f"input of {name!r}"))
            leaves[index] = alias
    new_args, new_kwargs = tree_unflatten(leaves, spec)
    return tuple(new_args), new_kwargs


def _apply(fn: GradFn, grad: torch.Tensor, where: str) -> torch.Tensor:
    try:
        result = fn(grad)
    except Exception as err:
        raise TransformError(
            f"the gradient transform {fn!r} raised {type(err).__name__}: {err} on the gradient "
            f"of {where} (shape {tuple(grad.shape)}); expected a function taking a gradient "
            "tensor and returning one of the same shape."
        ) from err
    if not isinstance(result, torch.Tensor) or result.shape != grad.shape:
        got = (
            f"a tensor of shape {tuple(result.shape)}"
            if isinstance(result, torch.Tensor)
            else type(result).__name__
        )
        raise TransformError(
            f"the gradient transform {fn!r} returned {got} for the gradient of {where}; "
            f"expected a tensor of shape {tuple(grad.shape)}."
        )
    return result


# -- the built-in functions (named classes, so handles and messages read well) ---------------


class _Scale:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.factor

    def __repr__(self) -> str:
        return f"scale({self.factor})"


class _ClipValue:
    def __init__(self, max_value: float) -> None:
        self.max_value = max_value

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad.clamp(-self.max_value, self.max_value)

    def __repr__(self) -> str:
        return f"clip(max_value={self.max_value})"


class _ClipNorm:
    def __init__(self, max_norm: float, norm_type: float) -> None:
        self.max_norm = max_norm
        self.norm_type = norm_type

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(grad, self.norm_type)
        factor = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        return grad * factor

    def __repr__(self) -> str:
        return f"clip(max_norm={self.max_norm}, norm_type={self.norm_type})"


def _number(option: str, value: object, *, finite: bool = True) -> float:
    """A real number from a Python, numpy or 0-d tensor value (not a bool)."""
    number: object = value
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.dtype == torch.bool or value.is_complex():
            raise InvalidOptionError(
                f"{option}={value!r} is a tensor of shape {tuple(value.shape)} and dtype "
                f"{value.dtype}; expected a real number (a 0-d real tensor also works)."
            )
        number = value.item()
    if isinstance(number, bool) or not isinstance(number, numbers.Real):
        raise InvalidOptionError(
            f"{option}={value!r} has type {type(value).__name__}; expected a real number."
        )
    result = float(number)
    if finite and not math.isfinite(result):
        raise InvalidOptionError(f"{option}={value!r} is not finite; expected a finite number.")
    return result


def _positive(option: str, value: object) -> float:
    number = _number(option, value)
    if number <= 0:
        raise InvalidOptionError(f"{option}={value!r} must be positive; expected a number > 0.")
    return number


def _norm_type(value: object) -> float:
    """A p-norm order: a number > 0, or ``inf`` (also the string ``'inf'``, as in torch)."""
    if isinstance(value, str):
        if value.strip().lower() == "inf":
            return math.inf
        raise InvalidOptionError(
            f"norm_type={value!r} is not a norm order; expected a number > 0 or 'inf', "
            "e.g. norm_type=2.0 or norm_type=float('inf')."
        )
    number = _number("norm_type", value, finite=False)
    if not number > 0:
        raise InvalidOptionError(
            f"norm_type={value!r} is not a norm order; expected a number > 0 or inf."
        )
    return number
