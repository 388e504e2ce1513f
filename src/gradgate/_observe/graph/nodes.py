"""The boxes of the picture: autograd ops, parameters (learning, frozen, cut) and inputs."""

from __future__ import annotations

import torch
from torch import nn

from ..._plumbing.autograd import (
    Node,
    is_leaf,
    root_node,
    saved_tensors,
    storage_bytes,
    storage_key,
)
from ..._plumbing.torch_internals import sequence_nr
from .attribution import ParamIndex
from .parts import GraphEdge, GraphNode, NodeKind, Walk, format_bytes


def autograd_nodes(
    walk: Walk,
    roots: list[torch.Tensor],
    params: ParamIndex,
    labels: dict[Node, str | None],
    saved: bool,
) -> tuple[list[GraphNode], list[GraphEdge]]:
    """One node per autograd node found (ops, parameters, inputs), and the edges between."""
    ids = {node: f"n{i}" for i, node in enumerate(walk.order)}
    root_nodes = {root_node(root) for root in roots}
    nodes = []
    for node in walk.order:
        if is_leaf(node):
            nodes.append(_leaf_node(ids[node], node, params))
        else:
            kind: NodeKind = "loss" if node in root_nodes else "op"
            size = _saved_bytes(node, params.pointers) if saved else None
            label = node.name() + ("\nloss" if kind == "loss" else "")
            label += f"\nsaved {format_bytes(size)}" if size else ""
            module = labels.get(node)
            nodes.append(
                GraphNode(
                    ids[node],
                    kind,
                    label,
                    module,
                    tooltip=f"{node.name()} in {module or 'no module'}",
                    saved_bytes=size,
                    key=(f"{sequence_nr(node):020d}",),
                )
            )
    edges = [GraphEdge(ids[fn], ids[node]) for node in walk.order for fn in walk.inputs[node]]
    return nodes, edges


def _leaf_node(node_id: str, node: Node, params: ParamIndex) -> GraphNode:
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


def absent_parameters(params: ParamIndex, walk: Walk) -> list[GraphNode]:
    """Frozen and cut parameters: not in the autograd graph, drawn all the same."""
    present = {id(node.variable) for node in walk.order if is_leaf(node)}
    found = []
    for i, (name, param) in enumerate(params.named):
        if id(param) not in present:
            kind: NodeKind = "cut" if param.requires_grad else "frozen"
            found.append(_param_node(f"p{i}", name, param, kind))
    return found


def _saved_bytes(node: Node, param_keys: set[int]) -> int:
    """Bytes of the tensors ``node`` saved for backward, each storage once, parameters out."""
    sizes = {storage_key(t): storage_bytes(t) for t in saved_tensors(node)}
    return sum(size for key, size in sizes.items() if key not in param_keys)
