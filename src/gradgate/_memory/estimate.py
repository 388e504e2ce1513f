"""How deep can I afford? ``estimate`` predicts a training step's memory per depth.

It runs the forward once per depth (or learning set) on a *fake* twin of the model: the same
modules, with parameters, buffers and inputs replaced by ``FakeTensorMode`` tensors, which have
shapes, dtypes and storages but no memory. Nothing is computed and nothing of the user's model
changes. Per row it reads:

* **saved** — the bytes autograd saves for backward (saved-tensor hooks, each storage once,
  parameters and buffers left out: the same rule as ``gg.audit``);
* **grads** — the bytes of the parameters the recorded graph reaches (the ones a backward would
  give a ``.grad``), each tied parameter once;
* **optimizer** — the state ``torch.optim`` allocates for those at its first step (AdamW: two
  tensors of each parameter's shape and dtype and a float32 ``step``; SGD with momentum: one
  buffer; SGD: none);
* **params** — every parameter of the model, learning or not.

Fake tensors on the CPU make torch pick the kernels a real CPU run picks (fused attention saves
its output and log-sum-exp, not the attention matrix, as on a GPU), which the ``meta`` device
does not.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .._cut.gate import BackpropGate
from .._plumbing.autograd import is_leaf, leaf_variable, observe_saved, tensors_in, walk
from .._plumbing.errors import (
    BlockCallWarning,
    EstimateError,
    InvalidDepthError,
    InvalidOptionError,
)
from .._plumbing.torch_internals import (
    fake_tensor_mode,
    tree_flatten,
    tree_unflatten,
    value_dependent_errors,
)
from .._select.names import Pattern, check_module
from .memory_plan import MemoryPlan, MemoryRow

# Optimizer -> (state tensors shaped like each parameter, bytes of per-parameter scalars).
_OPTIMIZER_STATE = {
    "sgd": (0, 0),
    "sgd_momentum": (1, 0),
    "momentum": (1, 0),
    "adam": (2, 4),  # exp_avg, exp_avg_sq; step is a float32 scalar tensor
    "adamw": (2, 4),
}
_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}  # fmt: skip
LearnSet = Iterable[int | str]


def estimate(
    model: nn.Module,
    *example_args: Any,
    depths: Iterable[int] | None = None,
    learn: Iterable[LearnSet] | None = None,
    optimizer: str = "adamw",
    dtype: torch.dtype | str | None = None,
    blocks: Sequence[Pattern] | str | None = None,
    **example_kwargs: Any,
) -> MemoryPlan:
    """Predict the memory of one training step of ``model(*example_args, **example_kwargs)``
    for each depth (default 0, 1, 2, 4, ... and all blocks) or each learning set in ``learn``.

    ``model`` may live on the ``meta`` device (a 70B model is planned with no weight memory);
    inputs may be real or ``meta`` tensors. ``dtype`` plans for parameters (and floating
    inputs) cast to it, e.g. ``"bf16"``; ``optimizer`` is one of ``"adamw"``, ``"adam"``,
    ``"sgd_momentum"`` or ``"sgd"``. Pass ``labels=`` to a transformers model to include its
    loss. ``blocks`` names the block sequence as for :class:`BackpropGate`. Each row's
    ``peak_bytes`` is params + grads + optimizer state + saved activations (no workspace, no
    optimizer temporaries: see docs/depth-fits.md). The model itself is never changed.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    >>> plan = gg.estimate(net, torch.randn(64, 512))
    >>> [row.depth for row in plan.rows], plan.fits("16MiB")
    ([0, 1, 2, 4, 8], 2)
    """
    check_module(model)
    state_copies, scalar_bytes = _optimizer_option(optimizer)
    cast = _dtype_option(dtype)
    learn_sets = _learn_option(learn)
    mode = fake_tensor_mode()
    twin = _fake_twin(model, mode, cast)
    with mode, contextlib.ExitStack() as stack:
        gate = BackpropGate(twin, blocks)
        stack.callback(gate.remove)
        n = len(gate.blocks)
        plans: list[int | frozenset[int | str]] = [
            *_depths_option(depths, n, default=learn is None),
            *learn_sets,
        ]
        args, kwargs = _fake_inputs((example_args, example_kwargs), cast)
        measure = _Measure(twin, args, kwargs, state_copies, scalar_bytes)
        rows = [_explained(measure.row, gate, plan, model) for plan in plans]
    return MemoryPlan(
        type(model).__name__,
        rows,
        optimizer=optimizer,
        dtype=_dtype_name(model, cast),
        blocks=n,
    )


def _explained(
    row: Any, gate: BackpropGate, plan: int | frozenset[int | str], model: nn.Module
) -> MemoryRow:
    """``row(gate, plan)``; a forward that needs tensor values raises a clear error."""
    try:
        return row(gate, plan)  # type: ignore[no-any-return]
    except value_dependent_errors() as error:
        raise EstimateError(
            f"gg.estimate cannot plan {type(model).__name__}: its forward needs tensor values "
            f"({error}: .item(), `if tensor:`, or a shape that depends on values such as "
            "nonzero() or boolean indexing), and the forward runs on fake tensors, which have "
            "shapes but no values. Make that part depend on shapes only, or measure a real step "
            "on a small batch with gg.audit (report.totals['saved_bytes'])."
        ) from error


class _Measure:
    """One forward per row on the fake twin, read through saved-tensor hooks and the graph."""

    def __init__(
        self,
        twin: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        state_copies: int,
        scalar_bytes: int,
    ) -> None:
        self._twin, self._args, self._kwargs = twin, args, kwargs
        self._state_copies, self._scalar_bytes = state_copies, scalar_bytes
        params = {id(p): p for p in twin.parameters()}
        self._params = params
        self._param_bytes = sum(_nbytes(p) for p in params.values())
        self._model_storages = {_storage_id(t) for t in [*params.values(), *twin.buffers()]}

    def row(self, gate: BackpropGate, plan: int | frozenset[int | str]) -> MemoryRow:
        if isinstance(plan, int):
            gate.depth = plan
        else:
            gate.learn = plan
        saved = _SavedBytes(self._model_storages)
        with torch.enable_grad(), observe_saved(saved.add), warnings.catch_warnings():
            # A row where nothing learns is an answer here (zero bytes), not a slip.
            warnings.filterwarnings("ignore", "nothing that runs after the cut", BlockCallWarning)
            output = self._twin(*self._args, **self._kwargs)
        learners = self._learners(output)
        del output
        grads = sum(_nbytes(p) for p in learners)
        optimizer = self._state_copies * grads + self._scalar_bytes * len(learners)
        return MemoryRow(
            depth=plan if isinstance(plan, int) else None,
            learn=None if isinstance(plan, int) else plan,
            param_bytes=self._param_bytes,
            grad_bytes=grads,
            optimizer_bytes=optimizer,
            saved_bytes=saved.total,
            peak_bytes=self._param_bytes + grads + optimizer + saved.total,
        )

    def _learners(self, output: Any) -> list[torch.Tensor]:
        """The parameters a backward from ``output`` reaches: those that would get a grad."""
        roots = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        found: dict[int, torch.Tensor] = {}
        for node in walk(roots):
            variable = leaf_variable(node) if is_leaf(node) else None
            if variable is not None and id(variable) in self._params:
                found[id(variable)] = variable
        return list(found.values())


class _SavedBytes:
    """Bytes of distinct storages saved for backward, model storages left out; keyed by the
    storage itself (fake and meta tensors have no data pointer)."""

    def __init__(self, exclude: set[int]) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak_ref = StorageWeakRef
        self._exclude = exclude
        self._alive: dict[int, Any] = {}
        self.total = 0

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        reference = self._weak_ref(storage)
        key = reference.cdata
        earlier = self._alive.get(key)
        if key in self._exclude or (earlier is not None and not earlier.expired()):
            return
        self._alive[key] = reference
        self.total += int(storage.nbytes())


def _storage_id(tensor: torch.Tensor) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    return int(StorageWeakRef(tensor.untyped_storage()).cdata)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# -- the fake twin -------------------------------------------------------------------------------
def _fake_twin(model: nn.Module, mode: Any, cast: torch.dtype | None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake CPU tensors (ties kept)."""
    memo: dict[int, Any] = {}
    with mode:
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) not in memo:
                fake = _fake_like(tensor, cast)
                if isinstance(tensor, nn.Parameter):
                    fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                memo[id(tensor)] = fake
    return copy.deepcopy(model, memo)


