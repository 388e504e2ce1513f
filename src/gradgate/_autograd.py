"""Finding the tensors inside a module's inputs or outputs (tuples, dicts, model outputs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested value, in order; mappings the pytree does not know (such as
    transformers' ``ModelOutput``) are opened too.

    >>> import torch
    >>> [t.shape[0] for t in tensors_in((torch.ones(1), {"a": torch.ones(2)}, "x"))]
    [1, 2]
    """
    found: list[torch.Tensor] = []
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif isinstance(leaf, Mapping):
            found.extend(tensors_in(list(leaf.values())))
    return found
