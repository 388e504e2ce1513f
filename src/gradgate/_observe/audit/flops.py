"""Backward FLOPs: torch's ``FlopCounterMode`` formulas, with gradgate's own where they fail.

:class:`BackwardObserver` sees every op, and hands each backward op with its FLOPs to the
autograd node running it. The FLOPs follow ``torch.utils.flop_counter``: its formula when one
is registered, else the op is decomposed and its parts counted. CPU flash attention, which
that registry lacks, is counted with the attention formula the GPU kernels use; and where
torch's own formula raises (older torch on grouped-query attention, fewer key/value heads
than query heads), gradgate's formula for that op is used instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._plumbing.autograd import Node, storage_key, tensors_in
from ..._plumbing.torch_internals import (
    TorchDispatchMode,
    current_autograd_node,
    require_op_observer,
)

Piece = tuple[tuple[int, ...], int]  # (storage keys of an op's outputs, its FLOPs)
Formula = Callable[..., int]


class BackwardObserver(TorchDispatchMode):
    """Calls ``on_op(node, flops, pieces)`` for every op run by an autograd node;
    ``uncounted`` names the ops whose FLOPs no formula could count."""

    def __init__(self, on_op: Callable[[Node, int, list[Piece]], None]) -> None:
        require_op_observer("An audit (FLOPs and saved bytes per autograd node)")
        super().__init__()
        self._on_op = on_op
        self.uncounted: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        node = current_autograd_node()
        if node is None:
            return func(*args, **kwargs)
        formula = torch_formula(func)
        if (
            formula is None
            and own_formula(func) is None
            and func is not torch.ops.prim.device.default
        ):
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        out = func(*args, **kwargs)
        pieces = self._pieces(func, formula, args, kwargs, out)
        self._on_op(node, sum(count for _, count in pieces), pieces)
        return out

    def _pieces(
        self, func: Any, formula: Formula | None, args: Any, kwargs: Any, out: Any
    ) -> list[Piece]:
        fallback = own_formula(func)
        if formula is not None:
            try:
                return flops_per_output(func, formula, args, kwargs, out)
            except Exception:  # torch's formula failed on this call: count it our way
                if fallback is None:
                    self.uncounted.add(str(func._overloadpacket))
                    return flops_per_output(func, None, args, kwargs, out)
        return flops_per_output(func, fallback, args, kwargs, out)


def torch_formula(func: Any) -> Formula | None:
    """``FlopCounterMode``'s formula for an op, if torch registers one."""
    from torch.utils import flop_counter

    return flop_counter.flop_registry.get(func._overloadpacket)  # type: ignore[no-any-return]


def own_formula(func: Any) -> Formula | None:
    """gradgate's formula for an op (attention backward in ``(batch, heads, seq, dim)``)."""
    return _OWN.get(str(func._overloadpacket))


def attention_backward_flops(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    out_val: Any = None,
    **kwargs: Any,
) -> int:
    """FLOPs of an attention backward, the five batched matmuls ``FlopCounterMode`` counts;
    key and value heads are repeated up to the query heads (grouped-query attention).

    >>> import torch
    >>> q, o = torch.empty(1, 4, 8, 16), torch.empty(1, 4, 8, 16)
    >>> kv = torch.empty(1, 2, 8, 16)  # two key/value heads shared by four query heads
    >>> attention_backward_flops(o, q, kv, kv) == attention_backward_flops(o, q, q, q)
    True
    """
    b, heads, s_q, d_q = query.shape
    s_k, d_v = key.shape[-2], value.shape[-1]
    batch = b * heads
    return (
        2
        * batch
        * (s_q * d_q * s_k + s_q * d_v * s_k + s_k * s_q * d_v + s_q * s_k * d_q + d_q * s_q * s_k)
    )


_OWN: dict[str, Formula] = {
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": attention_backward_flops,
    "aten._scaled_dot_product_flash_attention_backward": attention_backward_flops,
    "aten._scaled_dot_product_efficient_attention_backward": attention_backward_flops,
    "aten._scaled_dot_product_cudnn_attention_backward": attention_backward_flops,
}


def flops_per_output(
    func: Any, formula: Formula | None, args: Any, kwargs: Any, out: Any
) -> list[Piece]:
    """(storage keys, FLOPs) pieces of one op; masked multi-output ops split per output."""
    keys = tuple(storage_key(t) for t in tensors_in(out))
    if formula is None:
        return [(keys, 0)]
    mask_at = _output_mask_position(func)
    outputs = list(out) if isinstance(out, (tuple, list)) else [out]
    if mask_at is None or mask_at >= len(args) or len(outputs) != len(args[mask_at]):
        return [(keys, int(formula(*args, **kwargs, out_val=out)))]
    pieces: list[Piece] = []
    for index, wanted in enumerate(args[mask_at]):
        if not wanted or not isinstance(outputs[index], torch.Tensor):
            continue
        only = [position == index for position in range(len(outputs))]
        masked = (*args[:mask_at], only, *args[mask_at + 1 :])
        count = int(formula(*masked, **kwargs, out_val=out))
        pieces.append(((storage_key(outputs[index]),), count))
    return pieces


def _output_mask_position(func: Any) -> int | None:
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == "output_mask":
            return position
    return None
