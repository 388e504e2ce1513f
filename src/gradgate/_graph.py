"""What does the graph look like? The autograd graph, grouped by module, coloured by state.

:func:`graph` walks ``loss.grad_fn`` and groups the autograd nodes into clusters, one per
module that created them (nested modules nest). Parameters show as learning, frozen (greyed;
torchviz leaves them out because they are not in the autograd graph) or cut (dashed: they
require grad but no graph was recorded for them), and a red marker shows where the gradient
stops. Repeated identical blocks collapse into one cluster with a count.

Module attribution comes from one of two sources:

* ``gg.graph(loss, model=model)`` after the forward: each parameter's node belongs to its
  module (by identity); every other node goes to the common ancestor of the modules whose
  parameter-using ops were created just before and just after it (autograd numbers nodes in
  creation order). Ops created after the model's last parameter op (the loss) stay outside.
* ``with gg.graph.recording(model) as rec:`` around the forward: forward hooks tag each node
  with the innermost module whose call created it; ``rec.graph(loss)`` uses these tags.
"""

from __future__ import annotations

import bisect
import functools
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._dot import GraphvizError, GraphvizNotFoundError, run_dot, to_dot
from ._errors import InvalidOptionError, NoGraphError
from ._select import ancestors
from ._autograd import tensors_in
from ._validate import check_choice

__all__ = [
    "Graph",
    "GraphCluster",
    "GraphEdge",
    "GraphNode",
    "GraphRecording",
    "GraphvizError",
    "GraphvizNotFoundError",
    "NoGraphError",
    "graph",
]

NodeKind = Literal["op", "loss", "param", "frozen", "late_frozen", "cut", "input", "stop"]
EdgeKind = Literal["grad", "cut", "to_stop"]
ClusterState = Literal["learning", "frozen", "cut", "mixed", "none"]
RenderFormat = Literal["svg", "png"]
Node = Any  # torch.autograd.graph.Node; its Python API is only partly typed


