"""LearnerMasters over sharded parameters: FSDP2's ``fully_shard`` makes each parameter a
``DTensor`` whose rank-local part is all that this rank holds, steps and saves.

Nothing here imports ``torch.distributed``: a tensor can only be a DTensor once
``torch.distributed.tensor`` is loaded, so a model that never used it pays nothing.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["local"]


def _dtensor_class() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard, any other tensor itself.

    >>> import torch
    >>> t = torch.zeros(3)
    >>> local(t) is t
    True
    """
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(tensor, dtensor):
        part: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
        return part
    return tensor
