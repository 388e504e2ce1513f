"""How deep can I afford? ``estimate`` predicts a training step's memory per depth.

It runs one whole training step per depth (or learning set) on a *fake* twin of the model: the
same modules, with parameters, buffers and floating inputs replaced by ``FakeTensorMode``
tensors, which have shapes, dtypes and storages but no memory. Forward, backward (saved
activations freed as autograd frees them, checkpointed blocks recomputed), the optimizer's
``step()`` as torch runs it on the target device and ``zero_grad`` all run on fake tensors,
and a dispatch mode follows the bytes alive after every op (``counter``, ``step``). Nothing of
the user's model changes. Per row:

* **peak** — the most bytes alive at once, in which phase, and the part of it that is neither
  parameters, gradients, optimizer state nor saved activations (``other``);
* **saved** — the bytes autograd saves for backward (saved-tensor hooks, each storage once,
  parameters and buffers left out: the same rule as ``gg.audit``);
* **grads** and **optimizer** — the learners' gradients and the state the optimizer made;
* **params** — every parameter of the model, learning or not.

Fake tensors on the CPU make torch pick the kernels a real CPU run picks (fused attention saves
its output and log-sum-exp, not the attention matrix, as on a GPU), which the ``meta`` device
does not.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from .._cut.gate import BackpropGate
from .._plumbing.errors import EstimateError, GradgateError
from .._plumbing.torch_internals.planner import (
    fake_tensor_mode,
    unwrap_compiled,
    value_dependent_errors,
)
from .._select.names import Pattern, check_module, resolve_blocks
from .memory_plan import MemoryPlan, MemoryRow, Replanner
from .options import (
    OPTIMIZERS,
    LearnSet,
    StepOptions,
    amp_option,
    depths_option,
    depths_shape,
    device_option,
    dtype_name,
    dtype_option,
    learn_option,
    masters_option,
    misspelt_options,
    nothing_to_plan,
    optimizer_option,
    planned_optimizer,
    shard_option,
    world_option,
)
from .replay import PrefixReplay
from .sharding import engine_for
from .step import Plan, StepSimulator
from .twin import eager, fake_twin, light_inputs, meta_copy, step_inputs


def estimate(
    model: nn.Module,
    *example_args: Any,
    depths: Iterable[int] | None = None,
    learn: Iterable[LearnSet] | None = None,
    optimizer: str = "adamw",
    dtype: torch.dtype | str | None = None,
    amp: torch.dtype | str | None = None,
    masters: str | None = None,
    device: torch.device | str | None = None,
    blocks: Sequence[Pattern] | str | None = None,
    world: int = 1,
    shard: str | None = None,
    deepspeed: dict[str, Any] | str | None = None,
    **example_kwargs: Any,
) -> MemoryPlan:
    """Predict the memory of one training step of ``model(*example_args, **example_kwargs)``
    for each depth (default 0, 1, 2, 4, ... and all blocks) or each learning set in ``learn``.

    ``model`` may live on the ``meta`` device (a 70B model is planned with no weight memory)
    or be compiled (its module is planned); inputs may be real or ``meta`` tensors. The step
    is simulated whole: forward, backward from the output's ``loss`` (pass ``labels=`` to a
    transformers model) or else from the sum of the outputs, the optimizer's ``step()`` and
    ``zero_grad``. ``dtype`` plans parameters (and floating inputs) cast to it, e.g.
    ``"bf16"``; ``amp="bf16"`` runs the forward under ``torch.autocast``, the weights as they
    are; ``masters="fp32"`` plans ``gg.optim.LearnerMasters`` over low-precision weights;
    ``optimizer`` is ``"adamw"``, ``"adamw_fused"``, ``"adam"``, ``"sgd_momentum"``,
    ``"sgd"`` or ``"adafactor"`` (torch's, factored). ``device`` is whose rules the step
    follows: ``"cuda"`` (foreach optimizers, 512-byte allocations) or ``"cpu"`` (for-loop
    optimizers); by default the model's, and ``"cuda"`` for a meta model. Gradient
    checkpointing set on the model is followed, in the mode (train or eval) the model is in.
    ``blocks`` names the block sequence as for :class:`BackpropGate`. The model itself is
    never changed.

    ``world=N`` with ``shard="ddp"``, ``"fsdp2"``, ``"zero1"``, ``"zero2"`` or ``"zero3"`` plans
    one GPU of ``N``: every row is the bytes of the rank that holds the most, its parameters,
    gradients, masters and optimizer state divided as that engine divides them (padding
    included), and its peak with what the engine gathers and reduces around each block (FSDP2:
    ``fully_shard`` on each block and on the model; ZeRO: DeepSpeed's rules, stepped through
    ``step_learners_only``; ``deepspeed=`` a config, dict or JSON path, for its buckets). The
    example batch is one rank's micro-batch. See docs/depth-fits.md, "Per rank".

    The example batch is ``example_args`` and every keyword ``estimate`` does not take, passed
    to the forward as they are. A keyword that reads as one of the options above misspelt
    (``mastres=``, ``depth=``, ``torch_dtype=``: case ignored, difflib ratio 0.75 or more) is
    refused with the option it resembles, unless the forward names it as a parameter: a forward
    with ``**kwargs`` (every transformers model) would drop it without a word.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    >>> plan = gg.estimate(net, torch.randn(64, 512))
    >>> [row.depth for row in plan.rows]
    [0, 1, 2, 4, 8]
    >>> plan.fits("32MiB")  # plans depths 6 and 7 to answer among all depths
    6
    >>> [row.depth for row in plan.rows]
    [0, 1, 2, 4, 6, 7, 8]
    >>> plan[8].peak_phase
    'step'
    """
    check_module(model)
    misspelt_options(example_kwargs, unwrap_compiled(model), _OPTIONS)
    learn_sets, chosen = learn_option(learn), depths_shape(depths)
    with StepPlanner(
        model,
        example_args,
        example_kwargs,
        optimizer=optimizer,
        dtype=dtype,
        amp=amp,
        masters=masters,
        device=device,
        blocks=blocks,
        world=world,
        shard=shard,
        deepspeed=deepspeed,
    ) as planner:
        plans: list[Plan] = [
            *depths_option(chosen, planner.blocks, default=learn is None),
            *learn_sets,
        ]
        if not plans:
            raise nothing_to_plan(chosen)
        rows = [planner.row(plan) for plan in plans]
    return planner.result(rows)


_OPTIONS = [
    parameter.name
    for parameter in inspect.signature(estimate).parameters.values()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
]


class StepPlanner:
    """The fake twin of a model with a gate on it, its options checked; ``row(plan)`` plans
    one step (a depth, a learning set, or ``None``: a full fine-tune). A context manager: the
    fake mode and the gate live inside the ``with`` block only."""

    def __init__(
        self,
        model: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        optimizer: str = "adamw",
        dtype: torch.dtype | str | None = None,
        amp: torch.dtype | str | None = None,
        masters: str | None = None,
        device: torch.device | str | None = None,
        blocks: Sequence[Pattern] | str | None = None,
        replay: bool = True,
        world: int = 1,
        shard: str | None = None,
        deepspeed: dict[str, Any] | str | None = None,
        options: StepOptions | None = None,
    ) -> None:
        check_module(model)
        model = unwrap_compiled(model)
        if options is None:  # given: checked already (a planner made again by replanner())
            cast = dtype_option(dtype)
            world = world_option(world)
            options = StepOptions(
                optimizer=optimizer_option(optimizer),
                cast=cast,
                amp=amp_option(amp),
                masters=masters_option(masters, model, cast),
                device=device_option(device, model),
                world=world,
                shard=shard_option(shard, world),
                deepspeed=deepspeed,
            )
        self._options = options
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        self._engine = engine_for(
            options.shard, options.world, options.device, options.deepspeed, hidden,
            options.optimizer, options.masters,
        )  # fmt: skip
        self._model, self._inputs, self._blocks = model, (args, kwargs), blocks
        self._replay = replay
        self._stack = contextlib.ExitStack()
        self.blocks = 0
        self.block_names: list[str] = []

    def __enter__(self) -> StepPlanner:
        mode = fake_tensor_mode()
        twin = fake_twin(self._model, mode, self._options.cast)
        args, kwargs = self._inputs  # real integers made outside the fake mode
        fake_args, fake_kwargs, limit = step_inputs(args, kwargs, mode, self._options.cast)
        stack = self._stack.__enter__()
        try:
            stack.enter_context(mode)
            stack.enter_context(eager())
            stack.enter_context(_collector_skips_what_exists())
            found = _blocks_of(twin, self._blocks)
            replay = PrefixReplay(found) if self._replay else None
            gate = BackpropGate(twin, self._blocks)
            stack.callback(gate.remove)
            self.blocks, self.block_names = len(gate.blocks), list(gate.blocks)
            self._engine.attach(twin, found)
            self._simulator = StepSimulator(
                twin, gate, (fake_args, fake_kwargs), self._options, limit, replay, self._engine
            )
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stack.__exit__(kind, error, traceback)

    def row(self, plan: Plan) -> MemoryRow:
        """Simulate one step with ``plan``; a step that needs tensor values (in the phase it
        needed them), or a forward that failed with no example batch at all, is explained."""
        try:
            figures = self._simulator.run(plan)
        except value_dependent_errors() as error:
            phase, optimizer = self._simulator.phase, self._options.optimizer
            raise _needs_values(self._model, error, phase, optimizer) from error
        except GradgateError:
            raise
        except Exception as error:
            if self._inputs[0] or self._inputs[1]:
                raise
            raise _no_batch(self._model, error) from error
        return MemoryRow(
            depth=plan if isinstance(plan, int) else None,
            learn=plan if isinstance(plan, frozenset) else None,
            param_bytes=self._simulator.param_bytes,
            grad_bytes=figures.grad_bytes,
            optimizer_bytes=figures.optimizer_bytes,
            saved_bytes=figures.saved_bytes,
            peak_bytes=figures.peak_bytes,
            other_bytes=figures.other_bytes,
            peak_phase=figures.peak_phase,
        )

    @property
    def learners(self) -> tuple[str, ...]:
        """The parameters (qualified names, each tied one once) that got a gradient in the
        last row planned."""
        return self._simulator.learners

    @property
    def trainable(self) -> tuple[str, ...]:
        """The parameters that require grad (qualified names, each tied one once)."""
        return self._simulator.trainable

    def replanner(self) -> Replanner:
        """What plans more rows later (:meth:`MemoryPlan.fits`): called, a context manager
        that opens a planner of the model as it is now, with these options and inputs, and
        gives its ``row``. The model is copied now with ``meta`` tensors: the later rows are
        those of the model as planned here, and none of its memory is held."""
        args, kwargs = light_inputs(*self._inputs)
        return _Replan(meta_copy(self._model), args, kwargs, self._options, self._blocks)

    def result(self, rows: Sequence[MemoryRow]) -> MemoryPlan:
        """The plan of ``rows``, able to plan more depths (:meth:`replanner`)."""
        plan = self._result(rows)
        plan._replanner = self.replanner()
        return plan

    def _result(self, rows: Sequence[MemoryRow]) -> MemoryPlan:
        options = self._options
        return MemoryPlan(
            type(self._model).__name__,
            rows,
            optimizer=options.optimizer,
            dtype=dtype_name(self._model, options.cast),
            blocks=self.blocks,
            amp=None if options.amp is None else str(options.amp).removeprefix("torch."),
            masters="fp32" if options.masters else None,
            device=options.device,
            world=self._engine.world,
            shard=self._engine.name,
        )


@dataclass(frozen=True)
class _Replan:
    """A planner made again: a meta copy of the model, light inputs, the checked options (a
    plain object, so that a plan pickles)."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: StepOptions
    blocks: Sequence[Pattern] | str | None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Callable[[Plan], MemoryRow]]:
        planner = StepPlanner(
            self.model, self.args, self.kwargs, blocks=self.blocks, options=self.options
        )
        with planner:
            yield planner.row


