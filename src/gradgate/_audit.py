"""What did backward compute? Per-module wgrad, dgrad, backward FLOPs, saved bytes and time.

Counting rule (the seeds' kernel tables, per autograd node instead of per kernel):

* **wgrad** — one per autograd node that computes a gradient for at least one parameter
  (a conv's weight and bias come from one node: one wgrad);
* **dgrad** — one per autograd node that computes a gradient for an activation input (any
  input that is not a parameter), which autograd does only when something upstream needs it;
* layout-only nodes (views, transposes, reshapes, expands, casts) count as neither, and a
  gradient passing through them to a parameter still counts as that parameter's wgrad.

Mechanism: forward hooks tag each autograd node with the innermost module whose forward created
it (nodes are found by walking ``grad_fn.next_functions`` back from the module's outputs to the
nodes that existed when it started); node hooks see which gradients were computed; a dispatch
mode attributes each backward op, and its FLOPs (``torch.utils.flop_counter`` formulas), to the
autograd node running it; saved-tensor hooks count the bytes saved for backward, each storage
once (parameters and buffers excluded: the model holds them anyway).
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from ._select import ancestors
from ._autograd import tensors_in

OUTSIDE = "(outside model)"
WasteReason = Literal["late_freeze", "not_in_optimizer"]
_WASTE_MESSAGES: dict[str, str] = {
    "late_freeze": "requires_grad was turned off after the forward: computed, then dropped",
    "not_in_optimizer": "no optimizer holds this parameter: computed, never used",
}
_Piece = tuple[tuple[int, ...], int]  # (storage pointers of an op's outputs, its FLOPs)
_LAYOUT_ONLY = {
    "Alias",
    "AsStrided",
    "Expand",
    "Permute",
    "Reshape",
    "ReshapeAlias",
    "Squeeze",
    "T",
    "ToCopy",
    "Transpose",
    "Unsqueeze",
    "UnsafeView",
    "View",
}


@dataclass
class ModuleRecord:
    """What backward computed for one module (and, for a parent, everything inside it)."""

    name: str
    type: str
    leaf: bool = True
    wgrad: int = 0
    dgrad: int = 0
    backward_flops: int = 0
    saved_bytes: int = 0
    seconds: float = 0.0

    def add(self, other: ModuleRecord) -> None:
        """Add another record's counts to this one."""
        self.wgrad += other.wgrad
        self.dgrad += other.dgrad
        self.backward_flops += other.backward_flops
        self.saved_bytes += other.saved_bytes
        self.seconds += other.seconds


@dataclass(frozen=True)
class WastedGradient:
    """A parameter gradient backward computed although nothing will use it."""

    parameter: str
    module: str
    reason: WasteReason
    flops: int

    @property
    def message(self) -> str:
        """Why this gradient is wasted, in words."""
        return _WASTE_MESSAGES[self.reason]


class AuditReport:
    """The result of :func:`audit`: per-module records, totals and wasted gradients.

    ``modules`` lists every module of the model in order: leaf rows, and parents with the
    sum over everything inside them (the root, named ``""``, holds the whole model).
    ``outside`` holds the work done outside the model (the loss, in most scripts).

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Conv2d(3, 3, 3) for _ in range(3)])
    >>> with gg.audit(net) as report:
    ...     net(torch.randn(1, 3, 12, 12)).mean().backward()
    >>> report.totals["wgrad"], report.totals["dgrad"]
    (3, 2)
    >>> gg.AuditReport.from_json(report.to_json()).totals == report.totals
    True
    """

    def __init__(
        self,
        modules: list[ModuleRecord] | None = None,
        outside: ModuleRecord | None = None,
        wasted: list[WastedGradient] | None = None,
        *,
        forward_seen: bool = True,
    ) -> None:
        self.modules: list[ModuleRecord] = modules or []
        self.outside = outside or ModuleRecord(OUTSIDE, "")
        self.wasted: list[WastedGradient] = wasted or []
        self.forward_seen = forward_seen

    @property
    def totals(self) -> dict[str, int]:
        """``wgrad``, ``dgrad``, ``backward_flops`` and ``saved_bytes`` of the whole model."""
        root = self.modules[0] if self.modules else ModuleRecord("", "")
        return {
            "wgrad": root.wgrad,
            "dgrad": root.dgrad,
            "backward_flops": root.backward_flops,
            "saved_bytes": root.saved_bytes,
        }

    @property
    def wasted_flops(self) -> int:
        """Backward FLOPs spent on gradients nothing uses."""
        return sum(item.flops for item in self.wasted)

    def module(self, name: str) -> ModuleRecord:
        """The record of one module by qualified name (``""`` is the whole model)."""
        for record in self.modules:
            if record.name == name:
                return record
        known = ", ".join(repr(r.name) for r in self.modules[:8])
        raise KeyError(f"no module {name!r} in this audit; known: {known}")

    def table(self, *, depth: int | None = None) -> str:
        """A text table: one row per module, indented by nesting, then totals and waste."""
        from .report import render_table

        return render_table(self, depth=depth)

    def to_json(self) -> str:
        """The report as JSON (schema ``gradgate.audit/1``, see ``docs/audit.md``)."""
        from .report import dumps

        return dumps(self)

    @classmethod
    def from_json(cls, text: str) -> AuditReport:
        """Load a report written by :meth:`to_json`."""
        from .report import loads

        fields = loads(text)
        return cls(
            [ModuleRecord(**m) for m in fields["modules"]],
            ModuleRecord(**fields["outside"]),
            [WastedGradient(**w) for w in fields["wasted"]],
            forward_seen=fields["forward_seen"],
        )

    def to_html(self, path: str | Path) -> Path:
        """Write a self-contained HTML page with the table; returns the path written."""
        from .report import write_html

        return write_html(self, Path(path))

    def __repr__(self) -> str:
        return f"<gradgate.AuditReport {self.totals}>"


