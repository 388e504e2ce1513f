"""No optimizer step moves a parameter gradgate keeps from learning.

``optimizer.zero_grad(set_to_none=False)`` leaves a zero ``.grad`` on a parameter that then
gets no gradient (frozen, or in a block cut off by a gate): momentum and weight decay still
move it. Gradients are kept where they carry something the step should apply (earlier
micro-batches of the same step); what carries nothing, or was already applied, is dropped
(``.grad = None``) by global optimizer step hooks, only for the parameters the stepping
optimizer holds. The hooks cost one pass over the guarded parameters per step, nothing per
forward or per block.

Around a gate's blocks (an embedding before the cut, a position embedding the model holds
itself, a norm run between the blocks and frozen before the first learner), what got no gradient
in a step is seen on the ``.grad`` itself: still the tensor the stepping optimizer left at its
last step, unchanged since or all zero (zeroed in place: one host sync, at the first step after
it learned), it carries nothing new. A ``.grad`` written as a new tensor is the user's; one
written into in place, or added to by a separate backward, carries something and is kept.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .._plumbing.errors import GradgateWarning, warn

if TYPE_CHECKING:
    from .stacks import Stacks

_T = TypeVar("_T", bound=torch.Tensor)
LEARNERS_ONLY = "_gradgate_learners_only"  # on the optimizers step_learners_only splits


def drop_zero_grads(params: Iterable[torch.Tensor]) -> None:
    """``.grad = None`` where the gradient is all zero (one host sync for all of them)."""
    held = [p for p in params if p.grad is not None]
    for param in _all_zero(held) if held else ():
        param.grad = None


def _all_zero(params: list[_T]) -> list[_T]:
    """Those of ``params`` (each with a ``.grad``) whose gradient is all zero."""
    if not params:
        return []
    nonzero = torch.stack([_any(p.grad) for p in params]).tolist()  # type: ignore[arg-type]
    return [param for param, carries in zip(params, nonzero, strict=True) if not carries]


def _any(grad: torch.Tensor) -> torch.Tensor:
    """Whether ``grad`` has an element that is not zero, on the CPU; a DTensor's (FSDP2) over
    every rank's shard (a collective: every rank asks about the same parameters)."""
    found = grad.any()
    full = getattr(found, "full_tensor", None)
    return (found if full is None else full()).cpu()


def _writes(grad: torch.Tensor) -> int:
    """How many in-place writes ``grad`` has had: a DTensor's (FSDP2) own and its shard's
    (FSDP2 adds a backward's gradient into the shard, which the DTensor does not count)."""
    local = getattr(grad, "to_local", None)
    return grad._version if local is None else grad._version + local()._version


