"""The memory planner's private torch APIs (``gg.estimate``): fake tensors, running an op for
real below every dispatch mode, storage keys, ``aten._grouped_mm``, ``.item()`` of a fake tensor
read as 1 and what ``torch.compile`` wraps."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from . import DISPATCH_MODE, _lookup, needs

# -- fake tensors: shapes and dtypes, no memory (gg.estimate) -----------------------------------
FAKE_TENSOR = "torch._subclasses.fake_tensor"  # imported on first need: it is not light


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` that also takes the real tensors a module keeps outside its
    parameters and buffers (they become fake when used)."""
    mode = _lookup(FAKE_TENSOR, "FakeTensorMode")
    if mode is None:
        raise needs("gg.estimate", "FakeTensorMode")
    return mode(allow_non_fake_inputs=True)


def value_dependent_errors() -> tuple[type[Exception], ...]:
    """What a fake forward raises when it needs tensor values (``.item()``, ``nonzero()``)."""
    names = ("DataDependentOutputException", "DynamicOutputShapeException")
    return tuple(e for e in (_lookup(FAKE_TENSOR, n) for n in names) if e is not None)


# -- the planner's simulated step (gg.estimate) --------------------------------------------------
DISABLE_MODES = _lookup("torch.utils._python_dispatch", "_disable_current_modes")
GROUPED_MM: Any = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)


def fake_tensor_type() -> type:
    """``FakeTensor``: a mode's ``types`` holds it when an op has a fake input."""
    return _lookup(FAKE_TENSOR, "FakeTensor") or type(None)  # type: ignore[no-any-return]


def outside_modes() -> Any:
    """A context where ops run for real, below every dispatch mode (fake mode included);
    ``None`` where torch cannot (the planner then keeps every tensor fake)."""
    return None if DISABLE_MODES is None else DISABLE_MODES()


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(model)`` wraps (``model`` itself when not compiled)."""
    while type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        model = getattr(model, "_orig_mod")  # noqa: B009 (an attribute, not a submodule)
    return model


def drop_compiled_forwards(model: torch.nn.Module) -> None:
    """Undo ``module.compile()`` on every module of ``model`` (a copy the caller owns)."""
    for module in model.modules():
        module.__dict__.pop("_compiled_call_impl", None)


@functools.cache
def grouped_mm_refuses(dtype: torch.dtype) -> bool:
    """Whether the meta kernel of ``aten._grouped_mm`` refuses ``dtype`` inputs (the real CPU
    kernel takes float32, torch 2.13's meta kernel only bfloat16); asked below any mode."""
    with DISABLE_MODES() if DISABLE_MODES is not None else contextlib.nullcontext():
        a, b = (torch.empty(*size, dtype=dtype, device="meta") for size in [(16, 16), (2, 16, 16)])
        try:
            GROUPED_MM(a, b.transpose(-2, -1), torch.empty(2, dtype=torch.int32, device="meta"))
        except RuntimeError:
            return True
    return False


# -- .item() of a fake tensor read as 1 (an optimizer marked ``scalars``: Adafactor) ------------
LOCAL_SCALAR: Any = getattr(getattr(torch.ops.aten, "_local_scalar_dense", None), "default", None)


def scalars_read_as_one() -> contextlib.AbstractContextManager[Any]:
    """A dispatch mode under which ``.item()`` of a fake tensor gives 1 (``True``, ``1``,
    ``1.0`` by dtype) instead of failing: for an optimizer step that reads values only as Python
    scalars sizing no tensor, where 1 is a valid step count and norm. Real tensors read their
    values. Where torch lacks the op or dispatch modes, nothing changes (the read then fails,
    explained)."""
    if DISPATCH_MODE is None or LOCAL_SCALAR is None:
        return contextlib.nullcontext()
    return _ScalarsReadAsOne()


class _ScalarsReadAsOne(DISPATCH_MODE or object):  # type: ignore[misc]
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is LOCAL_SCALAR and issubclass(type(args[0]), fake_tensor_type()):
            dtype = args[0].dtype
            if dtype == torch.bool:
                return True
            return 1.0 if dtype.is_floating_point or dtype.is_complex else 1
        return func(*args, **kwargs)