@dataclass(frozen=True)
class GraphNode:
    """One box of the picture: an autograd op, a parameter, an input, or the stop marker."""

    id: str
    kind: NodeKind
    label: str
    module: str | None = None  # the cluster it is drawn in; None: outside every module
    tooltip: str = ""
    saved_bytes: int | None = None
    key: tuple[str, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class GraphEdge:
    """An arrow in forward direction: from an op's input to the op (gradients flow back)."""

    src: str
    dst: str
    kind: EdgeKind = "grad"


@dataclass(frozen=True)
class GraphCluster:
    """One module's box; ``count > 1`` when identical consecutive blocks were collapsed."""

    name: str
    parent: str | None
    title: str
    tooltip: str
    type_name: str
    state: ClusterState
    count: int = 1
    members: tuple[str, ...] = ()


class Graph:
    """The autograd graph of a loss, grouped by module; see :func:`gradgate.graph`.

    ``nodes``, ``edges`` and ``clusters`` (by module name, in model order) hold the picture;
    ``to_dot()`` writes it as DOT text, ``render()`` and ``to_svg()`` run Graphviz's ``dot``.
    """

    def __init__(
        self,
        nodes: Sequence[GraphNode],
        edges: Sequence[GraphEdge],
        clusters: Mapping[str, GraphCluster],
    ) -> None:
        self.nodes: tuple[GraphNode, ...] = tuple(nodes)
        self.edges: tuple[GraphEdge, ...] = tuple(edges)
        self.clusters: dict[str, GraphCluster] = dict(clusters)

    @property
    def stop_edges(self) -> list[GraphEdge]:
        """The red edges from the stop marker to the first ops that learn (empty: no stop)."""
        return [edge for edge in self.edges if edge.kind == "cut"]

    def node(self, node_id: str) -> GraphNode:
        """The node with this id."""
        return next(node for node in self.nodes if node.id == node_id)

    def to_dot(self, *, legend: bool = True) -> str:
        """DOT text for Graphviz; needs nothing installed.

        >>> import torch, gradgate as gg
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
        >>> with gg.frozen(net, "0"):
        ...     loss = net(torch.randn(2, 3)).sum()
        >>> dot = gg.graph(loss, model=net).to_dot()
        >>> dot.startswith("digraph"), "frozen parameter" in dot, "gradient stops" in dot
        (True, True, True)
        """
        return to_dot(self, legend=legend)

    def to_svg(self, *, legend: bool = True) -> str:
        """The picture as SVG text (for inline use in HTML); needs Graphviz's ``dot``."""
        return run_dot(self.to_dot(legend=legend), "svg").decode("utf-8")

    def render(
        self, path: str | Path, *, format: RenderFormat | None = None, legend: bool = True
    ) -> Path:
        """Write the picture to ``path`` as SVG or PNG (from the suffix unless ``format``
        is given); needs Graphviz's ``dot`` (Debian package ``graphviz``)."""
        path = Path(path)
        chosen = format or (path.suffix[1:].lower() if path.suffix else "svg")
        check_choice("format", chosen, get_args(RenderFormat))
        path.write_bytes(run_dot(self.to_dot(legend=legend), chosen))
        return path

    def __repr__(self) -> str:
        ops = sum(node.kind in ("op", "loss") for node in self.nodes)
        stop = ", with a stop" if self.stop_edges else ""
        return f"<gradgate.Graph {ops} ops, {len(self.clusters)} clusters{stop}>"


# -- recording attribution during the forward -------------------------------------------------


@dataclass
class _Call:
    module: nn.Module
    inputs: set[Node]
    created: set[Node] = field(default_factory=set)


class GraphRecording:
    """Records which module creates each autograd node; see :func:`graph` ``.recording``.

    Forward hooks are registered on entry and removed on exit; ``graph(loss)`` works after
    the ``with`` block too. The recording keeps the tagged nodes alive while it lives.
    """

    def __init__(self, model: nn.Module) -> None:
        _check_model(model)
        self.model: nn.Module = model
        self.labels: dict[Node, str] = {}
        self._calls: list[_Call] = []
        self._hooks: list[RemovableHandle] = []

    def __enter__(self) -> GraphRecording:
        for name, module in self.model.named_modules():
            self._hooks.append(module.register_forward_pre_hook(self._entering, with_kwargs=True))
            self._hooks.append(
                module.register_forward_hook(
                    functools.partial(self._leaving, name), with_kwargs=True, always_call=True
                )
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._calls = []

    def _entering(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        inputs = {t.grad_fn for t in tensors_in((args, kwargs)) if t.grad_fn is not None}
        self._calls.append(_Call(module, inputs))

    def _leaving(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._calls or self._calls[-1].module is not module:
            return  # our pre-hook did not run for this call (an earlier hook raised)
        call = self._calls.pop()
        stack = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        seen: set[Node] = set()
        while stack:
            node = stack.pop()
            if node in seen or node in call.inputs or _is_leaf(node):
                continue
            seen.add(node)
            if node not in self.labels:
                self.labels[node] = name
                call.created.add(node)
            elif node not in call.created:
                continue  # created before this call: not ours, and nothing behind it is
            stack.extend(fn for fn, _ in node.next_functions if fn is not None)
        if self._calls:
            self._calls[-1].created |= call.created

    def graph(
        self,
        loss: torch.Tensor | Sequence[torch.Tensor],
        *,
        collapse: bool = True,
        saved: bool = False,
        audit: Any = None,
    ) -> Graph:
        """The graph of ``loss``, with the module of every node as recorded."""
        return _build(loss, self.model, self.labels, collapse=collapse, saved=saved, audit=audit)

    def __repr__(self) -> str:
        state = "recording" if self._hooks else "stopped"
        return f"<gradgate.GraphRecording {len(self.labels)} nodes tagged ({state})>"


# -- the public entry point -------------------------------------------------------------------


class _GraphFunction:
    """``gg.graph``: a function with a ``recording`` helper attached."""

    recording = GraphRecording

    def __call__(
        self,
        loss: torch.Tensor | Sequence[torch.Tensor],
        model: nn.Module | None = None,
        *,
        collapse: bool = True,
        saved: bool = False,
        audit: Any = None,
    ) -> Graph:
        """The autograd graph of ``loss``, grouped by the modules of ``model``.

        * ``collapse`` — draw runs of identical numbered blocks as one cluster with a count
          (``h.0–23 ×24``);
        * ``saved`` — label ops with the bytes they saved for backward (parameters excluded);
        * ``audit`` — a report with ``.modules`` records (``name``, ``wgrad``, ``dgrad``,
          ``backward_flops``), e.g. from :func:`gradgate.audit`, shown on the clusters.

        For exact module attribution, record it during the forward with
        ``with gg.graph.recording(model) as rec: ...`` and call ``rec.graph(loss)``.

        >>> import torch, gradgate as gg
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])
        >>> with gg.backprop_depth(net, 1):
        ...     loss = net(torch.randn(2, 3)).sum()
        >>> g = gg.graph(loss, model=net)
        >>> {name: c.state for name, c in g.clusters.items()}
        {'': 'mixed', '0': 'cut', '3': 'learning'}
        >>> g.clusters["0"].title
        '0–2 ×3 (Linear)\\ncut: no graph'
        >>> with gg.graph.recording(net) as rec:
        ...     loss = net(torch.randn(2, 3)).sum()
        >>> print(rec.graph(loss, collapse=False).clusters["2"].title)
        2 (Linear)
        """
        return _build(loss, model, None, collapse=collapse, saved=saved, audit=audit)

    def __repr__(self) -> str:
        return "<function gradgate.graph>"


graph = _GraphFunction()
graph.__doc__ = _GraphFunction.__call__.__doc__


# -- building ---------------------------------------------------------------------------------


@dataclass
class _Walk:
    """Every autograd node reachable from the roots, in discovery order, with its inputs."""

    order: list[Node]
    inputs: dict[Node, list[Node]]


def _build(
    loss: torch.Tensor | Sequence[torch.Tensor],
    model: nn.Module | None,
    recorded: dict[Node, str] | None,
    *,
    collapse: bool,
    saved: bool,
    audit: Any,
) -> Graph:
    check_choice("collapse", collapse, (True, False))
    check_choice("saved", saved, (True, False))
    roots = _roots(loss)
    if model is not None:
        _check_model(model)
    audit_figures = _audit_figures(audit)
    walk = _walk_graph(roots)
    params = _ParamIndex(model)
    labels = _attribute(walk, params, model, recorded)
    nodes, edges = _autograd_nodes(walk, roots, params, labels, saved)
    nodes.extend(_absent_parameters(params, walk))
    clusters = _clusters(model, nodes)
    nodes = [_in_displayed(node, clusters) for node in nodes]
    stop_nodes, stop_edges = _stop_marker(model, walk, nodes, clusters)
    nodes.extend(stop_nodes)
    edges.extend(stop_edges)
    if collapse:
        nodes, edges, clusters = _collapse(model, nodes, edges, clusters)
    clusters = _decorate(clusters, audit_figures)
    return Graph(nodes, edges, clusters)


def _roots(loss: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    given: object = loss
    tensors: list[Any] = list(given) if isinstance(given, (list, tuple)) else [given]
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise NoGraphError(
            f"loss has type {type(loss).__name__}; expected a torch.Tensor (or a sequence of "
            "them) computed with autograd, e.g. loss = loss_fn(model(x), y)."
        )
    for tensor in tensors:
        if tensor.grad_fn is None and not tensor.requires_grad:
            raise NoGraphError(
                "loss has no autograd graph (grad_fn is None, requires_grad is False): it was "
                "computed under torch.no_grad() or torch.inference_mode(), or nothing before "
                "it requires grad (every parameter frozen or cut). Compute it with grad "
                "enabled and at least one learning parameter."
            )
    return tensors


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise InvalidOptionError(
            f"model has type {type(model).__name__}; expected a torch.nn.Module (or None)."
        )


def _walk_graph(roots: list[torch.Tensor]) -> _Walk:
    order: list[Node] = []
    inputs: dict[Node, list[Node]] = {}
    stack = [_root_node(root) for root in reversed(roots)]
    while stack:
        node = stack.pop()
        if node in inputs:
            continue
        order.append(node)
        inputs[node] = [fn for fn, _ in node.next_functions if fn is not None]
        stack.extend(reversed(inputs[node]))
    return _Walk(order, inputs)


def _root_node(tensor: torch.Tensor) -> Node:
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    return torch.autograd.graph.get_gradient_edge(tensor).node


def _is_leaf(node: Node) -> bool:
    return hasattr(node, "variable")


class _ParamIndex:
    """The model's parameters by identity, with qualified names and owning modules."""

    def __init__(self, model: nn.Module | None) -> None:
        named = [] if model is None else list(model.named_parameters())
        self.named: list[tuple[str, nn.Parameter]] = named
        self.by_id: dict[int, str] = {id(p): name for name, p in named}
        if model is not None:
            for name, p in model.named_parameters(remove_duplicate=False):
                self.by_id.setdefault(id(p), name)
        self.pointers = {p.untyped_storage().data_ptr() for _, p in named}

    def owner(self, node: Node) -> str | None:
        """The owning module of the parameter behind an AccumulateGrad node, if any."""
        name = self.by_id.get(id(node.variable)) if _is_leaf(node) else None
        return None if name is None else name.rpartition(".")[0]


def _attribute(
    walk: _Walk, params: _ParamIndex, model: nn.Module | None, recorded: dict[Node, str] | None
) -> dict[Node, str | None]:
    """The module name of every op node (None: outside the model)."""
    if model is None:
        return {}
    if recorded is not None:
        return {node: recorded.get(node) for node in walk.order if not _is_leaf(node)}
    return _attribute_by_order(walk, params, model)


def _attribute_by_order(
    walk: _Walk, params: _ParamIndex, model: nn.Module
) -> dict[Node, str | None]:
    """Ops that use a parameter belong to its module; the others to the common ancestor of
    the parameter ops created just before and after them (autograd numbers nodes in order)."""
    anchors: list[tuple[int, str]] = []
    for node in walk.order:
        if _is_leaf(node):
            continue
        owners = [params.owner(fn) for fn in walk.inputs[node]]
        owners += [_param_only_owner(fn, params) for fn in walk.inputs[node]]
        found = [owner for owner in owners if owner is not None]
        if found:
            anchors.append((node._sequence_nr(), functools.reduce(_common, found)))
    anchors.sort()
    numbers = [number for number, _ in anchors]
    layout = _Layout(model)
    labels: dict[Node, str | None] = {}
    for node in walk.order:
        if _is_leaf(node):
            continue
        number = node._sequence_nr()
        at = bisect.bisect_left(numbers, number)
        if at < len(numbers) and numbers[at] == number:
            labels[node] = anchors[at][1]
        elif 0 < at < len(numbers):
            labels[node] = layout.between(anchors[at - 1][1], anchors[at][1])
        else:
            labels[node] = None
    return labels


def _param_only_owner(node: Node, params: _ParamIndex) -> str | None:
    """The owner when ``node`` only transforms parameters (``weight.t()``), else None."""
    if _is_leaf(node):
        return None
    slots = [fn for fn, _ in node.next_functions]
    owners = [None if fn is None else params.owner(fn) for fn in slots]
    if not owners or any(owner is None for owner in owners):
        return None
    return functools.reduce(_common, [o for o in owners if o is not None])


class _Layout:
    """The model's modules in order, and those whose parameters are all frozen."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = dict(model.named_modules())
        self.position = {name: i for i, name in enumerate(self.modules)}
        self.frozen = [
            name
            for name, module in self.modules.items()
            if (own := list(module.parameters(recurse=False)))
            and not any(p.requires_grad for p in own)
        ]

    def between(self, before: str, after: str) -> str:
        """Where an op created between the parameter ops of two modules belongs.

        A frozen module between them in model order ran it (its own parameter ops are not in
        the graph); else their common ancestor; but when the earlier one lies in an element
        of a container that runs no code (a block of a ``ModuleList``), that element: the
        code between two blocks runs at the end of the earlier one.
        """
        first, last = self.position[before], self.position[after]
        frozen = [n for n in self.frozen if first < self.position[n] < last]
        if frozen:
            return str(functools.reduce(_common, frozen))
        common = _common(before, after)
        below = [n for n in _ancestors_and_self(before) if n != common and _inside(n, common)]
        for name in reversed(below):
            parent = self.modules.get(name.rpartition(".")[0])
            if parent is not None and type(parent).forward is nn.Module.forward:
                return name
        return common


def _inside(name: str, ancestor: str) -> bool:
    return not ancestor or name == ancestor or name.startswith(f"{ancestor}.")


def _common(a: str, b: str) -> str:
    parts = []
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        parts.append(x)
    return ".".join(parts) if a and b else ""


def _autograd_nodes(
    walk: _Walk,
    roots: list[torch.Tensor],
    params: _ParamIndex,
    labels: dict[Node, str | None],
    saved: bool,
) -> tuple[list[GraphNode], list[GraphEdge]]:
    ids = {node: f"n{i}" for i, node in enumerate(walk.order)}
    root_nodes = {_root_node(root) for root in roots}
    nodes = []
    for node in walk.order:
        if _is_leaf(node):
            nodes.append(_leaf_node(ids[node], node, params))
        else:
            kind: NodeKind = "loss" if node in root_nodes else "op"
            size = _saved_bytes(node, params.pointers) if saved else None
            label = node.name() + ("\nloss" if kind == "loss" else "")
            label += f"\nsaved {_format_bytes(size)}" if size else ""
            module = labels.get(node)
            nodes.append(
                GraphNode(
                    ids[node],
                    kind,
                    label,
                    module,
                    tooltip=f"{node.name()} in {module or 'no module'}",
                    saved_bytes=size,
                    key=(f"{node._sequence_nr():020d}",),
                )
            )
    edges = [GraphEdge(ids[fn], ids[node]) for node in walk.order for fn in walk.inputs[node]]
    return nodes, edges


def _leaf_node(node_id: str, node: Node, params: _ParamIndex) -> GraphNode:
    variable = node.variable
    shape = str(tuple(variable.shape))
    name = params.by_id.get(id(variable))
    if name is None:
        kind: NodeKind = "param" if isinstance(variable, nn.Parameter) else "input"
        label = "parameter" if kind == "param" else "input"
        return GraphNode(node_id, kind, f"{label}\n{shape}", None, tooltip=f"{label} {shape}")
    if variable.requires_grad:
        return _param_node(node_id, name, variable, "param")
    return _param_node(node_id, name, variable, "late_frozen")


_PARAM_NOTES = {
    "param": "learning",
    "frozen": "frozen: no wgrad",
    "late_frozen": "frozen after the forward: wgrad still computed, then dropped",
    "cut": "requires grad but has no graph (cut or unused): no gradient",
}


def _param_node(node_id: str, name: str, param: torch.Tensor, kind: NodeKind) -> GraphNode:
    owner, _, short = name.rpartition(".")
    label = f"{short}\n{tuple(param.shape)}"
    if kind == "late_frozen":
        label += "\nfrozen late: wgrad wasted"
    return GraphNode(
        node_id,
        kind,
        label,
        owner,
        tooltip=f"{name} {tuple(param.shape)}: {_PARAM_NOTES[kind]}",
        key=(short,),
    )


def _absent_parameters(params: _ParamIndex, walk: _Walk) -> list[GraphNode]:
    """Frozen and cut parameters: not in the autograd graph, drawn all the same."""
    present = {id(node.variable) for node in walk.order if _is_leaf(node)}
    found = []
    for i, (name, param) in enumerate(params.named):
        if id(param) not in present:
            kind: NodeKind = "cut" if param.requires_grad else "frozen"
            found.append(_param_node(f"p{i}", name, param, kind))
    return found


def _saved_bytes(node: Node, param_pointers: set[int]) -> int:
    """Bytes of the tensors ``node`` saved for backward, each storage once, parameters out."""
    storages: dict[int, int] = {}
    for attribute in dir(node):
        if not attribute.startswith("_saved_"):
            continue
        try:
            value = getattr(node, attribute)
        except RuntimeError:  # freed by a backward already
            continue
        for tensor in tensors_in(value):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in param_pointers:
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _format_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


# -- clusters ---------------------------------------------------------------------------------


def _clusters(model: nn.Module | None, nodes: list[GraphNode]) -> dict[str, GraphCluster]:
    """One cluster per module that owns a node, and their ancestors, in model order;
    containers that run no code (``ModuleList``) and own no node are skipped."""
    if model is None:
        return {}
    owning = {node.module for node in nodes if node.module is not None}
    needed = {ancestor for name in owning for ancestor in _ancestors_and_self(name)}
    states = _module_states(model, nodes)
    clusters: dict[str, GraphCluster] = {}
    for name, module in model.named_modules():
        if name not in needed:
            continue
        if name and name not in owning and type(module).forward is nn.Module.forward:
            continue
        parent = next((a for a in ancestors(name) if a in clusters), None)
        relative = name[len(parent) :].lstrip(".") if parent else name
        type_name = type(module).__name__
        title = f"{relative} ({type_name})" if relative else type_name
        clusters[name] = GraphCluster(
            name,
            parent,
            title,
            f"{name or 'model'} ({type_name})",
            type_name,
            states.get(name, "none"),
            members=(name,),
        )
    return clusters


def _module_states(model: nn.Module, nodes: list[GraphNode]) -> dict[str, ClusterState]:
    kinds_below: dict[str, set[str]] = {}
    for node in nodes:
        if node.kind in ("param", "frozen", "late_frozen", "cut") and node.module is not None:
            state = {"param": "learning", "late_frozen": "frozen"}.get(node.kind, node.kind)
            for name in _ancestors_and_self(node.module):
                kinds_below.setdefault(name, set()).add(state)
    states: dict[str, ClusterState] = {}
    for name, found in kinds_below.items():
        states[name] = found.pop() if len(found) == 1 else "mixed"  # type: ignore[assignment]
    return states


def _in_displayed(node: GraphNode, clusters: dict[str, GraphCluster]) -> GraphNode:
    """The node moved to its nearest displayed cluster."""
    if node.module is None or node.module in clusters:
        return node
    home = next((a for a in ancestors(node.module) if a in clusters), None)
    return replace(node, module=home)


def _ancestors_and_self(name: str) -> list[str]:
    return [name, *ancestors(name)]


# -- where the gradient stops -----------------------------------------------------------------


def _stop_marker(
    model: nn.Module | None,
    walk: _Walk,
    nodes: list[GraphNode],
    clusters: dict[str, GraphCluster],
) -> tuple[list[GraphNode], list[GraphEdge]]:
    """A stop node between the last module with parameters but no graph and the first ops
    that learn, when such a module exists."""
    if model is None:
        return [], []
    position = {name: i for i, (name, _) in enumerate(model.named_modules())}
    silent = _silent_modules(nodes)
    if not silent:
        return [], []
    last = max(silent, key=lambda name: position.get(name, -1))
    sources = _first_learning_ops(walk, nodes, position, position.get(last, -1))
    if not sources:
        return [], []
    tail = next(n for n in nodes if n.module == last and n.kind in ("frozen", "cut"))
    reason = (
        "cut: no graph recorded above" if silent[last] == "cut" else "nothing above requires grad"
    )
    home = functools.reduce(_common, [last, *(s.module or "" for s in sources)])
    home_cluster = next((a for a in _ancestors_and_self(home) if a in clusters), None)
    stop = GraphNode(
        "stop",
        "stop",
        f"gradient stops here\n({reason})",
        home_cluster,
        tooltip=f"backward ends here: {last!r} and the modules before it get no gradient",
    )
    edges = [GraphEdge(tail.id, "stop", "to_stop")]
    edges += [GraphEdge("stop", source.id, "cut") for source in sources]
    return [stop], edges


def _silent_modules(nodes: list[GraphNode]) -> dict[str, str]:
    """Modules owning parameters none of which is in the graph, and no op: name -> state."""
    ops_in = {node.module for node in nodes if node.kind in ("op", "loss")}
    with_ops = {a for name in ops_in if name is not None for a in _ancestors_and_self(name)}
    states: dict[str, set[str]] = {}
    for node in nodes:
        if node.kind in ("param", "frozen", "late_frozen", "cut") and node.module is not None:
            states.setdefault(node.module, set()).add(node.kind)
    return {
        name: "cut" if "cut" in kinds else "frozen"
        for name, kinds in states.items()
        if kinds <= {"frozen", "cut"} and name not in with_ops
    }


def _first_learning_ops(
    walk: _Walk, nodes: list[GraphNode], position: dict[str, int], after: int
) -> list[GraphNode]:
    """Ops with an input that has no graph and no other op as input: where backward ends."""
    by_id = {node.id: node for node in nodes}
    sources = []
    for i, node in enumerate(walk.order):
        slots = [fn for fn, _ in node.next_functions]
        if None in slots and all(fn is None or _leaves_only(fn) for fn in slots):
            sources.append(by_id[f"n{i}"])
    inside = [s for s in sources if s.module is not None]
    later = [s for s in inside if position.get(s.module or "", -1) > after]
    chosen = later or inside or sources
    return sorted(chosen, key=lambda node: node.key)[:3]


def _leaves_only(node: Node, depth: int = 0) -> bool:
    """Whether ``node`` is a leaf or only transforms leaves (``weight.t()``)."""
    if _is_leaf(node):
        return True
    slots = [fn for fn, _ in node.next_functions]
    return (
        depth < 4
        and bool(slots)
        and all(fn is not None and _leaves_only(fn, depth + 1) for fn in slots)
    )


# -- collapsing repeated blocks ---------------------------------------------------------------


def _collapse(
    model: nn.Module | None,
    nodes: list[GraphNode],
    edges: list[GraphEdge],
    clusters: dict[str, GraphCluster],
) -> tuple[list[GraphNode], list[GraphEdge], dict[str, GraphCluster]]:
    """Runs of consecutive numbered sibling clusters with identical content become one."""
    if model is None or not clusters:
        return nodes, edges, clusters
    own: dict[str | None, list[GraphNode]] = {}
    for node in nodes:
        own.setdefault(node.module, []).append(node)
    children: dict[str | None, list[str]] = {}
    for cluster in clusters.values():
        children.setdefault(cluster.parent, []).append(cluster.name)
    signature = _Signatures(clusters, own, children)
    runs = [run for parent in clusters for run in _runs(children.get(parent, []), signature)]
    runs = _outermost(runs)
    if not runs:
        return nodes, edges, clusters
    moved: dict[str, str] = {}  # node id -> id of its twin in the first member
    member_of: dict[str, tuple[int, int]] = {}  # node id -> (run, member)
    dropped: set[str] = set()
    for r, run in enumerate(runs):
        twins = _node_keys(run[0], own, children)
        for m, member in enumerate(run):
            for key, node in _node_keys(member, own, children).items():
                member_of[node.id] = (r, m)
                if m > 0:
                    moved[node.id] = twins[key].id if key in twins else ""
        for member in run[1:]:
            dropped.update(_subtree(member, children))
    new_nodes = [node for node in nodes if node.id not in moved]
    new_edges = _redirect(edges, moved, member_of)
    new_clusters = {name: c for name, c in clusters.items() if name not in dropped}
    for run in runs:
        new_clusters[run[0]] = _merged(clusters[run[0]], clusters[run[-1]], run)
    return new_nodes, new_edges, new_clusters


class _Signatures:
    """What a cluster looks like (type, state, ops and parameters, sub-clusters), cached."""

    def __init__(
        self,
        clusters: dict[str, GraphCluster],
        own: dict[str | None, list[GraphNode]],
        children: dict[str | None, list[str]],
    ) -> None:
        self._clusters, self._own, self._children = clusters, own, children
        self._cache: dict[str, object] = {}

    def __call__(self, name: str) -> object:
        if name not in self._cache:
            cluster = self._clusters[name]
            content = Counter((node.kind, node.label) for node in self._own.get(name, []))
            below = tuple(
                (child[len(name) :], self(child)) for child in self._children.get(name, [])
            )
            self._cache[name] = (
                cluster.type_name,
                cluster.state,
                tuple(sorted(content.items())),
                below,
            )
        return self._cache[name]


def _runs(names: list[str], signature: _Signatures) -> Iterator[list[str]]:
    run: list[str] = []
    for name in [*names, None]:
        if (
            name is not None
            and run
            and _follows(run[-1], name)
            and signature(run[-1]) == signature(name)
        ):
            run.append(name)
            continue
        if len(run) >= 2:
            yield run
        run = [name] if name is not None and _number(name) is not None else []


def _number(name: str) -> int | None:
    last = name.rpartition(".")[2]
    return int(last) if last.isdigit() else None


def _follows(previous: str, name: str) -> bool:
    a, b = _number(previous), _number(name)
    same_parent = previous.rpartition(".")[0] == name.rpartition(".")[0]
    return a is not None and b == a + 1 and same_parent


def _outermost(runs: list[list[str]]) -> list[list[str]]:
    """Drop runs nested inside a member of another run (the first member stays drawn)."""
    hidden = {member for run in runs for member in run[1:]}
    return [run for run in runs if not any(a in hidden for a in ancestors(run[0]))]


def _subtree(name: str, children: dict[str | None, list[str]]) -> list[str]:
    found = [name]
    for child in children.get(name, []):
        found.extend(_subtree(child, children))
    return found


def _node_keys(
    member: str, own: dict[str | None, list[GraphNode]], children: dict[str | None, list[str]]
) -> dict[tuple[object, ...], GraphNode]:
    """The member's nodes keyed by (cluster relative to the member, label, occurrence)."""
    keyed: dict[tuple[object, ...], GraphNode] = {}
    for cluster in _subtree(member, children):
        seen: Counter[tuple[str, str]] = Counter()
        for node in sorted(own.get(cluster, []), key=lambda n: n.key):
            tag = (node.kind, node.label)
            keyed[(cluster[len(member) :], node.kind, node.label, seen[tag])] = node
            seen[tag] += 1
    return keyed


def _redirect(
    edges: list[GraphEdge], moved: dict[str, str], member_of: dict[str, tuple[int, int]]
) -> list[GraphEdge]:
    """Edges onto the first member; edges between two members of one run are dropped."""
    result: dict[tuple[str, str, str], GraphEdge] = {}
    for edge in edges:
        a, b = member_of.get(edge.src), member_of.get(edge.dst)
        if a is not None and b is not None and a[0] == b[0] and a[1] != b[1]:
            continue
        src, dst = moved.get(edge.src, edge.src), moved.get(edge.dst, edge.dst)
        if not src or not dst or src == dst:
            continue
        result.setdefault((src, dst, edge.kind), replace(edge, src=src, dst=dst))
    return list(result.values())


def _merged(first: GraphCluster, last: GraphCluster, run: list[str]) -> GraphCluster:
    prefix = first.title.split(" (")[0]
    end = last.name.rpartition(".")[2]
    return replace(
        first,
        title=f"{prefix}–{end} ×{len(run)} ({first.type_name})",
        tooltip=f"{len(run)} identical blocks {run[0]} … {run[-1]} ({first.type_name})",
        count=len(run),
        members=tuple(run),
    )


# -- audit figures ----------------------------------------------------------------------------


def _audit_figures(audit: Any) -> dict[str, dict[str, float]]:
    """``{module name: {figure: value}}`` from an audit report's ``.modules`` records."""
    if audit is None:
        return {}
    records = getattr(audit, "modules", None)
    if records is None:
        raise InvalidOptionError(
            f"audit has type {type(audit).__name__} and no .modules; expected a report from "
            "gg.audit(model) (records with name, wgrad, dgrad, backward_flops) or None."
        )
    if isinstance(records, Mapping):
        records = [{"name": name, **_record_dict(record)} for name, record in records.items()]
    figures: dict[str, dict[str, float]] = {}
    for record in records:
        values = _record_dict(record)
        name = str(values.get("name", ""))
        figures[name] = {
            key: float(values[key])
            for key in ("wgrad", "dgrad", "backward_flops")
            if isinstance(values.get(key), (int, float))
        }
    return figures


def _record_dict(record: Any) -> dict[str, Any]:
    if isinstance(record, Mapping):
        return dict(record)
    keys = ("name", "wgrad", "dgrad", "backward_flops")
    return {key: getattr(record, key) for key in keys if hasattr(record, key)}


def _decorate(
    clusters: dict[str, GraphCluster], figures: dict[str, dict[str, float]]
) -> dict[str, GraphCluster]:
    """Cluster titles with state notes and audit figures (summed over collapsed members)."""
    result = {}
    for name, cluster in clusters.items():
        lines = [cluster.title]
        if cluster.state == "cut":
            lines.append("cut: no graph")
        elif cluster.state == "frozen":
            lines.append("frozen")
        summary = _figure_line([figures[m] for m in cluster.members if m in figures])
        if summary:
            lines.append(summary)
        result[name] = replace(cluster, title="\n".join(lines))
    return result


def _figure_line(records: Iterable[dict[str, float]]) -> str:
    totals: Counter[str] = Counter()
    found = False
    for record in records:
        found = True
        totals.update(record)
    if not found:
        return ""
    parts = [f"{key} {totals[key]:g}" for key in ("wgrad", "dgrad") if key in totals]
    if "backward_flops" in totals:
        parts.append(f"{_format_flops(totals['backward_flops'])} backward")
    return " · ".join(parts)


def _format_flops(flops: float) -> str:
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.1f} {unit}"
    return f"{flops:.0f} FLOP"
