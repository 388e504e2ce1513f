"""LearnerMasters over sharded parameters: FSDP2's ``fully_shard`` makes each parameter a
``DTensor`` whose rank-local part is all that this rank holds, steps and saves.

Nothing here imports ``torch.distributed`` unless a DTensor is at hand: a tensor can only be a
DTensor once ``torch.distributed.tensor`` is loaded, so a model that never used it pays nothing.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

import torch

from .._plumbing.errors import InvalidOptionError

__all__ = [
    "HELD",
    "checked_held",
    "clip_grad_norm_",
    "is_checkpoint_probe",
    "is_sharded",
    "local",
    "sharded_like",
    "with_held",
]

# in each saved parameter group: how many of its parameters had state (masters and moments)
HELD = "learner_masters_held"


def _dtensor_class() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's parameters, their gradients and state)."""
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard, any other tensor itself.

    >>> import torch
    >>> t = torch.zeros(3)
    >>> local(t) is t
    True
    """
    if is_sharded(tensor):
        part: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
        return part
    return tensor


def sharded_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` laid out as ``param``: a whole (unsharded) state tensor of a sharded parameter
    becomes this rank's shard of it, cut locally as FSDP2 cuts the parameter (no collective);
    anything else is returned as it is."""
    if not is_sharded(param) or is_sharded(value) or value.shape != param.shape:
        return value
    from torch.distributed.tensor import distribute_tensor

    mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]
    return distribute_tensor(value, mesh, placements, src_data_rank=None)


def is_checkpoint_probe(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this ``step()`` is ``torch.distributed.checkpoint``'s probe.

    To learn the layout of an optimizer's state, ``get_optimizer_state_dict`` and
    ``set_optimizer_state_dict`` (the HF Trainer's and Lightning's FSDP2 checkpoints) step an
    optimizer that holds no state once, after setting every learning rate to 0 and a zero
    ``.grad`` on every parameter that requires grad. For LearnerMasters that step would make an
    fp32 master and moments for every parameter of the model: 12 bytes each, the memory that it
    exists to avoid. Only that pattern is recognised; it moves no parameter either way.
    """
    if optimizer.state or not optimizer.param_groups:
        return False
    if any(float(group.get("lr", 1.0)) != 0.0 for group in optimizer.param_groups):
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params if p.requires_grad]  # the probe leaves the frozen alone
    if not grads or any(g is None for g in grads):
        return False
    return not any(bool(local(g).any()) for g in grads if g is not None)


def with_held(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` whose groups count their parameters that have state.

    torch.distributed.checkpoint's sharded load (Lightning's and accelerate's distributed
    checkpoints) reads into a template: the state_dict of a freshly built optimizer. A fresh
    LearnerMasters holds no state, so the masters and moments would not be read, and training
    would go on without them; the groups' counts, which are read, tell that apart from a state
    that was empty when saved.
    """
    saved = state_dict["state"]
    for group in state_dict["param_groups"]:
        group[HELD] = sum(1 for i in group.get("params", ()) if i in saved)
    return state_dict


def checked_held(groups: list[dict[str, Any]], saved: dict[Any, Any]) -> list[dict[str, Any]]:
    """The saved groups without their counts, once each count is met by the saved state."""
    for index, group in enumerate(groups):
        held = group.get(HELD)
        found = sum(1 for i in group.get("params", ()) if i in saved)
        if held is not None and held != found:
            raise InvalidOptionError(
                f"the optimizer state_dict's group {index} held fp32 masters and moments for "
                f"{held} parameters, and {found} arrived: torch.distributed.checkpoint's "
                "sharded load (Lightning's and accelerate's distributed checkpoints) reads only "
                "what a freshly built optimizer holds, and LearnerMasters holds nothing before "
                "its first step. Expected this optimizer's own state_dict() saved per rank, or "
                "a full one (get_optimizer_state_dict(model, optimizer, options="
                "StateDictOptions(full_state_dict=True))) given to load_state_dict "
                "(docs/distributed.md, '70B on one node')."
            )
    return [{k: v for k, v in group.items() if k != HELD} for group in groups]


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, *, norm_type: float = 2.0
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, with the norm the same on any number of ranks.

    The total norm is that of all gradients together, also when they are FSDP2's DTensor
    shards (their parts are summed over the ranks that hold them). Each gradient's sum of
    ``|g| ** norm_type`` is taken in float64, where the squares of bf16, fp16 and fp32 values
    are exact: the norm, rounded to float32, does not depend on how the gradients are cut
    into shards, so a sharded run clips exactly as one process does. torch's own function
    works on DTensor gradients too, but sums bf16 gradients in bf16 per shard, so its norm can
    differ by a bf16 rounding (0.4 %) from one world size to another. Returns the norm.

    >>> import torch, gradgate as gg
    >>> layer = torch.nn.Linear(2, 1, bias=False)
    >>> layer.weight.grad = torch.tensor([[3.0, 4.0]])
    >>> gg.optim.clip_grad_norm_(layer.parameters(), 1.0)
    tensor(5.)
    >>> layer.weight.grad
    tensor([[0.6000, 0.8000]])
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or max_norm < 0:
        raise InvalidOptionError(
            f"max_norm={max_norm!r}; expected a number >= 0, e.g. clip_grad_norm_(params, 1.0)."
        )
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or norm_type <= 0:
        raise InvalidOptionError(
            f"norm_type={norm_type!r}; expected a number > 0 or math.inf, e.g. 2.0."
        )
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    # rounded before it is used: float64 sums of another sharding differ only far below this
    norm = _total_norm(grads, float(norm_type)).to(torch.float32)
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        part = local(grad)
        part.mul_(coefficient.to(part.device, part.dtype))
    return norm


def _total_norm(grads: list[torch.Tensor], p: float) -> torch.Tensor:
    """The norm of all gradients together, in float64 (float32 where a device lacks it)."""
    inf = math.isinf(p)
    sums: dict[Any, torch.Tensor] = {}  # one partial sum per way of being sharded
    for grad in grads:
        grad, key = _readied(grad)
        part = local(grad)
        wide = part.to(torch.float32 if part.device.type == "mps" else torch.float64).abs()
        value = wide.pow(p).sum() if not inf else wide.amax() if wide.numel() else wide.sum()
        found = sums.get(key)
        if found is None:
            sums[key] = value
        else:
            sums[key] = torch.maximum(found, value) if inf else found + value
    totals = [
        v if k is None else _over_ranks(v, k, "max" if inf else "sum") for k, v in sums.items()
    ]
    if inf:
        return torch.stack(totals).amax()
    return torch.stack(totals).sum().pow(1.0 / p)


def _readied(grad: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A gradient whose local part holds final values, and how it is sharded (None: whole)."""
    if not is_sharded(grad):
        return grad, None
    from torch.distributed.tensor import Replicate

    placements = grad.placements  # type: ignore[attr-defined]
    if any(pl.is_partial() for pl in placements):  # not yet summed over the ranks
        placements = [Replicate() if pl.is_partial() else pl for pl in placements]
        grad = grad.redistribute(grad.device_mesh, placements)  # type: ignore[attr-defined]
    return grad, (grad.device_mesh, tuple(pl.is_shard() for pl in placements))  # type: ignore[attr-defined]


def _over_ranks(value: torch.Tensor, key: Any, op: str) -> torch.Tensor:
    """Reduce a local partial sum over the mesh dimensions its gradients are sharded along."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh, shard_dims = key
    placements = [Partial(op) if sharded else Replicate() for sharded in shard_dims]
    return DTensor.from_local(value, mesh, placements).full_tensor()
