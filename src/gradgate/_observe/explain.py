"""Classic autograd errors re-raised with the module, op, line and fix.

Inside :func:`explain`, a torch-function mode notes which op (at which line of user code,
inside which module) created each autograd node, and which in-place ops ran; global module
hooks (registered only inside the context) track the module being run. When PyTorch raises one
of three classic errors, the recorded nodes are probed (reading a node's saved tensors raises
the same error for the culprit) and a :class:`GradgateError` subclass is raised from
PyTorch's own error, which stays in the chain:

* :class:`SavedTensorModifiedError` — a tensor saved for backward was modified in place;
* :class:`GraphFreedError` — backward through a graph whose saved tensors were already freed;
* :class:`InferenceTensorError` — a tensor made under ``torch.inference_mode`` used in autograd.

What is available: everything made between entering the context and the error. Wrap both
the forward and the backward. If the forward ran before the context, only what PyTorch's
message says (type, shape, versions) and the fix are given; errors raised outside any
``explain`` context are not touched.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from contextlib import ContextDecorator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from .._plumbing.autograd import saved_attributes, walk
from .._plumbing.errors import (
    ExplainedError,
    GradgateError,
    GraphFreedError,
    InferenceTensorError,
    InvalidOptionError,
    SavedTensorModifiedError,
)
from .._plumbing.torch_internals import next_sequence_nr, sequence_nr
from .._plumbing.torch_internals.trees import tree_flatten

_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
_VERSIONS = re.compile(
    r"\[(?P<type>[\w.]+) \[(?P<shape>[^\]]*)\]\](?:, which is output \d+ of (?P<maker>\w+),)?"
    r" is at version (?P<now>\d+); expected version (?P<then>\d+)"
)


@dataclass
class _Site:
    """Where something happened: the op, the module being run, the line of user code."""

    op: str
    module: str | None
    line: str

    def __str__(self) -> str:
        inside = f"in module {self.module!r}" if self.module is not None else "outside any module"
        return f"op {self.op!r} {inside}, at {self.line}"


@dataclass
class _Node:
    node: Any
    site: _Site


@dataclass
class _Mutation:
    site: _Site
    shape: tuple[int, ...]
    version: int


@dataclass
class _Record:
    nodes: dict[int, _Node] = field(default_factory=dict)
    mutations: list[_Mutation] = field(default_factory=list)
    failure: tuple[_Site, list[tuple[int, ...]]] | None = None
    stack: list[str] = field(default_factory=list)
    first_node: int = 0  # sequence number of the first autograd node made inside the context


class Explainer(ContextDecorator):
    """The context manager (and decorator) returned by :func:`explain`."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self._model = model
        self._record = _Record()
        self._names: dict[int, str] = {}
        self._hooks: list[RemovableHandle] = []
        self._mode: _Recorder | None = None

    def __enter__(self) -> Explainer:
        self._record = _Record(first_node=next_sequence_nr())
        self._names = {}
        if self._model is not None:
            self._names = {id(m): n or type(m).__name__ for n, m in self._model.named_modules()}
        register = torch.nn.modules.module
        self._hooks = [
            register.register_module_forward_pre_hook(self._push),
            register.register_module_forward_hook(self._pop, always_call=True),
        ]
        self._mode = _Recorder(self._record, lambda: self._record.stack)
        self._mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        record, self._record = self._record, _Record()
        if isinstance(exc, RuntimeError) and not isinstance(exc, GradgateError):
            explained = _explain(exc, record)
            if explained is not None:
                raise explained from exc

    def _push(self, module: nn.Module, args: Any) -> None:
        self._record.stack.append(self._names.get(id(module), type(module).__name__))

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._record.stack:
            self._record.stack.pop()


def explain(model: nn.Module | None = None) -> Explainer:
    """Context manager / decorator: classic autograd errors come back explained.

    Pass the model to get qualified module names (``"encoder.layer.3"``); without it modules
    are named by class. Wrap the forward *and* the backward. Recording costs a little time
    per op and keeps the graph nodes made inside alive until exit: wrap one step, not a run.

    >>> import torch, gradgate as gg
    >>> w = torch.ones(3, requires_grad=True)
    >>> try:
    ...     with gg.explain():
    ...         y = w.exp()
    ...         _ = y.add_(1)
    ...         y.sum().backward()
    ... except gg.GradgateError as err:
    ...     print(type(err).__name__, "|", str(err).splitlines()[1].strip())
    SavedTensorModifiedError | saved by ExpBackward0: op 'exp' outside any module, at <doctest...
    """
    if model is not None and not isinstance(model, nn.Module):
        raise InvalidOptionError(
            f"gg.explain(model={model!r:.40}) got {type(model).__name__}; expected a "
            "torch.nn.Module "
            "(for qualified module names) or None."
        )
    return Explainer(model)