@contextlib.contextmanager
def _collector_skips_what_exists() -> Iterator[None]:
    """Python's cycle collector leaves the objects alive now alone while planning (the twin's
    modules and tensors: scanning them again and again took a third of the time on 80 layers).
    Garbage made while planning is collected as usual. Not done where the program froze
    objects itself (``gc.freeze``): unfreezing would undo that."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _blocks_of(twin: nn.Module, blocks: Sequence[Pattern] | str | None) -> list[nn.Module]:
    """The twin's blocks, as the gate will find them (none if it will refuse them)."""
    try:
        return [module for _, module in resolve_blocks(twin, blocks)]
    except GradgateError:
        return []


def _no_batch(model: nn.Module, error: Exception) -> EstimateError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return EstimateError(
        f"gg.estimate({type(model).__name__}) was given no example batch, and the forward "
        f"failed without one ({first}); give an example batch, as the step you plan gets it: "
        "gg.estimate(model, x), or for a transformers model gg.estimate(model, "
        "input_ids=ids, labels=ids) (meta tensors are enough: only shapes are read)."
    )


def _needs_values(model: nn.Module, error: Exception, phase: str, optimizer: str) -> EstimateError:
    """The error of a step that read tensor values, naming the phase that read them."""
    name = type(model).__name__
    if phase.startswith("step"):
        kind = planned_optimizer(optimizer).name
        return EstimateError(
            f"gg.estimate cannot plan {name} with optimizer={optimizer!r}: in the optimizer "
            f"step, {kind}.step() reads tensor values ({error}: .item(), float(tensor) or "
            "`if tensor:`), and the planner runs the optimizer's step on fake tensors, which "
            "have shapes but no values. An optimizer whose step reads tensor values cannot be "
            f"simulated; plan with one of the planner's optimizers {sorted(OPTIMIZERS)}, or a "
            "variant of yours that reads no values (the rules: gradgate/_memory/options.py)."
        )
    where = "forward" if phase == "forward" else "backward"
    return EstimateError(
        f"gg.estimate cannot plan {name}: its {where} needs tensor values "
        f"({error}: .item(), `if tensor:`, or a shape that depends on values such as "
        f"nonzero() or boolean indexing), and the {where} runs on fake tensors, which have "
        "shapes but no values. Make that part depend on shapes only, or measure a real step "
        "on a small batch with gg.audit (report.totals['saved_bytes'])."
    )