def _fake_like(tensor: torch.Tensor, cast: torch.dtype | None) -> torch.Tensor:
    dtype = cast if cast is not None and tensor.is_floating_point() else tensor.dtype
    fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=dtype, device="cpu")
    return fake.requires_grad_(tensor.requires_grad) if fake.is_floating_point() else fake


def _fake_inputs(value: Any, cast: torch.dtype | None) -> Any:
    """Every tensor in ``value`` as a fake CPU tensor of the same shape (``cast`` applied)."""

    def convert(leaf: Any) -> Any:
        return _fake_like(leaf, cast) if isinstance(leaf, torch.Tensor) else leaf

    leaves, spec = tree_flatten(value)
    return tree_unflatten([convert(leaf) for leaf in leaves], spec)


# -- options -------------------------------------------------------------------------------------
def _optimizer_option(optimizer: object) -> tuple[int, int]:
    if not isinstance(optimizer, str) or optimizer not in _OPTIMIZER_STATE:
        raise InvalidOptionError(
            f"gg.estimate(optimizer={optimizer!r}) is not a known optimizer; expected one of "
            f"{sorted(_OPTIMIZER_STATE)}, e.g. optimizer='adamw' (Adam and AdamW keep two "
            "states per parameter, SGD with momentum one, plain SGD none)."
        )
    return _OPTIMIZER_STATE[optimizer]


