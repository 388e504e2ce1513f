"""The hooks behind an audit: which node did what in backward, and what the forward saved.

Forward: a :class:`~gradgate._plumbing.tagging.ModuleTagger` tags each autograd node with the module
that created it, and saved-tensor hooks count the bytes saved for backward (each storage once;
parameters and buffers excluded: the model holds them anyway). Backward: node hooks see which
gradients each node computed (a ``None`` entry is a gradient not computed; the edge's target
tells wgrad from dgrad), and a dispatch mode attributes each backward op and its FLOPs to the
node running it. Nodes no forward hook tagged (forward run before the audit) belong to the
module whose parameter they use, else to ``(outside model)``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..._plumbing.autograd import (
    Node,
    StorageBytes,
    inputs_of,
    is_leaf,
    leaf_variable,
    observe_saved,
    saved_tensors,
    storage_key,
    walk,
)
from ..._plumbing.tagging import ModuleTagger
from ..._select.names import ancestors
from .flops import BackwardObserver, Piece
from .kernels import KernelRecorder, KernelRow
from .records import OUTSIDE, ModuleRecord, WastedGradient, WasteReason
from .render import Figures

_LAYOUT_ONLY = {
    "Alias", "AsStrided", "Expand", "Permute", "Reshape", "ReshapeAlias", "Squeeze", "T",
    "ToCopy", "Transpose", "Unsqueeze", "UnsafeView", "View",
}  # fmt: skip


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
    wgrad_bytes: int = 0
    outputs: list[Piece] = field(default_factory=list)


class Recorder:
    """Everything :func:`gradgate.audit` registers, in one place: started by :meth:`start`,
    all removed by :meth:`stop`, which returns the figures (and the kernel rows)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, kernels: bool
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        named = list(model.named_parameters())
        self._params = {id(p): (n, p) for n, p in named}
        self._param_named = dict(named)
        self._param_by_storage = {storage_key(p): n for n, p in named}
        self._model_storages = set(self._param_by_storage) | {
            storage_key(b) for b in model.buffers()
        }
        self._nodes: dict[Node, _NodeInfo] = {}
        self._saved = StorageBytes(exclude=self._model_storages)
        self._saved_bytes: dict[str, int] = defaultdict(int)
        self._wasted: dict[tuple[str, str], int] = {}
        self._handles: list[RemovableHandle] = []
        self._backward_seen = False
        self._tagger = ModuleTagger(model, on_tag=self._adopt)
        self._observer = BackwardObserver(self._on_backward_op)
        self._contexts = contextlib.ExitStack()
        self._kernels = KernelRecorder() if kernels else None
        self.kernel_rows: list[KernelRow] = []

    # -- start / stop ------------------------------------------------------------------------
    def start(self) -> None:
        """Register the hooks and enter the modes; on failure nothing stays registered."""
        try:
            self._contexts.enter_context(self._tagger)
            self._contexts.enter_context(observe_saved(self._count_saved))
            self._contexts.enter_context(self._observer)
            if self._kernels is not None:
                self._kernels.start()
                self._contexts.callback(self._stop_kernels)
        except BaseException:
            self._release()
            raise

    def stop(self) -> Figures:
        """Remove everything, then sum the figures per module."""
        self._release()
        figures = self._figures()
        self._nodes.clear()
        self._saved = StorageBytes()
        return figures

    def _release(self) -> None:
        try:
            self._contexts.close()
        finally:
            handles, self._handles = self._handles, []
            for handle in handles:
                handle.remove()

    def _stop_kernels(self) -> None:
        if self._kernels is not None:
            self.kernel_rows = self._kernels.stop()

    @property
    def forward_built_graph(self) -> bool:
        """Whether a forward inside the audit recorded autograd nodes."""
        return bool(self._tagger.labels)

    # -- forward ---------------------------------------------------------------------------------
    def _count_saved(self, tensor: torch.Tensor) -> None:
        added = self._saved.add(tensor)
        if added:
            self._saved_bytes[self._tagger.current() or OUTSIDE] += added

    def _adopt(self, node: Node, module: str) -> _NodeInfo:
        info = _NodeInfo(
            module, [self._edge_kind(fn) for fn, _ in node.next_functions], _is_layout_only(node)
        )
        self._nodes[node] = info
        self._handles.append(node.register_prehook(lambda grad_outputs: self._started(info)))
        self._handles.append(
            node.register_hook(lambda inputs, outputs: self._finished(info, inputs))
        )
        return info

    def _edge_kind(self, fn: Node | None) -> tuple[str, str]:
        if fn is None:
            return ("none", "")
        while _is_layout_only(fn) and len(fn.next_functions) == 1:
            fn = fn.next_functions[0][0]
            if fn is None:
                return ("activation", "")
        variable = leaf_variable(fn)
        if variable is not None and id(variable) in self._params:
            return ("param", self._params[id(variable)][0])
        return ("activation", "")

    # -- backward --------------------------------------------------------------------------------
    def _started(self, info: _NodeInfo) -> None:
        self._backward_seen = True
        info.started = time.perf_counter()

    def _finished(self, info: _NodeInfo, grad_inputs: Any) -> None:
        self._backward_seen = True
        if info.started is not None:
            info.seconds += time.perf_counter() - info.started
        for grad, (kind, param_name) in zip(grad_inputs, info.edges, strict=False):
            if grad is None or info.layout_only:
                continue
            if kind == "param":
                info.wgrad = True
                info.wgrad_bytes += grad.nbytes
                self._check_waste(info, param_name, grad)
            elif kind == "activation":
                info.dgrad = True

    def _check_waste(self, info: _NodeInfo, param_name: str, grad: torch.Tensor) -> None:
        param = self._param_named[param_name]
        reason: WasteReason | None = None
        if not param.requires_grad:
            reason = "late_freeze"
        elif self._optimizer is not None and not _held_by(self._optimizer, param):
            reason = "not_in_optimizer"
        if reason is None:
            return
        key = storage_key(grad)
        flops = sum(count for keys, count in info.outputs if key in keys)
        self._wasted[(param_name, reason)] = self._wasted.get((param_name, reason), 0) + flops

    def _on_backward_op(self, node: Node, flops: int, outputs: list[Piece]) -> None:
        if is_leaf(node):
            return
        self._backward_seen = True
        info = self._nodes.get(node)
        if info is None:
            info = self._adopt_untagged(node)
            info.started = info.started or time.perf_counter()
        info.flops += flops
        info.outputs.extend(outputs)

    def _adopt_untagged(self, first: Node) -> _NodeInfo:
        """A node no forward hook tagged: adopt it and every untagged node upstream of it."""
        for node in walk([first], enter=lambda node: not is_leaf(node)):
            if node not in self._nodes:
                self._adopt(node, self._owner_of(node))
        return self._nodes[first]

    def _owner_of(self, node: Node) -> str:
        """The module whose parameter the node uses (as an input or saved), else outside."""
        names = [self._edge_kind(fn)[1] for fn in inputs_of(node)]
        names += [self._param_by_storage.get(storage_key(t), "") for t in saved_tensors(node)]
        for name in names:
            if name:
                return name.rpartition(".")[0]
        return OUTSIDE

    # -- the figures -------------------------------------------------------------------------------
    def _figures(self) -> Figures:
        records = {
            name: ModuleRecord(name, type(module).__name__, leaf=not any(module.children()))
            for name, module in self._model.named_modules()
        }
        own: dict[str, ModuleRecord] = defaultdict(lambda: ModuleRecord("", ""))
        for info in self._nodes.values():
            counts = own[info.module]
            counts.wgrad += int(info.wgrad)
            counts.dgrad += int(info.dgrad)
            counts.wgrad_bytes += info.wgrad_bytes
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
        wasted = [
            WastedGradient(name, name.rpartition(".")[0], reason, flops)  # type: ignore[arg-type]
            for (name, reason), flops in self._wasted.items()
        ]
        return Figures(
            list(records.values()),
            outside,
            wasted,
            forward_seen=self._tagger.forward_seen,
            backward_seen=self._backward_seen,
            uncounted_ops=sorted(self._observer.uncounted),
        )


def _is_layout_only(node: Node) -> bool:
    name = node.name().rstrip("0123456789")
    return name.endswith("Backward") and name[: -len("Backward")] in _LAYOUT_ONLY


def _held_by(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    return any(held is param for group in optimizer.param_groups for held in group["params"])
