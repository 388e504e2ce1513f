"""A cut's plan in the forms its parts read, each made once per plan.

The tables the block hooks read at every block of every forward: where the cut opens, where it
opens for now, which blocks the hooks can pass over (computed at the first forward that needs
them, so setting a depth stays O(1)). ``learn`` is a range or a set of learning positions
(``None``: no cut), ``skip`` the skipped positions, ``stack_of`` each block's stack.

And :class:`PlanKey`, the plan as integers that every rank can compare
(``BackpropGate(..., check_ranks=True)``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import nn

from .._plumbing.hooks import guard_owners
from .stacks import runs_before


def first_opener(learn: Collection[int] | None, skip: Collection[int], n: int) -> int:
    """Position of the first learning block that is not skipped (``n`` when there is none).

    >>> first_opener(range(3, 5), set(), 5), first_opener({1, 3}, {1}, 5)
    (3, 3)
    >>> first_opener(None, set(), 5)
    5
    """
    learn = learn or ()
    if isinstance(learn, range) and not skip:
        return learn.start
    return min((p for p in learn if p not in skip), default=n)


def opens_after(
    learn: Collection[int] | None, skip: Collection[int], stack_of: list[int], first: int
) -> list[bool]:
    """Per block: whether the cut opens, for now, right after it, when it does not learn: in the
    stack of the first learner ``first`` (of the last block when only what runs after the blocks
    learns); the next non-learner closes it again. So a learner called through ``checkpoint()``
    sees grad on, and LayerDrop cannot keep the cut shut.

    >>> opens_after(range(3, 4), set(), [0, 0, 1, 1], 3)
    [False, False, True, False]
    """
    learn = learn or ()
    stack = stack_of[min(first, len(stack_of) - 1)]
    return [not (p in learn and p not in skip) and of == stack for p, of in enumerate(stack_of)]


# what the block lane does with a block called in order (see cut_blocks.BlockHooks._block_lane)
HOOKED = 0  # its hooks run around it
LEARNER = 1  # after the cut: note that it ran
PREFIX = 2  # before the cut: note that it ran (every step above LEARNER is before the cut)
OPENS = 3  # and open the cut for now after it
OPENS_GAP = 4  # and also freeze the code between it and the first learner
OPENS_LAST = 5  # the last block: and the code after it learns (the freeze ends)


def lane_steps(
    learn: Collection[int] | None,
    skip: Collection[int],
    named_inside: Collection[int],
    after: list[bool],
    first: int,
) -> list[int]:
    """Per block: what the lane does with a call in order. A block that is skipped or holds a
    named learning module always has its hooks run; a learner is ``LEARNER``; a block that does
    not learn is ``PREFIX``, or opens the cut for now after it (``after``, see opens_after), with
    the code up to the first learner ``first`` frozen (up to the last block when no block
    learns: what runs after it learns), or, the last block, ending that freeze.

    >>> lane_steps(range(3, 5), {1}, set(), [True, True, True, False, False], 3)
    [4, 0, 4, 1, 1]
    >>> lane_steps(None, set(), {1}, [True, True, True], 3)
    [4, 0, 5]
    """
    learn, n = learn or (), len(after)
    steps = []
    for position, opens in enumerate(after):
        if position in skip or position in named_inside:
            steps.append(HOOKED)
        elif position in learn:
            steps.append(LEARNER)
        elif opens:
            steps.append(opening_step(position, first, n))
        else:
            steps.append(PREFIX)
    return steps


def opening_step(position: int, first: int, n: int) -> int:
    """What the cut does when it opens for now after block ``position`` (of ``n``; the first
    learner at ``first``, ``n`` for none): freeze the code from there to the first learner (to
    the last block when no block learns), end that freeze after the last block, or neither.

    >>> [opening_step(p, 2, 4) for p in range(4)], [opening_step(p, 4, 4) for p in range(4)]
    ([4, 4, 3, 5], [4, 4, 4, 5])
    """
    if position < min(first, n - 1):
        return OPENS_GAP
    return OPENS_LAST if position == n - 1 else OPENS


class PlanKey:
    """Learning blocks, skipped blocks and the learning modules that are not blocks.

    A module is named by its position in ``model.named_modules()``, the same on every rank that
    built the same model. Positions are looked up once per plan (a new ``extra`` tuple), not
    every step.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> key = PlanKey(model)
    >>> key(frozenset({1}), frozenset(), (model[0],))
    (1, -2, -3, 1)
    >>> key(None, frozenset(), ())
    (-1, -2, -3)
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._extra: tuple[nn.Module, ...] = ()
        self._extra_key: tuple[int, ...] = ()

    def __call__(
        self,
        learn: range | frozenset[int] | None,
        skip: frozenset[int],
        extra: tuple[nn.Module, ...],
    ) -> tuple[int, ...]:
        if extra is not self._extra:
            order = {id(m): i for i, (_, m) in enumerate(self._model.named_modules())}
            self._extra_key = tuple(sorted(order.get(id(m), -4) for m in extra))
            self._extra = extra
        blocks = (-1,) if learn is None else tuple(sorted(learn))
        return (*blocks, -2, *sorted(skip), -3, *self._extra_key)


