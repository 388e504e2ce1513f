"""The options of :func:`gradgate.estimate`, checked: each bad value raises naming the fix.

**What an optimizer must be for the planner** (``_OPTIMIZERS``, one entry per name). The planner
runs the optimizer's real ``step()`` on fake tensors (``FakeTensorMode``: shapes, dtypes and
storages, no values), so:

* its ``step()`` reads no tensor values: no ``.item()``, ``float(tensor)``, ``if tensor:`` or
  other branch on a value. One that reads values only as Python scalars that size no tensor
  (torch's Adafactor: ``.item()`` of its step count and of two norms) is marked
  ``scalars=True``: inside its planned step each ``.item()`` of a fake tensor reads 1;
* it makes its state at the first ``step()`` (torch's optimizers make all of it there, before
  any temporary), which the planner labels as optimizer state;
* it is planned exactly only as a ``torch.optim`` class whose kernels the simulated step runs
  as torch picks them on the target: a for-loop on the CPU, ``foreach`` on CUDA, or
  ``fused=True`` in its options.

An optimizer that breaks the first rule fails in the "optimizer step" phase, with that fix.
Adding one is one entry here (its ``slots`` and ``step_count`` also size ZeRO's other ranks),
plus docs and a test against a real step.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from .._plumbing.errors import InvalidDepthError, InvalidOptionError
from .._plumbing.torch_internals import needs
from .._plumbing.torch_internals.planner import scalars_read_as_one
from .._tools.masters import LearnerMasters


@dataclass(frozen=True)
class PlannedOptimizer:
    """An optimizer the planner simulates (the rules are in the module's docstring)."""

    kind: str | Callable[..., torch.optim.Optimizer]  # a name in torch.optim, found when used
    options: dict[str, Any] = field(default_factory=dict)
    slots: int = 0  # state tensors the size of a 1-D parameter (ZeRO steps flat stretches)
    step_count: bool = False  # a 0-d float32 ``step`` tensor per parameter
    scalars: bool = False  # reads values only as scalars that size no tensor: .item() reads 1
    since: str = ""  # the torch release that added it, where newer than gradgate's floor

    def factory(self, name: str = "") -> Callable[..., torch.optim.Optimizer]:
        """The optimizer's class; refused, naming the release, where this torch lacks it."""
        if not isinstance(self.kind, str):
            return self.kind
        found = getattr(torch.optim, self.kind, None)
        if found is None:
            feature = f"gg.estimate(optimizer={name or self.kind.lower()!r})"
            raise needs(feature, f"torch.optim.{self.kind}", since=self.since)
        return found  # type: ignore[no-any-return]

    @property
    def name(self) -> str:
        return self.kind if isinstance(self.kind, str) else self.kind.__name__


# name -> what the simulated step runs
_OPTIMIZERS: dict[str, PlannedOptimizer] = {
    "adamw": PlannedOptimizer("AdamW", slots=2, step_count=True),
    "adamw_fused": PlannedOptimizer("AdamW", {"fused": True}, slots=2, step_count=True),
    "adam": PlannedOptimizer("Adam", slots=2, step_count=True),
    "sgd_momentum": PlannedOptimizer("SGD", {"momentum": 0.9}, slots=1),
    "momentum": PlannedOptimizer("SGD", {"momentum": 0.9}, slots=1),
    "sgd": PlannedOptimizer("SGD"),
    # row and column factors for 2-D and larger, the whole second moment for a vector
    "adafactor": PlannedOptimizer("Adafactor", slots=1, step_count=True, scalars=True, since="2.5"),
}
OPTIMIZERS = tuple(_OPTIMIZERS)


def planned_optimizer(name: str) -> PlannedOptimizer:
    """The entry of a checked optimizer name (:func:`optimizer_option`)."""
    return _OPTIMIZERS[name]


_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}  # fmt: skip
DTYPES = tuple(_DTYPES)
LOW = (torch.bfloat16, torch.float16)  # the dtypes masters are for
LearnSet = Iterable[int | str]
# other names for estimate's options, too far from them for a ratio to catch
_ALIASES = {"torch_dtype": "dtype", "optim": "optimizer", "autocast": "amp"}
_CLOSE = 0.75  # difflib's ratio from which a keyword reads as a misspelt option


