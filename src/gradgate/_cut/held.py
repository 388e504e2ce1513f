"""Parameters a gated forward froze, kept frozen until backward is done with its graph; and the
missing-gradient guard, which checks what a forward's backward gave the plan's learners."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .._plumbing.autograd import leaf_variable, tensors_in, walk
from .._plumbing.errors import MissingGradientWarning, warn
from .._plumbing.torch_internals import queue_after_backward, storage_key
from .frames import grad_held_off


class Learners:
    """The modules one forward's graph gives gradients to: ``find()`` names them, only when a
    later forward before the backward freezes something (rarely: most steps have one forward and
    freeze nothing). Forwards with equal ``key`` have the same learners."""

    __slots__ = ("_find", "key")

    def __init__(
        self, key: tuple[Any, ...] = (), find: Callable[[], Iterable[nn.Module]] = tuple
    ) -> None:
        self.key, self._find = key, find

    @classmethod
    def of_run(
        cls,
        points: list[tuple[str, nn.Module]],
        ran: set[int],
        learn: range | frozenset[int] | None,
        skip: frozenset[int],
        extra: tuple[nn.Module, ...],
    ) -> Learners:
        """The blocks at ``ran`` (positions) that learn and are not skipped, and ``extra``."""

        def find() -> list[nn.Module]:
            blocks = [p for p in ran if learn is not None and p in learn and p not in skip]
            return [*(points[p][1] for p in blocks), *extra]

        return cls((learn, skip, extra, ran), find)

    def parameter_ids(self) -> set[int]:
        return {id(param) for module in self._find() for param in module.parameters()}


def graph_of(output: Any) -> list[torch.Tensor]:
    """The tensors in ``output`` that backward can start from."""
    return [tensor for tensor in tensors_in(output) if tensor.requires_grad]


class HeldFrozen:
    """Blocks frozen during a forward look frozen until its backward (activation checkpointing
    recomputes them there, with no module hook around, and must see the same flags).

    A parameter that learned in an earlier forward whose backward has not run yet (micro-batches
    with their own plans, one backward of the summed loss) is given back at once instead:
    autograd skips a leaf that no longer requires grad, and that forward's gradient would be lost.
    """

    def __init__(self) -> None:
        self.params: list[nn.Parameter] = []
        # what the forwards whose backward is pending learn: ids, and modules not looked up yet
        self._learned: set[int] = set()
        self._learners: list[Learners] = []
        # a plan changed after a forward: told when a backward starts (see _Cut._plan_changing)
        self.watch: weakref.WeakMethod[Callable[[], None]] | None = None

    def hold(
        self, params: list[nn.Parameter], graph: list[torch.Tensor], learners: Learners
    ) -> None:
        """Hold ``params`` frozen until the backward from ``graph`` (a forward's output tensors
        that require grad) is done."""
        if not graph:
            _give_back(params)
            return
        if params and (self._learners or self._learned):
            pending = self._pending()
            _give_back([p for p in params if id(p) in pending])
            params = [p for p in params if id(p) not in pending]
        self.params.extend(params)
        if not self._learners or self._learners[-1].key != learners.key:
            self._learners.append(learners)
        if len(self._learners) > 16:  # forwards with no backward (an evaluation with grad on)
            self._pending()
        queued: list[bool] = []

        def at_backward(*grads: Any) -> None:
            if not queued:
                queued.append(True)
                if self.watch is not None:
                    _call(self.watch)
                queue_after_backward(self.backward_done)  # else released at the next forward

        for tensor in graph:
            node = tensor.grad_fn  # a hook on the node: cheaper than a tensor's first hook
            (tensor.register_hook if node is None else node.register_prehook)(at_backward)

    def release(self) -> None:
        """Give back every parameter held frozen."""
        held, self.params = self.params, []
        _give_back(held)

    def backward_done(self) -> None:
        self.release()
        self._learned.clear()
        self._learners.clear()

    def _pending(self) -> set[int]:
        for learners in self._learners:
            self._learned |= learners.parameter_ids()
        self._learners.clear()
        return self._learned


def call_at_backward(
    callback: weakref.WeakMethod[Callable[[], None]],
    nodes: Iterable[Any] = (),
    param: nn.Parameter | None = None,
) -> Any:
    """Have ``callback`` called when a backward reaches one of the autograd ``nodes`` (their
    hooks go with their graph) or ``param`` (its hook comes off when that backward ends). Held
    weakly: a graph may outlive the gate that watches it. Returns the handle of ``param``'s
    hook (``None`` without one): a backward may never reach it, and the caller removes it."""

    def reached(*grads: Any) -> None:
        _call(callback)

    for node in nodes:
        node.register_prehook(reached)
    if param is None:
        return None
    handles: list[Any] = []

    def once(grad: torch.Tensor) -> None:
        queue_after_backward(handles[0].remove)  # not while autograd runs the hooks
        reached()

    handles.append(param.register_hook(once))
    return handles[0]


def _call(callback: weakref.WeakMethod[Callable[[], None]]) -> None:
    method = callback()
    if method is not None:
        method()


def _give_back(params: list[nn.Parameter]) -> None:
    for param in params:
        param.requires_grad_(True)


# -- the missing-gradient guard ------------------------------------------------------------------
class MissingGradients:
    """After the backward of the first forward under each plan (of the first 64): warns
    (:class:`~gradgate.MissingGradientWarning`, once per cause) about parameters the plan says
    learn that got no gradient, where that forward shows why. A parameter is only named with
    evidence that its gradient was meant to come: its block ran with grad off inside a forward
    with grad on (reentrant checkpointing), its block's output carried no graph, the gradient
    reached its block's output but not it (a detach inside), the next block's input was a
    detached copy of its block's output, or its ``requires_grad`` went off after the forward.
    A module outside the loss's graph (an unused head, a block whose output the loss ignores)
    shows none of these, so it is never named. Nothing runs at the forwards in between: one
    flag is read."""

    LIMIT = 64

    def __init__(self) -> None:
        self.pending = True  # the next forward with grad is the first of a plan
        self._checked: set[Any] = set()
        self._said: set[str] = set()
        self._watch: GradientWatch | None = None  # the last one, until its backward

    def arm(self, key: Any) -> GradientWatch | None:
        """A forward with grad under plan ``key`` starts: watch it if it is the plan's first."""
        self.pending = False
        if key in self._checked or len(self._checked) >= self.LIMIT:
            return None
        self.release()  # a watched forward that never had its backward: forget it
        self._watch = GradientWatch(self, key)
        return self._watch

    def release(self) -> None:
        """Take the hooks of a watch still waiting for its backward off the parameters (at the
        next watch, and when the gate is removed: no trace)."""
        if self._watch is not None:
            self._watch.release()
            self._watch = None

    def new_plan(self) -> None:
        """The gate made the tables of a plan it had not seen lately (see _Cut._first_opener):
        the next forward with grad is that plan's first."""
        self.pending = len(self._checked) < self.LIMIT

    def done(self, key: Any) -> None:
        self._checked.add(key)

    def say(self, cause: str, message: str) -> None:
        if cause not in self._said:
            self._said.add(cause)
            warn(message, MissingGradientWarning)