def plan_learners(gate: Any) -> set[int] | None:
    """The ids of the parameters of the gated model that a gate's plan lets learn, whatever
    their ``requires_grad`` (``None``: no plan, every parameter may learn).

    The plan's rules, read off the mechanism (see ``cut_blocks``): a block learns if the plan
    names it (``depth`` or ``learn``) and does not skip it; a module named in ``learn`` learns;
    an embedding, norm or head around the blocks learns if it runs after the cut opens (under
    a depth), and under a learning set only once the last stack has started (else it is frozen
    for its call; a tied parameter is not). Where each of those runs is what the gate saw
    (see ``Stacks.runs_after``). Parameters held by the model itself or by the containers of
    the blocks are counted as learning: the plan cannot tell where the forward uses them (most
    are used after the blocks, as CLIP's ``logit_scale``). A parameter used in several modules
    learns if one of its uses does.
    """
    learn, skip, extra = gate._learn, gate._skip, gate._extra
    if learn is None and not skip:
        return None
    stacks, points = gate._stacks, gate._points
    n = len(points)
    named = {id(m) for module in extra for m in module.modules()}
    first = first_opener(learn, skip, n)
    opens = _opening_time(gate, first, named)
    last_start = stacks.last_stack_start()
    names = {id(m): name for name, m in gate._model.named_modules()}
    found: set[int] = set()
    for module in gate._model.modules():
        params = [p for p in module._parameters.values() if p is not None]
        if not params or all(id(p) in found for p in params):
            continue
        kind, index = stacks.unit_of(module)
        if kind == "block":
            learns = index not in skip and (learn is None or index in learn or id(module) in named)
        elif kind == "outside":
            learns = learn is None or id(module) in named
            if not learns:
                after = stacks.runs_after(index)
                if after + 0.5 > opens or (first == n and after == n - 1):
                    learns = isinstance(learn, range) or after >= last_start
                    if not learns:  # frozen for its call, but for the tied parameters
                        found.update(id(p) for p in params if id(p) in gate._shared_ids)
                elif _opened_inside(gate, module, index, names, opens):
                    learns = True
        else:
            learns = True
        if learns:
            found.update(id(p) for p in params)
    return found


def learners_under_every_gate(model: nn.Module) -> set[int] | None:
    """The ids of the parameters of ``model`` that the plans of all the gates on it (and on
    modules inside it) let learn, whatever their ``requires_grad``; ``None``: no plan restricts.
    Nested gates: a parameter learns only where every gate around it lets it."""
    found: set[int] | None = None
    for module in model.modules():
        for gate in guard_owners(module):
            if not getattr(gate, "active", False) or not hasattr(gate, "_stacks"):
                continue
            learners = plan_learners(gate)
            if learners is None:
                continue
            if found is None:
                found = {id(p) for p in model.parameters()}
            found -= {id(p) for p in gate._model.parameters()} - learners
    return found


def _opening_time(gate: Any, first: int, named: set[int]) -> float:
    """When the cut opens for good: at the first learning block (its position), at a block
    holding a named module, or at a named module around the blocks (half a step after the
    block before it); infinity when none of these runs."""
    times: list[float] = [float(first)] if first < len(gate._points) else []
    times += [float(p) for p in gate._extra_blocks if p not in gate._skip]
    stacks = gate._stacks
    for index, module in enumerate(stacks.outside):
        if any(id(m) in named for m in module.modules()):
            times.append(stacks.runs_after(index) + 0.5)
    return min(times, default=float("inf"))


def _opened_inside(
    gate: Any, module: nn.Module, index: int, names: dict[int, str], opens: float
) -> bool:
    """Whether ``module`` lies inside an outside module after a named module in it that opened
    the cut there: it runs with grad on, unfrozen (where its parent's forward calls it after
    the named one, see ``stacks.runs_before``). The outside module's own parameters are taken
    to be used after its submodules (ViT's ``cls_token`` after its patch embedding)."""
    stacks = gate._stacks
    outer = stacks.outside[index]
    if stacks.runs_after(index) + 0.5 != opens:
        return False
    inside = {id(m) for m in outer.modules()}
    mine = names.get(id(module), "")
    return any(
        id(named) in inside
        and (module is outer or runs_before(gate._model, names.get(id(named), ""), mine))
        for named in gate._extra
    )