def _dtype_option(dtype: object) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise InvalidOptionError(
        f"gg.estimate(dtype={dtype!r}) is not a floating dtype; expected None (the model's "
        f"own), a floating torch.dtype or one of {sorted(_DTYPES)}, e.g. dtype='bf16'."
    )


def _dtype_name(model: nn.Module, cast: torch.dtype | None) -> str:
    if cast is None:
        floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
        cast = floating[0] if floating else torch.get_default_dtype()
    return str(cast).removeprefix("torch.")


def _learn_option(learn: object) -> list[frozenset[int | str]]:
    if learn is None:
        return []
    if isinstance(learn, (str, int)) or not isinstance(learn, Iterable):
        raise InvalidOptionError(
            f"gg.estimate(learn={learn!r}) is not a list of learning sets; expected e.g. "
            "learn=[{11}, {10, 11}, {0, 11}]: one row per set of blocks (or module names)."
        )
    items = list(learn)
    if items and all(isinstance(item, (int, str)) for item in items):
        return [frozenset(items)]  # one learning set, such as learn={1, 4}
    return [frozenset(item) for item in items]


def _depths_option(depths: Iterable[int] | None, n: int, *, default: bool) -> list[int]:
    if depths is None:
        return _default_depths(n) if default else []
    chosen = list(depths)
    for depth in chosen:
        if depth is None:
            raise InvalidDepthError(
                f"gg.estimate(depths=[None]): expected integers 0..{n}; a row without a cut "
                "is a learning set: pass learn=[{*range(n), 'embeddings'}] with the modules "
                f"before the first block, or depth {n} for all {n} blocks."
            )
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= n:
            raise InvalidDepthError(
                f"depth {depth!r} is out of range: the model has {n} blocks; expected "
                f"integers 0..{n} in depths=[...]."
            )
    return chosen


def _default_depths(n: int) -> list[int]:
    """0, 1, 2, 4, 8, ... below ``n``, then ``n``."""
    depths, k = [0], 1
    while k < n:
        depths.append(k)
        k *= 2
    return [*depths, n] if n else depths
