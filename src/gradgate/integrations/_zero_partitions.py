"""ZeRO's flat partitions seen parameter by parameter.

Each parameter's stretch of a rank's flat partition (a :class:`Segment`), the optimizer state
moved between the flat tensors and the stretches, ZeRO-3's own copy of its partitions pointed
at the partitions themselves, and the masters LearnerMasters must remake after something wrote
the partitions. Nothing here imports deepspeed: it reads the attributes DeepSpeed's optimizers
have had since ZeRO-3 came (``bit16_groups``, ``single_partition_of_fp32_groups``,
``fp16_groups``, ``fp16_partitioned_groups_flat``, ``fp32_partitioned_groups_flat``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class Segment:
    """One parameter's stretch of a flat partition, stepped as a tensor of its own.

    Its tensor has a version counter of its own (not the flat's): LearnerMasters reads a
    tensor's version to see whether something else wrote it, and the stretches of one flat
    would otherwise all move together.
    """

    __slots__ = ("index", "numel", "start", "tensor")

    def __init__(self, index: int, start: int, numel: int, flat: torch.Tensor) -> None:
        self.index = index  # position of the parameter in LearnersOnly.params
        self.start = start
        self.numel = numel
        self.tensor = torch.empty(0, dtype=flat.dtype, device=flat.device)
        self.point_at(flat)

    def point_at(self, flat: torch.Tensor) -> torch.Tensor:
        """The stretch, re-pointed at the flat tensor's current storage."""
        self.tensor.data = flat.detach().narrow(0, self.start, self.numel)
        return self.tensor


def params_of(outer: Any, kind: str, base: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters DeepSpeed steps, in one order on every rank."""
    if kind == "zero12":
        groups = outer.bit16_groups
    elif kind == "zero3":
        groups = outer.fp16_groups
    else:
        groups = [group["params"] for group in base.param_groups]
    return [param for group in groups for param in group]


def segments_of(
    outer: Any, kind: str, params: list[nn.Parameter]
) -> tuple[dict[int, torch.Tensor], dict[int, list[Segment]]]:
    """The flat partitions the torch optimizer steps and, per flat (by id), each parameter's
    stretch of it."""
    index = {id(param): i for i, param in enumerate(params)}
    found: dict[int, list[Segment]] = {}
    flats: list[torch.Tensor] = []
    if kind == "zero12":
        flats = list(outer.single_partition_of_fp32_groups)
        for flat, group in zip(flats, outer.bit16_groups, strict=True):
            segments = []
            for param in group:
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is not None:  # None: the parameter lies on other ranks
                    where = mapping.hp_fragment_address
                    segments.append(Segment(index[id(param)], where.start, where.numel, flat))
            found[id(flat)] = segments
    elif kind == "zero3":
        flats = list(outer.fp32_partitioned_groups_flat)
        for flat, group in zip(flats, outer.fp16_groups, strict=True):
            segments, start = [], 0
            for param in group:
                numel = int(param.partition_numel())
                segments.append(Segment(index[id(param)], start, numel, flat))
                start += numel
            found[id(flat)] = segments
    return {id(flat): flat for flat in flats}, found


def share_partitions(outer: Any) -> list[torch.Tensor]:
    """Point ZeRO-3's optimizer copy of each partition at the partition itself, where both
    hold the same dtype on the same device; return the copies so pointed.

    ZeRO-3 means to do this itself (a partition already in the optimizer's dtype is used as
    it is), but compares a tensor's device with a device name, which never holds, so it keeps
    a second copy: 2 bytes a parameter over the ranks in bf16, 4 in float32. Its step copies
    the optimizer's partition into the parameters' one, a copy onto itself once shared.
    """
    shared = []
    own = getattr(outer, "fp16_partitioned_groups_flat", [])
    for flat, partition in zip(outer.fp32_partitioned_groups_flat, own, strict=False):
        if not isinstance(partition, torch.Tensor) or flat.data_ptr() == partition.data_ptr():
            continue
        if (flat.dtype, flat.device, flat.shape) == (
            partition.dtype,
            partition.device,
            partition.shape,
        ):
            flat.data = partition.data
            shared.append(flat)
    return shared


def unshare_partitions(shared: list[torch.Tensor]) -> None:
    """Give each copy :func:`share_partitions` pointed away its own memory again."""
    for flat in shared:
        flat.data = flat.data.clone()


def drop_stale_masters(state: dict[Any, Any], tensors: list[torch.Tensor]) -> None:
    """Drop the master of each stretch whose value is no longer its master rounded: something
    wrote the partition (a checkpoint loaded, a ZeRO-3 ``GatheredParameters`` edit).
    LearnerMasters makes a new master from the value;
    the stretches' own version counters do not see writes through the flat tensor."""
    for tensor in tensors:
        entry = state.get(tensor)
        master = entry.get("master") if entry else None
        if isinstance(master, torch.Tensor) and not torch.equal(
            master.to(device=tensor.device, dtype=tensor.dtype), tensor
        ):
            del entry["master"]  # type: ignore[union-attr]


def clear_zero3_gradients(outer: Any) -> None:
    """Zero ZeRO-3's gradient partitions after a step.

    ZeRO-3 copies a parameter's gradient into its partition at the first micro-batch of an
    accumulation window and adds to it at the others, without clearing in between: a
    parameter whose first gradient of a window comes at a later micro-batch gets the last
    window's added, and one that gets none keeps the last window's (in the norm that
    gradient clipping uses).
    """
    buffer = getattr(outer, "grad_partitions_flat_buffer", None)
    if isinstance(buffer, torch.Tensor):
        buffer.zero_()


def agreement_device(params: list[nn.Parameter]) -> torch.device:
    """Where the ranks' all-reduce of what learned runs."""
    backend = dist.get_backend()
    return torch.device("cpu") if backend == "gloo" or not params else params[0].device


def split_state(
    base: torch.optim.Optimizer,
    flats: dict[int, torch.Tensor],
    segments: dict[int, list[Segment]],
) -> None:
    """Give each stretch its part of state DeepSpeed's own steps made for the flat tensor."""
    for flat_id, pieces in segments.items():
        state = base.state.pop(flats[flat_id], None)
        if not state:
            continue
        for segment in pieces:
            base.state[segment.tensor] = {
                key: value.narrow(0, segment.start, segment.numel).clone()
                if torch.is_tensor(value) and value.shape == flats[flat_id].shape
                else (value.clone() if torch.is_tensor(value) else value)
                for key, value in state.items()
            }


def gather_state(
    base: torch.optim.Optimizer,
    flats: dict[int, torch.Tensor],
    segments: dict[int, list[Segment]],
) -> None:
    """Put the stretches' optimizer state back into flat tensors, for DeepSpeed's own step.

    Element-wise state is copied into place (zeros where a stretch never learned); a
    scalar such as Adam's step count takes the largest value, the count DeepSpeed's flat
    step would have had for the stretches that learned most.
    """
    for flat_id, pieces in segments.items():
        states = [(s, base.state.pop(s.tensor)) for s in pieces if s.tensor in base.state]
        flat = flats.get(flat_id)
        if flat is None or not states:
            continue
        merged: dict[str, Any] = {}
        for segment, state in states:
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == segment.tensor.shape:
                    target = merged.setdefault(key, torch.zeros_like(flat, dtype=value.dtype))
                    target.narrow(0, segment.start, segment.numel).copy_(value)
                elif key not in merged or (torch.is_tensor(value) and value > merged[key]):
                    merged[key] = value
        base.state[flat] = merged
