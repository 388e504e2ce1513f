"""The fake twin: a copy of the model, and of its example inputs, that a step can run on.

Parameters, buffers and floating inputs become ``FakeTensorMode`` tensors on the CPU: shapes,
dtypes and storages, no memory. Small integer inputs (token ids, masks, labels) stay real
copies, so that code looking at their values behaves as in a real run: a ``meta`` one is made
real with the values of an unpadded batch (a ``*mask`` of ones, ``position_ids`` counting up,
anything else zeros). A compiled model is planned as the module it wraps, run eagerly.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._plumbing.torch_internals.planner import drop_compiled_forwards, unwrap_compiled
from .._plumbing.torch_internals.trees import tree_flatten, tree_unflatten

REAL_LIMIT = 2**24  # the most elements of an integer input kept real
OP_LIMIT = 2**16  # integer results of ops kept real: at least this many elements


def fake_twin(model: nn.Module, mode: Any, cast: torch.dtype | None) -> nn.Module:
    """A copy of ``model`` (unwrapped if compiled) whose parameters and buffers are fake CPU
    tensors, ties kept, ``cast`` applied to floating ones; it runs eagerly."""
    model = unwrap_compiled(model)
    memo: dict[int, Any] = {}
    with mode:
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) not in memo:
                fake = fake_like(tensor, cast)
                if isinstance(tensor, nn.Parameter):
                    fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                memo[id(tensor)] = fake
    twin = copy.deepcopy(model, memo)
    drop_compiled_forwards(twin)
    return twin


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are ``meta`` tensors of the same
    shapes, dtypes and ``requires_grad`` (ties kept): what a later plan of the model as it is
    now needs, holding none of its memory."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            meta = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta"
            )
            if isinstance(tensor, nn.Parameter):
                meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = meta
    return copy.deepcopy(model, memo)


def light_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example inputs as :func:`step_inputs` reads them, holding little memory: floating
    tensors and large integer ones become ``meta`` tensors of their shapes (they are planned
    as fake tensors anyway), small integer ones detached CPU copies (their values count)."""
    done: dict[int, torch.Tensor] = {}

    def convert(leaf: Any, name: str) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) not in done:
            floating = leaf.is_floating_point() or leaf.is_complex()
            if floating or leaf.numel() > REAL_LIMIT or leaf.is_meta:
                meta = torch.empty_strided(
                    leaf.shape, leaf.stride(), dtype=leaf.dtype, device="meta"
                )
                done[id(leaf)] = meta.requires_grad_(leaf.requires_grad and floating)
            else:
                done[id(leaf)] = leaf.detach().to("cpu", copy=True)
        return done[id(leaf)]

    light_args = tuple(_mapped(arg, "", convert) for arg in args)
    return light_args, {name: _mapped(value, name, convert) for name, value in kwargs.items()}


def fake_like(tensor: torch.Tensor, cast: torch.dtype | None) -> torch.Tensor:
    dtype = cast if cast is not None and tensor.is_floating_point() else tensor.dtype
    fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=dtype, device="cpu")
    return fake.requires_grad_(tensor.requires_grad) if fake.is_floating_point() else fake


def step_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], mode: Any, cast: torch.dtype | None
) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """The example inputs for the twin, and how many elements an integer result of an op may
    have and still be computed for real (the largest integer input's, at least ``OP_LIMIT``)."""
    sizes = [OP_LIMIT]
    done: dict[int, torch.Tensor] = {}  # one copy of a tensor passed twice (labels=ids)

    def convert(leaf: Any, name: str) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) not in done:
            done[id(leaf)] = copied(leaf, name)
        return done[id(leaf)]

    def copied(leaf: torch.Tensor, name: str) -> torch.Tensor:
        floating = leaf.is_floating_point() or leaf.is_complex()
        if floating or leaf.numel() > REAL_LIMIT:
            with mode:
                return fake_like(leaf, cast)
        sizes.append(leaf.numel())
        if leaf.is_meta:
            return _unpadded(leaf, name)
        return leaf.detach().to("cpu", copy=True)  # the model may change it in place

    fake_args = tuple(_mapped(arg, "", convert) for arg in args)
    fake_kwargs = {name: _mapped(value, name, convert) for name, value in kwargs.items()}
    return fake_args, fake_kwargs, max(sizes)


def _mapped(value: Any, name: str, convert: Any) -> Any:
    leaves, spec = tree_flatten(value)
    return tree_unflatten([convert(leaf, name) for leaf in leaves], spec)


def _unpadded(meta: torch.Tensor, name: str) -> torch.Tensor:
    """Real values for a ``meta`` integer input: those of an unpadded batch."""
    if name.endswith("mask"):
        return torch.ones(meta.shape, dtype=meta.dtype)
    if name == "position_ids" and meta.dim():
        return torch.arange(meta.shape[-1], dtype=meta.dtype).expand(meta.shape).contiguous()
    return torch.zeros(meta.shape, dtype=meta.dtype)


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """``torch.compile``d code called inside runs eagerly (fake tensors have no data for
    compiled kernels). Process-wide while planning, and only where dynamo was loaded at all."""
    compiler = getattr(torch, "compiler", None)
    stance = getattr(compiler, "set_stance", None)
    if "torch._dynamo" not in sys.modules or stance is None:
        yield
        return
    with stance("force_eager"):
        yield