@dataclass(frozen=True)
class StepOptions:
    """How the planned step runs: optimizer, dtypes, masters, the target device, and the
    engine dividing it among ranks."""

    optimizer: str = "adamw"
    cast: torch.dtype | None = None  # parameters (and floating inputs) cast to it
    amp: torch.dtype | None = None  # the forward under torch.autocast in this dtype
    masters: bool = False  # fp32 masters of the learners (gg.optim.LearnerMasters)
    device: str = "cpu"  # "cpu" or "cuda": the target's optimizer kernels and allocator
    world: int = 1  # ranks; with an engine, every row is one rank's bytes
    shard: str | None = None  # None (one device), "ddp", "fsdp2", "zero1", "zero2", "zero3"
    deepspeed: Any = None  # a DeepSpeed config (dict or JSON path) for ZeRO's buckets

    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer torch would run over ``params`` on the target device."""
        entry = _OPTIMIZERS[self.optimizer]
        kind, options = entry.factory(), entry.options
        if "fused" not in options:  # torch's default: foreach on CUDA, a for-loop on the CPU
            options = {**options, "foreach": self.device == "cuda"}
        if self.masters:
            inner = cast(type[torch.optim.Optimizer], kind)
            return LearnerMasters(inner, params, lr=1e-3, **options)
        return kind(params, lr=1e-3, **options)

    @property
    def fused(self) -> bool:
        return "fused" in _OPTIMIZERS[self.optimizer].options

    def stepping(self) -> contextlib.AbstractContextManager[Any]:
        """Where the optimizer's planned ``step()`` runs: ``.item()`` reads 1 for one marked
        ``scalars``, else as everywhere (a value read fails, explained)."""
        scalars = _OPTIMIZERS[self.optimizer].scalars
        return scalars_read_as_one() if scalars else contextlib.nullcontext()


def misspelt_options(kwargs: dict[str, Any], model: nn.Module, options: Sequence[str]) -> None:
    """Refuse an example keyword that reads as one of ``options`` misspelt (``mastres=``,
    ``depth=``, ``torch_dtype=``) unless the model's ``forward`` names it as a parameter: a
    forward that takes ``**kwargs`` (every transformers model) would drop it without a word."""
    named = _forward_parameters(model)
    for keyword in kwargs:
        if keyword in named:
            continue
        lower = keyword.lower()
        close = _ALIASES.get(lower) or next(
            iter(difflib.get_close_matches(lower, options, n=1, cutoff=_CLOSE)), None
        )
        if close is not None:
            raise InvalidOptionError(
                f"gg.estimate(..., {keyword}=...): did you mean {close}=? {keyword!r} is not an "
                "option of gg.estimate, and keywords it does not take go to the model's forward "
                f"as part of the example batch, but {type(model).__name__}.forward does not "
                f"name {keyword!r} as a parameter (a forward with **kwargs, as in transformers, "
                f"drops what it does not know). Pass {close}=..., or, if {keyword!r} is the "
                "model's, name it in its forward's signature."
            )


def _forward_parameters(model: nn.Module) -> set[str]:
    """The parameter names ``model.forward`` declares (``**kwargs`` names none)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD}


def optimizer_option(optimizer: object) -> str:
    if not isinstance(optimizer, str) or optimizer not in _OPTIMIZERS:
        raise InvalidOptionError(
            f"gg.estimate(optimizer={optimizer!r}) is not a known optimizer; expected one of "
            f"{sorted(_OPTIMIZERS)}, e.g. optimizer='adamw' (Adam and AdamW keep two "
            "states per parameter, SGD with momentum one, plain SGD none, Adafactor row and "
            "column factors of each matrix)."
        )
    _OPTIMIZERS[optimizer].factory(optimizer)  # refuses one this torch lacks, naming the release
    return optimizer


def dtype_option(dtype: object) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise InvalidOptionError(
        f"gg.estimate(dtype={dtype!r}) is not a floating dtype; expected None (the model's "
        f"own), a floating torch.dtype or one of {sorted(_DTYPES)}, e.g. dtype='bf16'."
    )


def amp_option(amp: object) -> torch.dtype | None:
    if amp is None:
        return None
    name = amp.lower().removeprefix("torch.") if isinstance(amp, str) else None
    found = _DTYPES.get(name) if name is not None else amp
    if found not in LOW:
        raise InvalidOptionError(
            f"gg.estimate(amp={amp!r}) is not an autocast dtype; expected None (no autocast), "
            "'bf16' or 'fp16': the forward runs under torch.autocast in that dtype, the weights "
            "as they are."
        )
    return found  # type: ignore[return-value]


