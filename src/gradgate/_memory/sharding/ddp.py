"""DDP: every rank holds the whole model, its gradients and its optimizer state, plus the
reducer's buffers (torch's defaults: ``bucket_cap_mb=25``, a first bucket of 1 MiB,
``gradient_as_bucket_view=False``, and ``find_unused_parameters=True``, which a gate needs).

The reducer keeps one flat bucket per 25 MiB of parameters that require grad, filled in
reverse order per dtype, for the whole run: a second copy of every trainable gradient (the
gate leaves every parameter trainable, so all of them). ``find_unused_parameters`` adds one
int32 flag per parameter on the device (and a copy in host memory, on the device too for the
CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..counter import StepCounter
from .engine import Engine

FIRST_BUCKET = 2**20  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
BUCKET_CAP = 25 * 2**20  # DDP's bucket_cap_mb=25


def bucket_sizes(params: Sequence[torch.Tensor]) -> list[tuple[int, torch.dtype]]:
    """Elements and dtype of each of DDP's buckets over ``params`` (those requiring grad):
    in reverse order, per dtype, a bucket closes once it holds its limit (1 MiB for the
    first of a dtype, 25 MiB after).

    >>> [n for n, _ in bucket_sizes([torch.empty(2**18), torch.empty(2**18)])]
    [262144, 262144]
    """
    open_: dict[torch.dtype, list[int]] = {}  # dtype -> [elements, bytes, buckets closed]
    closed: list[tuple[int, torch.dtype]] = []
    for param in reversed(params):
        entry = open_.setdefault(param.dtype, [0, 0, 0])
        entry[0] += param.numel()
        entry[1] += param.nbytes
        if entry[1] >= (FIRST_BUCKET if entry[2] == 0 else BUCKET_CAP):
            closed.append((entry[0], param.dtype))
            entry[:] = [0, 0, entry[2] + 1]
    closed += [(entry[0], dtype) for dtype, entry in open_.items() if entry[0]]
    return closed


class Ddp(Engine):
    """DDP's replicas and its reducer's buffers (see the module)."""

    name = "ddp"

    def __init__(self, world: int, device: str) -> None:
        self.world = world
        self.host_flags_on_device = device == "cpu"

    def start(self, counter: StepCounter, learnable: list[nn.Parameter]) -> list[Any]:
        buffers = [torch.empty(n, dtype=dtype) for n, dtype in bucket_sizes(learnable)]
        copies = 2 if self.host_flags_on_device else 1
        unique = {id(p) for p in learnable}
        buffers += [torch.empty(len(unique), dtype=torch.int32) for _ in range(copies)]
        return buffers