class _Recorder(TorchFunctionMode):
    """Notes the op, module and line behind every new autograd node and in-place op."""

    def __init__(self, record: _Record, stack: Callable[[], list[str]]) -> None:
        super().__init__()
        self._record = record
        self._stack = stack

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except RuntimeError:
            inputs, _ = tree_flatten((args, kwargs))
            shapes = [
                tuple(t.shape)
                for t in inputs
                if isinstance(t, torch.Tensor) and t.is_inference() and self._record.failure is None
            ]
            if self._record.failure is None:
                self._record.failure = (self._site(func), shapes)
            raise
        if isinstance(out, (torch.Tensor, tuple, list)):
            self._note_nodes(func, out)
        name = getattr(func, "__name__", "")
        if _is_in_place(name) and args and isinstance(args[0], torch.Tensor):
            target = args[0]
            if not target.is_inference():
                self._record.mutations.append(
                    _Mutation(self._site(func), tuple(target.shape), target._version)
                )
        return out

    def _note_nodes(self, func: Any, out: Any) -> None:
        outputs = [out] if isinstance(out, torch.Tensor) else out
        new: list[Any] = []
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                new.append(tensor.grad_fn)
        if not new or all(id(node) in self._record.nodes for node in new):
            return
        site, nodes = self._site(func), self._record.nodes

        def unrecorded(node: Any) -> bool:
            return id(node) not in nodes and sequence_nr(node) >= self._record.first_node

        for node in walk(new, enter=unrecorded):
            nodes[id(node)] = _Node(node, site)

    def _site(self, func: Any) -> _Site:
        stack = self._stack()
        return _Site(
            getattr(func, "__name__", repr(func)), stack[-1] if stack else None, _user_line()
        )


def _is_in_place(name: str) -> bool:
    if name in ("__setitem__",) or (name.startswith("__i") and name.endswith("__")):
        return True
    return name.endswith("_") and not name.startswith("_")


def _user_line() -> str:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_DIRS):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _explain(err: RuntimeError, record: _Record) -> ExplainedError | None:
    text = str(err)
    if "modified by an inplace operation" in text:
        return _explain_modified(text, record)
    if "backward through the graph a second time" in text:
        return _explain_freed(record)
    if "Inference tensors cannot be saved for backward" in text or (
        "Inplace update to inference tensor" in text
    ):
        return _explain_inference(text, record)
    return None


def _probe(record: _Record, marker: str) -> list[_Node]:
    """Recorded nodes whose saved tensors raise an error containing ``marker`` when read."""
    culprits = []
    for entry in record.nodes.values():
        for attribute in saved_attributes(entry.node):
            try:
                getattr(entry.node, attribute)
            except RuntimeError as err:
                if marker in str(err):
                    culprits.append(entry)
                    break
    return culprits


def _explain_modified(text: str, record: _Record) -> SavedTensorModifiedError:
    match = _VERSIONS.search(text)
    lines = ["a tensor saved for backward was modified in place before backward used it."]
    culprits = _probe(record, "modified by an inplace operation")
    for entry in culprits[:3]:
        lines.append(f"  saved by {entry.node.name()}: {entry.site}")
    if match is not None:
        shape = match["shape"].replace(" ", "")
        lines.append(
            f"  tensor: {match['type']} of shape [{shape}], saved at version {match['then']}, "
            f"now at version {match['now']}"
            + (f" (an output of {match['maker']})" if match["maker"] else "")
        )
        shape_tuple = tuple(int(s) for s in shape.split(",") if s)
        changes = [
            m for m in record.mutations if m.shape == shape_tuple and m.version == int(match["now"])
        ]
        if changes:
            lines.append(f"  modified in place by {changes[-1].site}")
    if not culprits:
        lines.append("  (the forward ran outside gg.explain(): wrap it too to name the op)")
    lines.append(
        "Fix: do not change the tensor in place between the forward and backward(): use the "
        "out-of-place form (x = x + 1 instead of x += 1 or x.add_(1); torch.where or "
        "x.masked_fill(...) instead of x[i] = v), or .clone() it before it is used; for a "
        "module, construct it with inplace=False (nn.ReLU(inplace=False))."
    )
    return SavedTensorModifiedError("\n".join(lines))


def _explain_freed(record: _Record) -> GraphFreedError:
    lines = [
        "backward ran through a graph whose saved tensors were freed by an earlier backward "
        "(a graph can be backpropagated through once unless retain_graph=True)."
    ]
    culprits = _probe(record, "second time")
    for entry in culprits[:3]:
        lines.append(f"  already used: {entry.node.name()}: {entry.site}")
    if not culprits:
        lines.append("  (the forward ran outside gg.explain(): wrap it too to name the op)")
    lines.append(
        "Fix: run the forward again before each backward; or pass retain_graph=True to the "
        "first backward if you really need two backwards through one graph (it keeps the "
        "activations in memory); if a tensor from an earlier step is reused (a hidden state, "
        "a running total), .detach() it at the start of each step."
    )
    return GraphFreedError("\n".join(lines))


def _explain_inference(text: str, record: _Record) -> InferenceTensorError:
    lines = ["a tensor created under torch.inference_mode() was used in autograd."]
    if record.failure is not None:
        site, shapes = record.failure
        lines.append(f"  failing op: {site}")
        for shape in shapes[:3]:
            lines.append(f"  inference tensor of shape {list(shape)}")
    lines.append(
        "Fix: compute it under torch.no_grad() instead of torch.inference_mode() when its "
        "result feeds a graph, or .clone() the inference tensor outside inference_mode before "
        "using it (the clone is a normal tensor)."
    )
    return InferenceTensorError("\n".join(lines))