@dataclass
class _NodeInfo:
    module: str
    edges: list[tuple[str, str]]  # per input edge: ("param" | "activation" | "none", param name)
    layout_only: bool
    started: float | None = None
    seconds: float = 0.0
    flops: int = 0
    wgrad: bool = False
    dgrad: bool = False
    outputs: list[_Piece] = field(default_factory=list)


def audit(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None) -> _Audit:
    """Record what the backward passes run inside the block computed for ``model``.

    Use it around the forward and the backward (everything is measured), or around the
    backward only, with the forward run before (no saved bytes; nodes are attributed to the
    module whose parameters they use, the rest to ``report.outside``). With ``optimizer``,
    gradients of parameters it does not hold are listed as wasted. Every hook is removed on
    exit, also when the block raises. See the module docstring for the counting rule.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Conv2d(3, 3, 3) for _ in range(10)])
    >>> with gg.audit(net) as report:
    ...     net(torch.randn(2, 3, 24, 24)).mean().backward()
    >>> report.totals["wgrad"], report.totals["dgrad"]
    (10, 9)
    """
    return _Audit(model, optimizer)


class _Audit:
    """The hooks behind :func:`audit`; entering returns the (still empty) report."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._model = model
        self._optimizer = optimizer
        self.report = AuditReport()
        self._params = {id(p): (n, p) for n, p in model.named_parameters()}
        self._params_by_name = dict(model.named_parameters())
        self._param_by_storage = {_storage_ptr(p): n for n, p in model.named_parameters()}
        self._model_storages = set(self._param_by_storage) | {
            _storage_ptr(b) for b in model.buffers()
        }
        self._nodes: dict[Any, _NodeInfo] = {}
        self._stack: list[tuple[str, int]] = []
        self._saved: dict[int, weakref.ref[torch.Tensor]] = {}
        self._saved_bytes: dict[str, int] = defaultdict(int)
        self._wasted: dict[tuple[str, str], int] = {}
        self._module_hooks: list[RemovableHandle] = []
        self._node_hooks: list[RemovableHandle] = []
        self._forward_seen = False
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._observer = _BackwardObserver(self._on_backward_op)

    # -- enter / exit ------------------------------------------------------------------------
    def __enter__(self) -> AuditReport:
        try:
            for name, module in self._model.named_modules():
                self._module_hooks.append(module.register_forward_pre_hook(self._pre(name)))
                self._module_hooks.append(
                    module.register_forward_hook(self._post(name), always_call=True)
                )
            self._saved_hooks.__enter__()
            self._observer.__enter__()
        except BaseException:
            self._remove_module_hooks()
            raise
        return self.report

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._observer.__exit__(exc_type, exc, tb)
            self._saved_hooks.__exit__(exc_type, exc, tb)
        finally:
            self._remove_module_hooks()
            for hook in self._node_hooks:
                hook.remove()
            self._node_hooks = []
        self._fill_report()
        self._nodes.clear()
        self._saved.clear()

    def _remove_module_hooks(self) -> None:
        for hook in self._module_hooks:
            hook.remove()
        self._module_hooks = []

    # -- forward: tag nodes with modules, count saved bytes -----------------------------------
    def _pre(self, name: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._forward_seen = True
            self._stack.append((name, torch._C._autograd._get_sequence_nr()))

        return hook

    def _post(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._stack or self._stack[-1][0] != name:
                return
            _, start = self._stack.pop()
            roots = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
            self._tag_new_nodes(roots, name, start)

        return hook

    def _tag_new_nodes(self, roots: list[Any], module: str, start: int) -> None:
        """Tag nodes created since ``start`` and not yet tagged (by a child) with ``module``."""
        pending, seen = list(roots), set()
        while pending:
            node = pending.pop()
            if node in seen or _is_leaf_node(node) or node._sequence_nr() < start:
                continue
            seen.add(node)
            if node not in self._nodes:
                self._adopt(node, module)
            pending.extend(fn for fn, _ in node.next_functions if fn is not None)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return tensor
        pointer = storage.data_ptr()
        if pointer in self._model_storages:
            return tensor
        earlier = self._saved.get(pointer)
        if earlier is None or earlier() is None:
            self._saved[pointer] = weakref.ref(tensor)
            owner = self._stack[-1][0] if self._stack else OUTSIDE
            self._saved_bytes[owner] += storage.nbytes()
        return tensor

    # -- backward: node hooks and the op observer ----------------------------------------------
    def _adopt(self, node: Any, module: str) -> _NodeInfo:
        info = _NodeInfo(
            module=module,
            edges=[self._edge_kind(fn) for fn, _ in node.next_functions],
            layout_only=_is_layout_only(node),
        )
        self._nodes[node] = info
        self._node_hooks.append(node.register_prehook(self._node_started(info)))
        self._node_hooks.append(node.register_hook(self._node_finished(info)))
        return info

    def _edge_kind(self, fn: Any) -> tuple[str, str]:
        if fn is None:
            return ("none", "")
        while _is_layout_only(fn) and len(fn.next_functions) == 1:
            fn = fn.next_functions[0][0]
            if fn is None:
                return ("activation", "")
        variable = getattr(fn, "variable", None)
        if variable is not None and id(variable) in self._params:
            return ("param", self._params[id(variable)][0])
        return ("activation", "")

    def _node_started(self, info: _NodeInfo) -> Callable[[Any], None]:
        def hook(grad_outputs: Any) -> None:
            info.started = time.perf_counter()

        return hook

    def _node_finished(self, info: _NodeInfo) -> Callable[[Any, Any], None]:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            if info.started is not None:
                info.seconds += time.perf_counter() - info.started
            for grad, (kind, param_name) in zip(grad_inputs, info.edges, strict=False):
                if grad is None or info.layout_only:
                    continue
                if kind == "param":
                    info.wgrad = True
                    self._check_waste(info, param_name, grad)
                elif kind == "activation":
                    info.dgrad = True

        return hook

    def _check_waste(self, info: _NodeInfo, param_name: str, grad: torch.Tensor) -> None:
        param = self._params_by_name[param_name]
        reason: WasteReason | None = None
        if not param.requires_grad:
            reason = "late_freeze"
        elif self._optimizer is not None and not _held_by(self._optimizer, param):
            reason = "not_in_optimizer"
        if reason is None:
            return
        pointer = _storage_ptr(grad)
        flops = sum(count for pointers, count in info.outputs if pointer in pointers)
        key = (param_name, reason)
        self._wasted[key] = self._wasted.get(key, 0) + flops

    def _on_backward_op(self, node: Any, flops: int, outputs: list[_Piece]) -> None:
        if _is_leaf_node(node):
            return
        info = self._nodes.get(node)
        if info is None:
            info = self._adopt_unknown(node)
            info.started = info.started or time.perf_counter()
        info.flops += flops
        info.outputs.extend(outputs)

    def _adopt_unknown(self, first: Any) -> _NodeInfo:
        """A node no forward hook tagged: adopt it and every untagged node upstream of it."""
        pending, seen = [first], set()
        while pending:
            node = pending.pop()
            if node in seen or _is_leaf_node(node):
                continue
            seen.add(node)
            if node not in self._nodes:
                self._adopt(node, self._owner_of(node))
            pending.extend(fn for fn, _ in node.next_functions if fn is not None)
        return self._nodes[first]

    def _owner_of(self, node: Any) -> str:
        """The module whose parameter the node uses (as an input or saved), else outside."""
        names = [name for kind, name in (self._edge_kind(f) for f, _ in node.next_functions)]
        names += [self._param_by_storage.get(pointer, "") for pointer in _saved_storages(node)]
        for name in names:
            if name:
                return name.rpartition(".")[0]
        return OUTSIDE

    # -- the report -------------------------------------------------------------------------------
    def _fill_report(self) -> None:
        records = {
            name: ModuleRecord(name, type(module).__name__, leaf=not any(module.children()))
            for name, module in self._model.named_modules()
        }
        own: dict[str, ModuleRecord] = defaultdict(lambda: ModuleRecord("", ""))
        for info in self._nodes.values():
            counts = own[info.module]
            counts.wgrad += int(info.wgrad)
            counts.dgrad += int(info.dgrad)
            counts.backward_flops += info.flops
            counts.seconds += info.seconds
        for name, saved in self._saved_bytes.items():
            own[name].saved_bytes += saved
        outside = ModuleRecord(OUTSIDE, "")
        for name, counts in own.items():
            if name not in records:
                outside.add(counts)
                continue
            for ancestor in [name, *ancestors(name)]:
                records[ancestor].add(counts)
        self.report.modules = list(records.values())
        self.report.outside = outside
        self.report.forward_seen = self._forward_seen
        self.report.wasted = [
            WastedGradient(name, name.rpartition(".")[0], reason, flops)  # type: ignore[arg-type]
            for (name, reason), flops in self._wasted.items()
        ]


class _BackwardObserver(TorchDispatchMode):
    """Sees every op; hands backward ops with their FLOPs to the autograd node running them.

    FLOPs follow ``FlopCounterMode``: its formula when one is registered, else the op is
    decomposed and its parts counted. CPU flash attention, which that registry lacks, is
    counted with the same attention formula as the GPU kernels.
    """

    def __init__(self, on_op: Callable[[Any, int, list[_Piece]], None]) -> None:
        super().__init__()
        self._on_op = on_op

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        node = torch._C._current_autograd_node()
        if node is None:
            return func(*args, **kwargs)
        formula = _formula(func)
        if formula is None and func is not torch.ops.prim.device.default:
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        out = func(*args, **kwargs)
        per_output = _flops_per_output(func, formula, args, kwargs, out)
        self._on_op(node, sum(count for _, count in per_output), per_output)
        return out


def _formula(func: Any) -> Callable[..., int] | None:
    from torch.utils import flop_counter

    packet = func._overloadpacket
    if packet in flop_counter.flop_registry:
        return flop_counter.flop_registry[packet]  # type: ignore[no-any-return]
    if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        return _cpu_flash_attention_backward_flops
    return None


def _cpu_flash_attention_backward_flops(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    out_val: Any = None,
    **kwargs: Any,
) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    shapes = (grad_out.shape, query.shape, key.shape, value.shape)
    return sdpa_backward_flop_count(*shapes)  # type: ignore[no-any-return]


def _flops_per_output(
    func: Any, formula: Callable[..., int] | None, args: Any, kwargs: Any, out: Any
) -> list[_Piece]:
    """(storage pointers, FLOPs) pieces of one op; masked multi-output ops split per output."""
    pointers = tuple(_storage_ptr(t) for t in tensors_in(out))
    if formula is None:
        return [(pointers, 0)]
    mask_at = _output_mask_position(func)
    outputs = list(out) if isinstance(out, (tuple, list)) else [out]
    if mask_at is None or mask_at >= len(args) or len(outputs) != len(args[mask_at]):
        return [(pointers, int(formula(*args, **kwargs, out_val=out)))]
    pieces: list[_Piece] = []
    for index, wanted in enumerate(args[mask_at]):
        if not wanted or not isinstance(outputs[index], torch.Tensor):
            continue
        only = [position == index for position in range(len(outputs))]
        masked = (*args[:mask_at], only, *args[mask_at + 1 :])
        count = int(formula(*masked, **kwargs, out_val=out))
        pieces.append(((_storage_ptr(outputs[index]),), count))
    return pieces


def _output_mask_position(func: Any) -> int | None:
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == "output_mask":
            return position
    return None


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage_ptr(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return id(tensor)


def _saved_storages(node: Any) -> list[int]:
    pointers: list[int] = []
    for attribute in dir(node):
        if not attribute.startswith("_saved_"):
            continue
        try:
            value = getattr(node, attribute)
        except RuntimeError:  # already freed by an earlier backward
            continue
        pointers.extend(_storage_ptr(t) for t in tensors_in(value))
    return pointers


def _is_leaf_node(node: Any) -> bool:
    return hasattr(node, "variable")


def _is_layout_only(node: Any) -> bool:
    name = node.name().rstrip("0123456789")
    return name.endswith("Backward") and name[: -len("Backward")] in _LAYOUT_ONLY


def _held_by(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    return any(held is param for group in optimizer.param_groups for held in group["params"])
