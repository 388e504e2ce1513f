"""Clusters (one per module that owns a node) and the marker where the gradient stops."""

from __future__ import annotations

import functools
from dataclasses import replace

from torch import nn

from ..._plumbing.autograd import Node, is_leaf
from ..._select.names import ancestors
from .parts import (
    ClusterState,
    GraphCluster,
    GraphEdge,
    GraphNode,
    Walk,
    ancestors_and_self,
    common,
)


def build_clusters(model: nn.Module | None, nodes: list[GraphNode]) -> dict[str, GraphCluster]:
    """One cluster per module that owns a node, and their ancestors, in model order;
    containers that run no code (``ModuleList``) and own no node are skipped."""
    if model is None:
        return {}
    owning = {node.module for node in nodes if node.module is not None}
    needed = {ancestor for name in owning for ancestor in ancestors_and_self(name)}
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
            for name in ancestors_and_self(node.module):
                kinds_below.setdefault(name, set()).add(state)
    states: dict[str, ClusterState] = {}
    for name, found in kinds_below.items():
        states[name] = found.pop() if len(found) == 1 else "mixed"  # type: ignore[assignment]
    return states


def in_displayed(node: GraphNode, clusters: dict[str, GraphCluster]) -> GraphNode:
    """The node moved to its nearest displayed cluster."""
    if node.module is None or node.module in clusters:
        return node
    home = next((a for a in ancestors(node.module) if a in clusters), None)
    return replace(node, module=home)


def stop_marker(
    model: nn.Module | None,
    walk: Walk,
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
    home = functools.reduce(common, [last, *(s.module or "" for s in sources)])
    home_cluster = next((a for a in ancestors_and_self(home) if a in clusters), None)
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
    with_ops = {a for name in ops_in if name is not None for a in ancestors_and_self(name)}
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
    walk: Walk, nodes: list[GraphNode], position: dict[str, int], after: int
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
    if is_leaf(node):
        return True
    slots = [fn for fn, _ in node.next_functions]
    return (
        depth < 4
        and bool(slots)
        and all(fn is not None and _leaves_only(fn, depth + 1) for fn in slots)
    )