def masters_option(masters: object, model: nn.Module, cast: torch.dtype | None) -> bool:
    """``masters="fp32"``: only over low-precision parameters, which is what they are for."""
    if masters is None:
        return False
    if masters not in ("fp32", "float32", torch.float32):
        raise InvalidOptionError(
            f"gg.estimate(masters={masters!r}) is not a master dtype; expected None or 'fp32' "
            "(float32 copies of the learning parameters, kept by gg.optim.LearnerMasters)."
        )
    dtype = cast or parameter_dtype(model)
    if dtype not in LOW:
        raise InvalidOptionError(
            f"gg.estimate(masters={masters!r}) keeps float32 masters of low-precision "
            f"parameters, but the planned parameters are {str(dtype).removeprefix('torch.')}; "
            "pass dtype='bf16' (or 'fp16') to plan bf16 weights with fp32 masters, or "
            "masters=None."
        )
    return True


def device_option(device: object, model: nn.Module) -> str:
    """``"cpu"`` or ``"cuda"``: the device whose rules the plan follows. By default the
    model's own; a ``meta`` model is planned for CUDA (what a meta model is planned for)."""
    if device is None:
        found = next((t.device for t in [*model.parameters(), *model.buffers()]), None)
        return "cpu" if found is None or found.type == "cpu" else "cuda"
    kind = device.type if isinstance(device, torch.device) else device
    if kind not in ("cpu", "cuda"):
        raise InvalidOptionError(
            f"gg.estimate(device={device!r}) is not a device to plan for; expected None (the "
            "model's: a meta model is planned for CUDA), 'cuda' or 'cpu'."
        )
    return str(kind)


def parameter_dtype(model: nn.Module) -> torch.dtype:
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return floating[0] if floating else torch.get_default_dtype()


def dtype_name(model: nn.Module, cast: torch.dtype | None) -> str:
    return str(cast or parameter_dtype(model)).removeprefix("torch.")


def learn_option(learn: object) -> list[frozenset[int | str]]:
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


def depths_shape(depths: object) -> list[Any] | None:
    """``depths`` as a list, before the model's block count is known: one integer or a string
    is refused (``depths=3`` means ``depths=[3]``?)."""
    if depths is None:
        return None
    if isinstance(depths, (int, str, bytes)) or not isinstance(depths, Iterable):
        raise InvalidDepthError(
            f"gg.estimate(depths={depths!r}) is not a list of depths; expected integers in a "
            f"list or range, e.g. depths=[{depths!r}] for that one depth or depths=range(n + 1) "
            "for every depth."
            if isinstance(depths, int) and not isinstance(depths, bool)
            else f"gg.estimate(depths={depths!r}) is not a list of depths; expected integers "
            "in a list or range, e.g. depths=[0, 1, 2]."
        )
    return list(depths)


def depths_option(depths: list[Any] | None, n: int, *, default: bool) -> list[int]:
    if depths is None:
        return default_depths(n) if default else []
    for depth in depths:
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
    return depths


def default_depths(n: int) -> list[int]:
    """0, 1, 2, 4, 8, ... below ``n``, then ``n``."""
    depths, k = [0], 1
    while k < n:
        depths.append(k)
        k *= 2
    return [*depths, n] if n else depths


def nothing_to_plan(depths: list[Any] | None) -> InvalidDepthError:
    return InvalidDepthError(
        f"gg.estimate(depths={depths!r}) plans no row; expected at least one depth, e.g. "
        "depths=[0, 1, 2], or depths=None for 0, 1, 2, 4, ... and all blocks (or learning "
        "sets in learn=[...])."
    )


SHARDS = ("ddp", "fsdp2", "zero1", "zero2", "zero3")


def world_option(world: object) -> int:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise InvalidOptionError(
            f"gg.estimate(world={world!r}) is not a number of ranks; expected an integer >= 1: "
            "the GPUs the step runs on, e.g. world=4 with shard='fsdp2' (1: one device)."
        )
    return world


def shard_option(shard: object, world: int) -> str | None:
    """How ``world`` ranks divide the step: ``None`` is one device and needs ``world=1``; an
    engine needs ``world >= 2``."""
    if shard is not None and shard not in SHARDS:
        raise InvalidOptionError(
            f"gg.estimate(shard={shard!r}) is not an engine; expected None (one device) or one "
            f"of {', '.join(map(repr, SHARDS))}: how the ranks divide parameters, gradients "
            "and optimizer state."
        )
    if shard is None and world > 1:
        raise InvalidOptionError(
            f"gg.estimate(world={world}) divides the step among {world} ranks, but shard=None "
            f"plans one device; expected shard= one of {', '.join(map(repr, SHARDS))} (how "
            "the ranks divide the model), or world=1."
        )
    if shard is not None and world == 1:
        raise InvalidOptionError(
            f"gg.estimate(shard={shard!r}) divides the step among ranks, but world=1 is one "
            "device; expected world=N with N >= 2 (e.g. world=4), or shard=None."
        )
    return shard  # type: ignore[return-value]
