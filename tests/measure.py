"""Independent measurements for tests: backward FLOPs and bytes saved for backward."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode


def forward_and_backward(forward: Callable[[], torch.Tensor]) -> tuple[int, int]:
    """Run ``forward`` then backward; return (bytes saved for backward, backward FLOPs).

    Saved bytes count each storage once. With nothing to learn (the loss does not require
    grad) both are 0. The pack hook returns a detached alias, never the tensor it was given:
    returning an output autograd saved (sigmoid, tanh) would keep it alive in a cycle.
    """
    storages: dict[int, int] = {}
    alive = []  # a storage freed during forward must not lend its address to a new one

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        alive.append(storage)
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward()
    if not loss.requires_grad:
        return sum(storages.values()), 0
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return sum(storages.values()), counter.get_total_flops()
