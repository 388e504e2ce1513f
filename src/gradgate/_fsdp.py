"""FSDP2 with a per-step plan: no backward all-gather for blocks backward does not run through."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ._errors import GradgateError


def apply_plan_to_fsdp(
    block_modules: Sequence[nn.Module], in_backward: Sequence[bool]
) -> Callable[[], None]:
    """Stop FSDP2 from all-gathering blocks that backward does not run through this step.

    ``in_backward[i]`` is whether block ``i`` takes part in backward: it learns, or a block
    before it learns so the gradient passes through it. Blocks that ran with no graph (before
    the cut, or skipped) do not, yet FSDP2's backward prefetch all-gathers the last of them;
    ``set_unshard_in_backward(False)`` on them makes backward all-gather exactly the learning
    units. Returns a function that restores the previous settings. Blocks that are not
    ``fully_shard``-ed are left alone.

    >>> restore = apply_plan_to_fsdp([nn.Linear(2, 2)], [False])  # not FSDP: no-op
    >>> restore()
    """
    if len(block_modules) != len(in_backward):
        raise GradgateError(
            f"apply_plan_to_fsdp got {len(block_modules)} blocks and {len(in_backward)} "
            "in_backward flags; expected one flag per block."
        )
    previous: list[tuple[Any, bool]] = []
    for module, needed in zip(block_modules, in_backward, strict=True):
        for group in [] if needed else _fsdp_param_groups(module):
            previous.append((group, group.unshard_in_backward))
            group.unshard_in_backward = False

    def restore() -> None:
        for group, value in reversed(previous):
            group.unshard_in_backward = value
        previous.clear()

    return restore


def _fsdp_param_groups(module: nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    if not isinstance(module, FSDPModule):
        return []
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # newer torch: several per module
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)  # earlier: at most one
        groups = [] if group is None else [group]
    # torch before set_unshard_in_backward has no such setting: nothing to change there
    return [group for group in groups if hasattr(group, "unshard_in_backward")]