class GradientWatch:
    """What one watched forward showed, and the check at the end of its backward."""

    def __init__(self, owner: MissingGradients, key: Any) -> None:
        self.owner, self.key = owner, key
        self.no_grad: set[int] = set()  # learning blocks that ran with grad off
        self.no_graph: set[int] = set()  # learning blocks whose output carried no graph
        self.reached: set[int] = set()  # learning blocks whose output got a gradient
        self.detached: dict[int, int] = {}  # block -> the block whose output was detached
        self.connected: dict[int, set[int]] = {}  # block -> parameters its output's graph reaches
        self._inputs: set[Any] = set()  # the graph nodes of the running block's input
        # the last block and its output's storages (addresses, not tensors: holding the tensors
        # would keep them alive through backward, memory no plain step has)
        self._last: tuple[int, set[int]] | None = None
        self._got: set[int] = set()
        self._hooks: list[Any] = []
        self._expected: dict[int, tuple[nn.Parameter, str]] = {}
        self._blocks: dict[int, int] = {}  # parameter id -> its block
        self._names: list[str] = []

    def entered(self, position: int, learns: bool, args: Any, grad_before: bool) -> None:
        if learns and grad_before and not torch.is_grad_enabled() and not grad_held_off():
            self.no_grad.add(position)  # off, and not by a gate (nested gates: another's cut)
        self._inputs = {t.grad_fn for t in tensors_in(args) if t.grad_fn is not None}
        if self._last is not None and torch.is_grad_enabled():
            previous, storages = self._last
            given = tensors_in(args)[:1]
            if given and not given[0].requires_grad and _storage(given[0]) in storages:
                self.detached[position] = previous

    def exited(self, position: int, learns: bool, module: nn.Module, output: Any) -> None:
        tensors = tensors_in(output)
        graph = [t for t in tensors if t.requires_grad]
        self._last = (position, {_storage(t) for t in graph} - {0})
        inputs, self._inputs = self._inputs, set()  # graph nodes held past the block: memory
        if not learns or not torch.is_grad_enabled() or position in self.no_grad:
            return
        if not graph:
            if any(p.requires_grad for p in module.parameters()):
                self.no_graph.add(position)
            return
        nodes = list({id(t.grad_fn): t.grad_fn for t in graph if t.grad_fn is not None}.values())
        for node in nodes:
            node.register_prehook(lambda *grads, p=position: self.reached.add(p))
        # the block's own graph: down to its input, not the blocks before
        leaves = (leaf_variable(n) for n in walk(nodes, enter=lambda n: n not in inputs))
        self.connected[position] = {id(leaf) for leaf in leaves if leaf is not None}

    def after_forward(
        self,
        learners: set[int] | None,
        model: nn.Module,
        points: list[tuple[str, nn.Module]],
        ran: set[int],
        graph: list[torch.Tensor],
    ) -> None:
        """The forward ended: note its learners' flags, watch them, check after its backward."""
        if not graph:  # nothing to backward: the next forward under this plan is watched
            self.owner.pending = True
            return
        in_block = {id(p): i for i, (_, m) in enumerate(points) if i in ran for p in m.parameters()}
        for name, param in model.named_parameters():
            if param.requires_grad and (learners is None or id(param) in learners):
                self._expected[id(param)] = (param, name)
                self._hooks.append(param.register_hook(self._got_one(id(param))))
        self._blocks = {k: v for k, v in in_block.items() if k in self._expected}
        self._names = [name for name, _ in points]
        queued: list[bool] = []

        def at_backward(*grads: Any) -> None:
            if not queued:
                queued.append(True)
                queue_after_backward(self.check)

        for tensor in graph:
            node = tensor.grad_fn
            (tensor.register_hook if node is None else node.register_prehook)(at_backward)

    def _got_one(self, key: int) -> Callable[[torch.Tensor], None]:
        def got(grad: torch.Tensor) -> None:
            self._got.add(key)

        return got

    def release(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def check(self) -> None:
        if self.owner._watch is not self:
            return  # released: a later watch or the gate's removal came first
        self.owner.release()
        self.owner.done(self.key)
        causes: dict[str, list[str]] = {}
        for key, (param, name) in self._expected.items():
            if param.grad is not None and param.requires_grad:
                continue
            if not param.requires_grad:  # went off after the forward
                if key in self._got:  # in the graph: computed, then dropped
                    causes.setdefault("late", []).append(name)
                continue
            block = self._blocks.get(key)
            if key in self._got or block is None:
                continue  # no evidence outside the blocks: maybe not in the loss by design
            cause = self._cause(block, key)
            if cause:
                causes.setdefault(cause, []).append(self._names[block])
        for cause, where in causes.items():
            self.owner.say(cause, _message(cause, list(dict.fromkeys(where)), self))

    def _cause(self, block: int, key: int) -> str:
        if block in self.no_grad:
            return "reentrant"
        if block in self.no_graph:
            return "no graph"
        if block in self.reached and key not in self.connected.get(block, ()):
            return "inside"  # (in its graph but not computed: a backward with inputs=)
        after = [b for b, previous in self.detached.items() if previous >= block]
        return f"between {self.detached[min(after)]}" if after else ""


def _storage(tensor: torch.Tensor) -> int:
    """Which storage the tensor views (no data pointer read, so fake tensors answer too); 0 for
    a tensor with none."""
    try:
        return storage_key(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return 0


def _message(cause: str, where: list[str], watch: GradientWatch) -> str:
    named = ", ".join(repr(n) for n in where[:6]) + (
        f" and {len(where) - 6} more" if len(where) > 6 else ""
    )
    if cause == "late":
        return (
            f"{named} learn under the plan and required grad when the forward ran, but not at "
            "its backward: requires_grad changed after the forward, so backward computed their "
            "gradient and dropped it (no .grad, the work done). Freeze before the forward "
            "(gg.freeze(...) or requires_grad_(False) before calling the model)."
        )
    if cause == "reentrant":
        return (
            f"{named} learn under the plan but got no gradient: they ran with grad off inside a "
            "forward that had it on, as reentrant activation checkpointing runs them "
            "(torch.utils.checkpoint with use_reentrant=True), and their input needed no grad "
            "(it came from the cut or from frozen modules), so backward never recomputed them. "
            "Fix: checkpoint(..., use_reentrant=False) (transformers 5.23 and later: "
            "activation_checkpointing_enable({'use_reentrant': False}); before: "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
            "False})), or an input that "
            "requires grad (transformers: model.enable_input_require_grads())."
        )
    if cause == "no graph":
        return (
            f"{named} learn under the plan but got no gradient: they ran with grad on, yet their "
            "output carried no graph (a detach or torch.no_grad at their end, or reentrant "
            "checkpointing whose input needs no grad). Return an output that keeps the graph."
        )
    if cause == "inside":
        return (
            f"parameters of {named} learn under the plan but got no gradient, though the "
            "gradient reached the block's output: inside it, a detach, torch.no_grad, .data, or "
            "a weight copy made while they were frozen (autocast's cache) cut them off. Use the "
            "parameters themselves with grad on."
        )
    previous = watch._names[int(cause.split()[1])]
    return (
        f"{named} learn under the plan but got no gradient: the input of the block after "
        f"{previous!r} was a detached copy of its output (the same storage, needing no grad), so "
        "the backward stopped there. Remove the .detach() (or .data) between the blocks."
    )
