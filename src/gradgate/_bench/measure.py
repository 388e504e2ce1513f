"""Counts for one step: backward FLOPs and bytes saved for backward (device-independent).

Time and peak memory depend on the device: see :mod:`.device`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._plumbing.autograd import StorageBytes, observe_saved, storage_key
from .methods import Runner
from .workloads import Depth

_ATTENTION_BACKWARD = (
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
)


def flop_counter() -> Any:
    """A ``FlopCounterMode`` that also counts attention backward where torch cannot: CPU flash
    attention (no formula registered) and the GPU kernels on torch versions whose formula
    raises on them (the audit's attention formula is used there)."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    from .._observe.audit.flops import attention_backward_flops

    mapping = {}
    for name in _ATTENTION_BACKWARD:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            mapping[packet] = _first_that_counts(
                flop_registry.get(packet), attention_backward_flops
            )
    return FlopCounterMode(display=False, custom_mapping=mapping)


def _first_that_counts(primary: Callable[..., int] | None, fallback: Callable[..., int]) -> Any:
    def formula(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        if primary is not None:
            try:
                return primary(*args, out_val=out_val, **kwargs)
            except Exception:  # torch 2.11's formula asserts on some attention layouts
                pass
        return fallback(*args, out_val=out_val, **kwargs)

    formula._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode passes tensors
    return formula


def counts(runner: Runner, method: str, depth: Depth) -> dict[str, int]:
    """Backward FLOPs and bytes saved for backward of one step (one step measures both)."""
    counter = flop_counter()

    def counted(loss: torch.Tensor) -> None:
        with counter:
            loss.backward()

    model = runner.model_for(method)
    saved = saved_bytes_during(
        lambda: runner.step(method, depth, backward=counted), exclude=model.parameters()
    )
    return {"backward_flops": int(counter.get_total_flops()), "saved_bytes": saved}


def backward_flops(runner: Runner, method: str, depth: Depth) -> int:
    """FLOPs that ``loss.backward()`` runs (``FlopCounterMode`` around the backward only)."""
    counter = flop_counter()

    def counted(loss: torch.Tensor) -> None:
        with counter:
            loss.backward()

    runner.step(method, depth, backward=counted)
    return int(counter.get_total_flops())


def saved_bytes(runner: Runner, method: str, depth: Depth) -> int:
    """Bytes autograd saves for backward during one step: each storage once, parameters
    excluded."""
    model = runner.model_for(method)
    return saved_bytes_during(lambda: runner.step(method, depth), exclude=model.parameters())


def saved_bytes_during(step: Callable[[], Any], *, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``step()`` runs.

    Uses the library's cycle-free observer: packing the tensor itself would make a reference
    cycle (an output saved by its own ``grad_fn``, as ``sigmoid`` does) that keeps it alive,
    even after ``gc.collect()``, when no backward runs.

    >>> x = torch.ones(1000, requires_grad=True)
    >>> saved_bytes_during(lambda: x.sigmoid())
    4000
    """
    counter = StorageBytes(exclude=[storage_key(tensor) for tensor in exclude])
    with observe_saved(counter.add):
        step()
    return counter.total
