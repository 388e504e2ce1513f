"""One training step simulated on the fake twin, per row: forward, backward, two optimizer
steps and ``zero_grad``, with the live bytes followed by a :class:`StepCounter`.

The first ``step()`` makes the optimizer's state (and masters). torch's optimizers make all of
it before any temporary, so their first step peaks as high as every later one; another
optimizer (``LearnerMasters``) steps twice, the second a steady-state step. The state ``S``
left after ``zero_grad`` is alive during every later forward and backward too, so the row's
peak is the largest of: the forward's peak + ``S``, the backward's peak + ``S`` and the
steps' own peaks. That is the peak of a training loop over its first two steps and every
later one, without running a second forward and backward.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._cut.gate import BackpropGate
from .._plumbing.autograd import observe_saved, tensors_in
from .._plumbing.errors import BlockCallWarning, PlanNotAppliedWarning, SharedParameterWarning
from .._plumbing.torch_internals import storage_key
from .counter import HOST, StepCounter
from .options import StepOptions
from .replay import PrefixReplay
from .sharding.engine import Engine

Plan = int | frozenset[int | str] | None  # a depth, a learning set, or None: no cut at all


@dataclass(frozen=True)
class Figures:
    """What one simulated step measured (bytes)."""

    grad_bytes: int
    optimizer_bytes: int
    saved_bytes: int
    peak_bytes: int
    peak_phase: str
    other_bytes: int


class StepSimulator:
    """Runs the planned step on ``twin`` (fake) with ``gate`` set to each row's plan."""

    def __init__(
        self,
        twin: nn.Module,
        gate: BackpropGate,
        inputs: tuple[tuple[Any, ...], dict[str, Any]],
        options: StepOptions,
        real_limit: int,
        replay: PrefixReplay | None = None,
        engine: Engine | None = None,
    ) -> None:
        self._twin, self._gate, self._replay = twin, gate, replay
        self._engine = engine or Engine()
        self._args, self._kwargs = inputs
        self._options = options
        self._real_limit = real_limit
        self._params = list(twin.parameters())
        self._model_tensors = [*self._params, *twin.buffers()]
        self._inputs = tensors_in((self._args, self._kwargs))
        self._model_storages = {_storage(t) for t in self._model_tensors}
        engine = self._engine
        self.param_bytes = sum(engine.param_bytes(p) for p in self._params) + engine.model_extra()
        self._names = {id(p): name for name, p in twin.named_parameters()}
        self.trainable = tuple(n for n, p in twin.named_parameters() if p.requires_grad)
        self.learners: tuple[str, ...] = ()  # the last row's parameters that got a gradient
        self.phase = "forward"  # the last row's last phase: "forward", "backward", "step1"...

    def run(self, plan: Plan) -> Figures:
        """Set the gate to ``plan`` and simulate one step."""
        if isinstance(plan, int):
            self._gate.depth = plan
        elif plan is None:
            self._gate.depth = None
        else:
            self._gate.learn = plan
        counter = StepCounter(
            round_to=512 if self._options.device == "cuda" else 1, real_limit=self._real_limit
        )
        learnable = [p for p in self._params if p.requires_grad]
        engine = self._engine
        with counter, _quiet():
            for tensor in self._model_tensors:
                shared = isinstance(tensor, nn.Parameter)
                counter.track(tensor, "model", engine.param_bytes(tensor) if shared else None)
            for tensor in self._inputs:
                counter.track(tensor, "other")
            buffers = engine.start(counter, learnable)  # the engine's own, all step long
            hooks = [p.register_post_accumulate_grad_hook(counter.grad_ready) for p in learnable]
            if self._replay is not None:
                self._replay.counter = counter
            try:
                return self._step(counter, learnable)
            finally:
                self.phase = counter.phase  # where a failed step stopped
                if self._replay is not None:
                    self._replay.counter = None
                for hook in hooks:
                    hook.remove()
                del buffers

    def _step(self, counter: StepCounter, learnable: list[nn.Parameter]) -> Figures:
        start = counter.live
        saved = _SavedBytes(self._model_storages, counter)
        counter.phase = "forward"
        counter.mark()
        with torch.enable_grad(), observe_saved(saved.add), self._autocast():
            loss = loss_of(self._twin(*self._args, **self._kwargs))
        counter.phase = "backward"
        if loss is not None and loss.requires_grad:
            loss.backward()
            self._engine.after_backward()
        del loss
        learners = [p for p in learnable if p.grad is not None]
        self.learners = tuple(self._names[id(p)] for p in learners)
        grad_bytes = self._engine.grads_held(learners)
        state_bytes, made = 0, (0, 0)
        stepped = self._engine.stepped(learnable, counter) if learnable else []
        if stepped:
            optimizer = self._options.make_optimizer(stepped)
            before = (counter.bytes["state"], counter.bytes[HOST])
            counter.phase = "step1"
            with self._options.stepping():
                optimizer.step()
            state_bytes = self._label_state(counter, optimizer)
            made = (counter.bytes["state"] - before[0], counter.bytes[HOST] - before[1])
            if self._options.masters:  # torch's own optimizers: the first step is as high
                counter.phase = "step"
                with self._options.stepping():
                    optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self._engine.finish(learnable)
        kept = counter.live - start  # optimizer state and masters: alive in every later step
        peak, phase, other = _peak(counter, kept, start, made)
        state_bytes += self._engine.masters_held()
        return Figures(grad_bytes, state_bytes, saved.total, peak, phase, other)

    def _autocast(self) -> Any:
        amp = self._options.amp
        return contextlib.nullcontext() if amp is None else torch.autocast("cpu", dtype=amp)

    def _label_state(self, counter: StepCounter, optimizer: torch.optim.Optimizer) -> int:
        """Mark the optimizer's state (and masters) as such; its exact bytes. On a CUDA target
        the ``step`` counts of non-fused optimizers live in host memory, as torch keeps them."""
        total = 0
        on_host = self._options.device == "cuda" and not self._options.fused
        for entry in optimizer.state.values():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    total += value.nbytes
                    host = on_host and key == "step" and value.dim() == 0
                    counter.relabel(value, HOST if host else "state")
        return total