def _held_by(optimizer: torch.optim.Optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


class FrozenGrads:
    """For parameters frozen by one handle: before a step, an all-zero ``.grad`` is dropped
    (zeroed in place after the freeze); after it, the ``.grad`` it applied is dropped, so a
    later ``zero_grad(set_to_none=False)`` has nothing left to zero."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._params = [weakref.ref(p) for p in params]
        drop_zero_grads(self._frozen())
        self._hooks = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]

    def _frozen(self, optimizer: torch.optim.Optimizer | None = None) -> list[nn.Parameter]:
        params = [p for ref in self._params if (p := ref()) is not None]
        found = [p for p in params if p.grad is not None and not p.requires_grad]
        if found and optimizer is not None:
            held = _held_by(optimizer)
            found = [p for p in found if id(p) in held]
        return found

    def _before_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        drop_zero_grads(self._frozen(optimizer))

    def _after_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        for param in self._frozen(optimizer):
            param.grad = None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class CutGrads:
    """For a gate's blocks: before a step, the ``.grad`` of blocks that learned in no forward
    since the last step is dropped (it is left over from before that step, zeroed or not).

    ``saw(learn, skip, keep)`` is called once per root forward that records a graph, with the
    plan it ran: learning positions (``None``: all), skipped positions, and the ids of the
    parameters of named learning modules. A block found with no such gradient is clean until
    it learns again (its gradients come from the gate's forwards), so a step reads the
    ``.grad`` of a cut-off block only after it learned; a gradient written by hand on a clean
    block is the user's.

    Around the blocks, after forwards that all cut (a depth or a learning set), the ``.grad``
    of a parameter no named module holds is dropped where it is the one the stepping optimizer
    left at its last step and carries nothing new (see the module's docstring). What runs after
    the last stack (a final norm, a head, and the weights tied to it) learns at every plan and
    is not looked at.
    """

    def __init__(
        self,
        points: list[tuple[str, nn.Module]],
        shared: frozenset[int],
        model: nn.Module,
        stacks: Stacks,
        gap: set[int],
    ) -> None:
        self._blocks = [module for _, module in points]
        self._shared = shared  # tied parameters also used outside the blocks
        self._plans: list[tuple[Any, ...]] = []
        self._stepped = False
        self._stale: dict[tuple[tuple[Any, ...], ...], _Stale] = {}  # by plans
        self._clean: set[int] = set()  # blocks found with nothing to drop, not learned since
        self._seen: dict[int, weakref.ref[torch.optim.Optimizer]] = {}  # stepped with a cut
        in_blocks = {id(p) for block in self._blocks for p in block.parameters()}
        self._stacks, self._gap = stacks, gap  # gap: outside modules seen between blocks
        self._around_all = [p for p in model.parameters() if id(p) not in in_blocks]
        self._around: list[nn.Parameter] = []  # those a plan may keep from learning
        self._around_at = -1  # the runs stacks learned plus gap modules seen, then (both grow)
        self._joined: dict[int, weakref.ref[torch.Tensor]] = {}  # looked at since the last step
        # per optimizer: the .grad around the blocks its last step left, and its version
        self._applied: dict[int, tuple[weakref.ref[Any], _Left]] = {}
        self._last: _Left = _left(_with_grad(self._around_all))  # what any step left last
        self._hooks = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]

    def saw(self, learn: Any, skip: Any, keep: Any) -> None:
        if self._stepped:
            self._plans, self._stepped = [], False
        plans = self._plans
        if not plans or plans[-1] != (learn, skip, keep):
            plans.append((learn, skip, keep))

    def _not_learned(self) -> _Stale:
        """The blocks that learned in none of the plans, with their parameters to drop a
        gradient from (plans seen at an earlier step: the same answer, the blocks' parameters
        are not walked again)."""
        plans = tuple(self._plans)
        stale = self._stale.get(plans)
        if stale is None:
            if len(self._stale) >= 64:  # random plans at every step (DropBP): a few at a time
                self._stale.clear()
            stale = self._stale[plans] = self._walk()
        return stale

    def _walk(self) -> _Stale:
        learned: set[int] = set()
        keep: set[int] = set(self._shared)
        everything = range(len(self._blocks))
        cut = all(learn is not None for learn, _, _ in self._plans)  # else all around learned
        named = frozenset().union(*(extra for _, _, extra in self._plans)) if cut else None
        for learn, skip, extra in self._plans:
            if learn is None and not skip:  # no cut: every block learned
                return _Stale({}, frozenset(everything), [], frozenset(), None)
            # a skipped block ran with no graph: it learned nothing, a depth or learning set
            # or no cut at all (learn None) notwithstanding
            learned.update(p for p in (everything if learn is None else learn) if p not in skip)
            keep.update(extra)
        learning = {id(p) for i in learned for p in self._blocks[i].parameters()}
        stale: dict[int, list[nn.Parameter]] = {}
        unclean = set(learned)  # may get a gradient in these plans' forwards
        for i, block in enumerate(self._blocks):
            if i in learned:
                continue
            params = list(block.parameters())
            if any(id(param) in keep for param in params):
                unclean.add(i)  # holds a named learning module
            stale[i] = [p for p in params if id(p) not in keep and id(p) not in learning]
        every = [param for params in stale.values() for param in params]
        cleanable = frozenset(stale) - unclean
        return _Stale(stale, frozenset(unclean), every, cleanable, named)

    def _before_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        if not self._plans:
            return
        stale = self._not_learned()
        if stale.blocks:
            seen = self._seen.get(id(optimizer))
            if seen is None or seen() is not optimizer:  # its first step that leaves one out
                self._seen[id(optimizer)] = weakref.ref(optimizer)
                warn_zero_without_learners_only(optimizer, self._blocks, stale.blocks)
        clean = self._clean
        clean -= stale.unclean  # now a subset of the blocks not learned
        # all found with nothing to drop, none learned since: the usual step
        found = [] if len(clean) == len(stale.blocks) else self._left_in_blocks(stale)
        if stale.named is not None:  # every forward cut: what is around may have learned none
            with_grad = [param for param in self._around_now() if param.grad is not None]
            if with_grad:  # else the usual step: dropped at the first that left them out
                found += self._left_around(optimizer, with_grad, stale.named)
        if found:
            held = _held_by(optimizer)
            for param in found:
                if id(param) in held:
                    param.grad = None

    def _left_in_blocks(self, stale: _Stale) -> list[nn.Parameter]:
        """The cut-off blocks' parameters with a ``.grad``, some of them found clean."""
        clean = self._clean
        if not clean:  # after a step at which they all learned: one pass in C over them all
            found = _with_grad(stale.every)
            if not found:
                clean |= stale.cleanable
            return found
        found = []
        for position in stale.blocks.keys() - clean:
            with_grad = _with_grad(stale.blocks[position])
            found += with_grad
            if not (with_grad or position in stale.unclean):
                clean.add(position)
        return found

    def _left_around(
        self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], named: frozenset[int]
    ) -> list[nn.Parameter]:
        """Those of ``params`` (around the blocks, with a ``.grad``) whose ``.grad`` is what
        ``optimizer``'s last step left and carries nothing new: unchanged since, or all zero
        (zeroed in place). Before its first step: what any step (or the gate's making) left,
        all zero."""
        mine = self._applied.get(id(optimizer))
        left = mine[1] if mine is not None and mine[0]() is optimizer else None
        unchanged, changed = [], []
        for param in params:
            grad = param.grad
            found = (self._last if left is None else left).get(id(param))
            if found is None:  # looked at since the last step (it ran between the blocks)?
                joined = self._joined.get(id(param))
                found = None if joined is None else (joined, -1)  # -1: if all zero
            if found is None or found[0]() is not grad or id(param) in named:
                continue  # a new tensor: this step's, or the user's; or a named learner's
            if left is not None and _writes(grad) == found[1]:  # type: ignore[arg-type]
                unchanged.append(param)
            else:
                changed.append(param)
        if changed:  # perhaps only zeroed in place: one host sync for those it steps
            held = _held_by(optimizer)
            stepped = [param for param in changed if id(param) in held]
            unchanged += _all_zero(stepped) if stepped else []
        return unchanged

    def _around_now(self) -> list[nn.Parameter]:
        """The parameters around the blocks, but those of modules seen running after the last
        stack began and never between its blocks before the first learner (a final norm, a
        head, and a weight tied to it): they learned in every forward so far. Found again only
        when the stacks learned a new run or a gap module was seen."""
        stacks, gap = self._stacks, self._gap
        if self._around_at == stacks.runs + len(gap):
            return self._around
        self._around_at, last = stacks.runs + len(gap), stacks.of[-1] if stacks.of else -1
        after = {
            id(param)
            for index, module in enumerate(stacks.outside)
            if stacks.seen_after(last, index) and index not in gap
            for param in module.parameters()
        }
        known = {id(param) for param in self._around}
        self._around = [p for p in self._around_all if id(p) not in after]
        self._joined = {  # what the last step left on those not looked at then
            id(p): weakref.ref(g)
            for p in self._around
            if id(p) not in known and (g := p.grad) is not None
        }
        return self._around

    def _after_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        self._stepped = True  # the next forward starts the next step's plans
        with_grad = [param for param in self._around_now() if param.grad is not None]
        if self._joined:
            self._joined = {}  # in this step's record now
        applied = self._applied
        if with_grad or id(optimizer) in applied:  # what this step left around the blocks
            if len(applied) >= 16 and id(optimizer) not in applied:  # forget the dead ones
                for key in [key for key, (ref, _) in applied.items() if ref() is None]:
                    del applied[key]
            self._last = _left(with_grad)
            applied[id(optimizer)] = (weakref.ref(optimizer), self._last)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class _Stale(NamedTuple):
    """What the steps after the forwards of some plans look at."""

    blocks: dict[int, list[nn.Parameter]]  # per block not learned: the params to drop from
    unclean: frozenset[int]  # blocks never found clean
    every: list[nn.Parameter]  # all the parameters of ``blocks``
    cleanable: frozenset[int]  # ``blocks``' positions, those in ``unclean`` left out
    named: frozenset[int] | None  # named learners' parameter ids; None: a forward cut nowhere


_Left = dict[int, tuple["weakref.ref[torch.Tensor]", int]]  # param id: its .grad, the version


def _left(params: list[nn.Parameter]) -> _Left:
    """What a step left on ``params`` (each with a ``.grad``)."""
    return {id(p): (weakref.ref(g), _writes(g)) for p in params if (g := p.grad) is not None}


def _with_grad(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Those with a ``.grad``, in a loop in C."""
    return list(compress(params, map(is_not, map(_GRAD, params), repeat(None))))


_GRAD = attrgetter("grad")


def warn_zero_without_learners_only(
    optimizer: torch.optim.Optimizer, blocks: list[nn.Module], stale: dict[int, Any]
) -> None:
    """Warn when ``optimizer`` is the torch optimizer inside a DeepSpeed ZeRO optimizer of the
    blocks' model, with no ``step_learners_only``: ZeRO steps its flat partitions whole, so the
    blocks the plan left out move too. Read from the marks DeepSpeed leaves on the parameters
    (deepspeed itself is not imported)."""
    if getattr(optimizer, LEARNERS_ONLY, None) is not None:
        return
    stage = _zero_stage_of(optimizer, blocks)
    if stage is None:
        return
    left_out = sorted(stale)
    warn(
        f"DeepSpeed {stage} steps each rank's flat partition whole, so the "
        f"{len(left_out)} of {len(blocks)} blocks this step's plan left out (positions "
        f"{', '.join(map(str, left_out))}) are moved all the same: weight decay, momentum and "
        "Adam's step count. Add one line after deepspeed.initialize: "
        "gg.integrations.deepspeed.step_learners_only(engine) (the Hugging Face Trainer's "
        "GateCallback makes this call itself).",
        GradgateWarning,
    )


def _zero_stage_of(optimizer: torch.optim.Optimizer, blocks: list[nn.Module]) -> str | None:
    """How DeepSpeed steps the blocks' parameters with ``optimizer`` (its flat partitions), if
    it does."""
    for block in blocks:
        for param in block.parameters():
            zero3 = getattr(param, "_z3_optimizer", None)  # the ZeRO-3 optimizer, on each one
            if zero3 is not None:
                return "ZeRO stage 3" if getattr(zero3, "optimizer", None) is optimizer else None
            # ZeRO 1 and 2: this rank's stretch of the parameter, a view of a flat partition
            fragment = getattr(getattr(param, "_hp_mapping", None), "hp_fragment", None)
            if isinstance(fragment, torch.Tensor):
                return "ZeRO stage 1 or 2" if _holds_storage_of(optimizer, fragment) else None
    return None


def _holds_storage_of(optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> bool:
    pointer = tensor.untyped_storage().data_ptr()
    return bool(pointer) and any(
        held.untyped_storage().data_ptr() == pointer
        for group in optimizer.param_groups
        for held in group["params"]
    )
