"""How learned rows get their gradient: a rows-sized parameter, and the weight kept in step.

The weight stays a frozen parameter (``requires_grad=False``), so backward computes no
gradient of it. A parameter of the rows alone (``weight_rows``, registered on the module)
learns in its place. While a module holding the weight runs its ``forward``, a torch function
mode follows the functional call that uses the weight (``F.embedding`` or ``F.linear``, also
inside a subclass's own ``forward``, such as a scaled embedding) and gives the rows parameter
its gradient from the call's output gradient:

* ``F.embedding``: the call runs inside :class:`_EmbeddingRows`, whose backward is the
  embedding's own dense backward over the positions holding one of the rows, renumbered
  ``0..k-1``: each row sums the same positions in the same order as the full backward, bit for
  bit (``padding_idx`` and ``scale_grad_by_freq`` as the call gave them).
* ``F.linear``: the call runs as it is (its input's and bias's gradients are autograd's own),
  and a negative zero from :class:`_LinearRows` is added to its output (``y + -0.0`` is ``y``,
  bit for bit); the add hands that node the output's gradient, and it computes
  ``grad[:, rows].T @ input``, rows-sized. A BLAS may sum that product in another order than the
  full one (MKL with several threads does), so this is exact to rounding, and bit for bit
  where the product of k rows sums as the full one does (one thread).

The weight holds the rows' values: after each step of an optimizer that holds the rows
parameter (a global step post-hook; fused optimizers move no version counter), and before a
holder's forward if the rows parameter changed since the last write (its version counter: a
write from outside an optimizer). So the forward and every gradient through the weight are
those of the plain model, and two forwards before one backward do not invalidate each other's
graphs. ``state_dict()`` writes them too and leaves the rows parameter out (no new keys);
``load_state_dict`` of a plain checkpoint sets the rows parameter from the checkpoint's
weight.

A copy of the model (``copy.deepcopy``, ``pickle``, ``torch.save``) keeps learning its rows:
its wrappers and hooks copy bound to the copy's own weight and rows parameter.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .._cut.frames import before_a_depth_cut
from .._plumbing.errors import PlanNotAppliedWarning, RowsError, warn
from .._plumbing.frames_compile import opaque
from .._plumbing.hooks import _InstanceForward
from .._plumbing.torch_internals import eval_frame_callback, skip_frames

ATTRIBUTE = "weight_rows"  # the rows parameter's name on the module


class RowsLink:
    """One module's learned rows: the weight, the row indices, the rows parameter."""

    def __init__(self, name: str, weight: nn.Parameter, rows: list[int], param: nn.Parameter):
        self.name, self.weight, self.param = name, weight, param
        self.uses: list[str] = [name]  # the modules holding the weight (tied ones too)
        self.shape = tuple(weight.shape)
        self.rows = torch.tensor(rows, dtype=torch.long)
        self.written = param._version  # the rows parameter's version the weight holds
        self.warned = False
        # made now, not in a training step: a planned step would count what it makes as kept
        self._on: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self.index(weight.device)
        self.index(torch.device("cpu"))  # the planner's twin of a meta model: fake CPU tensors

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "written": -1}  # a copy writes at its first forward

    def index(
        self, device: torch.device, dtype: torch.dtype = torch.long
    ) -> tuple[torch.Tensor, ...]:
        """The rows, the rows sorted and the positions that sort them, on ``device``."""
        key = (device, dtype)
        found = self._on.get(key)
        if found is None:
            rows = self.rows.to(device=device, dtype=dtype)
            ordered, order = rows.sort()
            found = self._on[key] = (rows, ordered, order)
        return found

    def write(self, *, changed: bool = False) -> None:
        """Write the rows parameter into the weight if it changed since the last write (its
        version moved, or the caller knows: fused optimizers move no version counter)."""
        if changed or self.param._version != self.written:
            with torch.no_grad():
                rows = self.index(self.weight.device)[0]
                self.weight.index_copy_(0, rows, self.param.detach().to(self.weight.dtype))
            self.written = self.param._version

    def check(self, module: nn.Module, attribute: str) -> None:
        """Refuse a weight replaced, or made to learn whole, since ``learn_rows``."""
        weight = module._parameters.get(attribute)
        if weight is not self.weight and sharded(weight):
            raise RowsError(sharded_message(self.name))
        if weight is not self.weight:
            raise RowsError(
                f"the weight of {self.name!r} was replaced after gg.learn_rows (by "
                "load_state_dict(assign=True), FSDP2's fully_shard, resize_token_embeddings, "
                "...), so its rows can no longer be followed; expected the weight learn_rows "
                "was given. Remove the handle before replacing the weight, then call "
                "gg.learn_rows again."
            )
        if tuple(self.weight.shape) != self.shape:
            raise RowsError(
                f"the weight of {self.name!r} was resized after gg.learn_rows, from "
                f"{self.shape} to {tuple(self.weight.shape)} (resize_token_embeddings, which "
                "also sets the module's parameters' requires_grad); expected the shape learn_rows "
                "saw. Remove the handle first (it writes the rows back), resize, then call "
                "gg.learn_rows again."
            )
        if self.weight.requires_grad:
            raise RowsError(
                f"the weight of {self.name!r} learns as a whole again (requires_grad=True, "
                "set by gg.unfreeze or requires_grad_ after gg.learn_rows) while its rows learn "
                "through gg.learn_rows: backward would compute the full weight's gradient and "
                "an optimizer would move every row. Expected it frozen: undo that unfreeze, or "
                "remove the learn_rows handle to train the whole weight."
            )

    # -- gradients ---------------------------------------------------------------------------
    def embedding_grad(
        self, grad: torch.Tensor, ids: torch.Tensor, padding_idx: int, scale: bool
    ) -> torch.Tensor:
        """The rows' gradient of ``F.embedding(ids, weight)``: the embedding's dense backward
        over the positions holding a row, with the rows renumbered 0..k-1."""
        rows, ordered, order = self.index(ids.device, ids.dtype)
        flat = ids.reshape(-1)
        place = torch.searchsorted(ordered, flat).clamp_(max=len(rows) - 1)
        hits = (ordered.index_select(0, place) == flat).nonzero().squeeze(1)
        slots = order.index_select(0, place.index_select(0, hits))
        picked = grad.reshape(-1, grad.shape[-1]).index_select(0, hits)
        padding = (rows == padding_idx).nonzero()
        pad = int(padding[0, 0]) if padding_idx >= 0 and len(padding) else -1
        backward = torch.ops.aten.embedding_dense_backward
        result: torch.Tensor = backward(picked, slots, len(rows), pad, scale)
        return result

    def linear_grad(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The rows' gradient of ``F.linear(x, weight)``: ``grad[:, rows].T @ x``, laid out as
        the full product's (the transposed output gradient times the input)."""
        rows = self.index(grad.device)[0]
        picked = grad.reshape(-1, grad.shape[-1]).index_select(1, rows)
        inputs = x.reshape(-1, x.shape[-1])
        if inputs.dtype != picked.dtype:  # autocast ran the product in the output's dtype
            inputs = inputs.to(picked.dtype)
        return picked.t().mm(inputs)

    # -- the functional calls ------------------------------------------------------------
    def follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], use: str) -> Any:
        """Run a torch function called inside the ``forward`` of ``use`` (a module holding the
        weight): a call on the weight gives the rows parameter its gradient when grad is on
        and the rows learn."""
        embedding = func is F.embedding and len(args) > 1 and args[1] is self.weight
        if embedding and self._learning(use):
            return self._embedding(func, args, kwargs)
        linear = func is F.linear and _linear_weight(args, kwargs) is self.weight
        if linear and self._learning(use):
            out = func(*args, **kwargs)
            x = args[0] if args else kwargs["input"]
            zero = _LinearRows.apply(self.param, x.detach(), self, out.shape, out.dtype)
            return out + zero
        return func(*args, **kwargs)

    def _learning(self, use: str) -> bool:
        if torch.is_grad_enabled():
            return self.param.requires_grad
        if not self.warned and before_a_depth_cut():
            self.warned = True
            others = [name for name in self.uses if name != use]
            then = (
                f"they learn only through {', '.join(map(repr, others))}, where the weight is "
                "tied, if that runs after the cut; for this use too,"
                if others
                else "they never learn under a depth;"
            )
            warn(
                f"the rows that gg.learn_rows learns in {self.name!r} were used by {use!r} "
                "before a gate's cut set by a depth: a depth cuts at the input of its first "
                f"learning block, and {use!r} runs before the blocks, so this use gives the "
                f"rows no gradient at any depth: {then} name {use!r} in a learning set "
                f"(gate.learn = {{..., {use!r}}}) or use depth=None.",
                PlanNotAppliedWarning,
            )
        return False

    def _embedding(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs.get("max_norm") is not None:
            raise RowsError(
                f"{self.name!r} calls F.embedding with max_norm={kwargs['max_norm']!r}, which "
                "renormalizes rows of the weight in place while the rows parameter keeps its "
                "values; expected max_norm=None. Set module.max_norm = None to learn rows."
            )
        padding = kwargs.get("padding_idx")
        size = self.weight.shape[0]
        padding_idx = -1 if padding is None else (padding + size if padding < 0 else padding)
        return _EmbeddingRows.apply(self.param, args[0], self, padding_idx, func, args, kwargs)


class AfterStep:
    """Global optimizer step post-hook: after a step of an optimizer holding the rows
    parameter, the weight holds the rows (not after other optimizers' steps: another model's
    graph may still need the weight as it is)."""

    def __init__(self, link: RowsLink) -> None:
        self.link = weakref.ref(link)  # a model dropped with its handle never removed goes

    def __call__(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        link = self.link()
        if link is None:
            return
        param = link.param
        if any(p is param for group in optimizer.param_groups for p in group["params"]):
            link.write(changed=True)


def sharded(weight: object) -> bool:
    """Whether a weight is FSDP2's (a DTensor) or DeepSpeed ZeRO-3's (partitioned)."""
    return any(cls.__name__ == "DTensor" for cls in type(weight).__mro__) or hasattr(
        weight, "ds_id"
    )


def sharded_message(name: str) -> str:
    return (
        f"the weight of {name!r} is sharded (FSDP2's fully_shard or DeepSpeed ZeRO-3): each "
        "rank keeps only a slice of it between forwards and the sharding gathers a fresh full "
        "copy for each forward, so learn_rows can neither write the rows into it in place nor "
        "follow it from its module; expected a weight every rank holds whole. Learn rows with "
        "DDP or on one device (gg.learn_rows before DDP(model))."
    )


def _linear_weight(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[1] if len(args) > 1 else kwargs.get("weight")


class _EmbeddingRows(torch.autograd.Function):
    """``F.embedding`` as called; backward gives the rows parameter its rows' gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        param: torch.Tensor,
        ids: torch.Tensor,
        link: RowsLink,
        padding_idx: int,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.link, ctx.padding_idx = link, padding_idx
        ctx.scale = bool(kwargs.get("scale_grad_by_freq", False))
        return func(*args, **kwargs)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (ids,) = ctx.saved_tensors
        rows = ctx.link.embedding_grad(grad, ids, ctx.padding_idx, ctx.scale)
        return (rows.to(ctx.link.param.dtype), None, None, None, None, None, None)


class _LinearRows(torch.autograd.Function):
    """A negative zero shaped like ``F.linear``'s output; backward gives the rows parameter the
    rows' gradient from the output's gradient (which the add hands it whole, not copied)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        param: torch.Tensor,
        x: torch.Tensor,
        link: RowsLink,
        shape: torch.Size,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.link = link
        return torch.full((), -0.0, dtype=dtype, device=x.device).expand(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        rows = ctx.link.linear_grad(grad, x)
        return (rows.to(ctx.link.param.dtype), None, None, None, None)


class _Follow(TorchFunctionMode):
    """The torch function mode active while a holder's ``forward`` runs."""

    def __init__(self, link: RowsLink, use: str) -> None:
        super().__init__()
        self.link, self.use = link, use

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return self.link.follow(func, args, kwargs or {}, self.use)


class RowsForward(_InstanceForward):
    """The ``forward`` of a module holding the weight: writes the rows into the weight, then
    runs the module's forward with its functional calls followed. Copies keep working, bound
    to the copy's own tensors."""

    def __init__(self, module: nn.Module, link: RowsLink, attribute: str, use: str) -> None:
        super().__init__(module)
        self.link, self.attribute, self.use = link, attribute, use

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.live:
            return self.inner(*args, **kwargs)
        if torch.compiler.is_compiling() or eval_frame_callback():
            # under torch.compile this module runs eagerly (a graph break): dynamo neither
            # traces the mode nor the rows' autograd functions
            return opaque(self._follow, *args, **kwargs)
        return self._follow(*args, **kwargs)

    def _follow(self, *args: Any, **kwargs: Any) -> Any:
        link = self.link
        link.check(self.module, self.attribute)
        link.write()
        with _Follow(link, self.use):
            return self.inner(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        state = (self.module, self.link, self.attribute, self.use, self.previous)
        return (_copied_forward, state)


skip_frames(RowsForward.__call__)


def _copied_forward(
    module: nn.Module, link: RowsLink, attribute: str, use: str, previous: Any
) -> RowsForward:
    """What a copy's ``forward`` becomes: a live wrapper bound to the copy's module and link
    (the module may still be filling in: nothing is read from it here)."""
    wrapper = RowsForward.__new__(RowsForward)
    wrapper.module, wrapper.previous, wrapper.live = module, previous, True
    wrapper.inner = previous if previous is not None else type(module).forward.__get__(module)
    wrapper.link, wrapper.attribute, wrapper.use = link, attribute, use
    return wrapper


def live_link(module: nn.Module) -> RowsLink | None:
    """The live link whose wrapper runs ``module``'s forward, if any."""
    forward = module.__dict__.get("forward")
    while isinstance(forward, _InstanceForward):
        if isinstance(forward, RowsForward) and forward.live:
            return forward.link
        forward = forward.previous
    return None


class FoldRows:
    """``state_dict`` post-hook: the weight holds the rows, the rows parameter's key goes."""

    def __init__(self, link: RowsLink) -> None:
        self.link = link

    def __call__(self, module: nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
        self.link.write()
        state.pop(prefix + ATTRIBUTE, None)


class LoadRows:
    """``load_state_dict`` pre-hook: a checkpoint without the rows parameter's key (any plain
    checkpoint) sets the rows parameter from its weight's rows."""

    def __init__(self, link: RowsLink) -> None:
        self.link = link

    def __call__(self, module: nn.Module, state: dict[str, Any], prefix: str, *rest: Any) -> None:
        weight = state.get(prefix + "weight")
        key = prefix + ATTRIBUTE
        rows = self.link.rows
        if key in state or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return
        if weight.shape[0] > int(rows.max()):  # else torch reports the weight's shape
            state[key] = weight.index_select(0, rows.to(weight.device))