def _peak(
    counter: StepCounter, kept: int, start: int, made: tuple[int, int]
) -> tuple[int, str, int]:
    """The row's peak, its phase and its ``other`` bytes, from the per-phase peaks. ``made``:
    the optimizer state's bytes on the device and on the host. During the first step the
    state was not labelled yet; torch's optimizers make it all before any temporary."""
    candidates: dict[str, tuple[int, int]] = {}
    for phase in ("forward", "backward"):
        if phase in counter.peaks:
            candidates[phase] = (counter.peaks[phase] + kept, counter.at_peak[phase]["other"])
    if "step" in counter.peaks:
        candidates["step"] = (counter.peaks["step"], counter.at_peak["step"]["other"])
    if "step1" in counter.peaks:
        first = counter.peaks["step1"] - made[1]  # the host's step counts were counted
        if first > candidates.get("step", (-1, 0))[0]:
            other = counter.at_peak["step1"]["other"] - sum(made)
            candidates["step"] = (first, max(other, 0))
    if not candidates:
        return start + kept, "forward", 0
    phase = max(candidates, key=lambda name: candidates[name][0])
    return candidates[phase][0], phase, candidates[phase][1]


def loss_of(output: Any) -> torch.Tensor | None:
    """What the step backpropagates: the output's ``loss`` (transformers with ``labels=``),
    else the sum of its floating tensors that require grad (``out.sum().backward()``). The
    output itself is dropped, as a training step drops it before backward."""
    loss = None if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    total: torch.Tensor | None = None
    for tensor in tensors_in(output):
        if tensor.requires_grad and tensor.is_floating_point():
            total = tensor.sum() if total is None else total + tensor.sum()
    return total


class _SavedBytes:
    """Bytes of distinct storages saved for backward, model storages left out (the rule of
    ``gg.audit``); each saved storage is also marked ``saved`` in the counter. A plain weak
    reference tells a storage still alive: torch's own ``StorageWeakRef`` kept the storage's
    Python object, and so the counter's count of it, alive after autograd freed it (2.6)."""

    def __init__(self, exclude: set[int], counter: StepCounter) -> None:
        self._exclude = exclude
        self._alive: dict[int, Any] = {}
        self._counter = counter
        self.total = 0

    def add(self, tensor: torch.Tensor) -> None:
        self._counter.saved(tensor)
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        earlier = self._alive.get(key)
        if key in self._exclude or (earlier is not None and earlier() is not None):
            return
        self._alive[key] = weakref.ref(storage)
        self.total += int(storage.nbytes())


def _storage(tensor: torch.Tensor) -> int:
    return storage_key(tensor.untyped_storage())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        # A row where nothing learns is an answer here (zero bytes), not a slip.
        warnings.filterwarnings("ignore", "nothing that runs after the cut", BlockCallWarning)
        # A tied weight used before and after the cut: what it means for training, not memory.
        warnings.filterwarnings("ignore", category=SharedParameterWarning)
        # Rows of gg.learn_rows that a depth does not reach: zero bytes is the answer.
        warnings.filterwarnings("ignore", "the rows that gg.learn_rows", PlanNotAppliedWarning)
        yield
