"""From a loss to a :class:`Graph`: walk, attribute, draw nodes, cluster, collapse, decorate."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..._plumbing.autograd import Node, inputs_of, root_node, walk
from ..._plumbing.errors import InvalidOptionError, NoGraphError
from ..._plumbing.validate import check_choice
from .attribution import ParamIndex, attribute
from .clusters import build_clusters, in_displayed, stop_marker
from .collapse import collapse as collapse_runs
from .figures import audit_figures, decorate
from .graph import Graph
from .nodes import absent_parameters, autograd_nodes
from .parts import Walk


def build(
    loss: torch.Tensor | Sequence[torch.Tensor],
    model: nn.Module | None,
    recorded: dict[Node, str] | None,
    *,
    collapse: bool,
    saved: bool,
    audit: Any,
) -> Graph:
    """The graph of ``loss``; ``recorded`` maps nodes to modules when a forward was tagged."""
    check_choice("collapse", collapse, (True, False))
    check_choice("saved", saved, (True, False))
    roots = _roots(loss)
    if model is not None:
        check_model(model)
    figures = audit_figures(audit)
    found = _walk_graph(roots)
    params = ParamIndex(model)
    labels = attribute(found, params, model, recorded)
    nodes, edges = autograd_nodes(found, roots, params, labels, saved)
    nodes.extend(absent_parameters(params, found))
    clusters = build_clusters(model, nodes)
    nodes = [in_displayed(node, clusters) for node in nodes]
    stop_nodes, stop_edges = stop_marker(model, found, nodes, clusters)
    nodes.extend(stop_nodes)
    edges.extend(stop_edges)
    if collapse:
        nodes, edges, clusters = collapse_runs(model, nodes, edges, clusters)
    clusters = decorate(clusters, figures)
    return Graph(nodes, edges, clusters)


def _roots(loss: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    given: object = loss
    tensors: list[Any] = list(given) if isinstance(given, (list, tuple)) else [given]
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise NoGraphError(
            f"loss={loss!r:.40} has type {type(loss).__name__}; expected a torch.Tensor "
            "(or a sequence of "
            "them) computed with autograd, e.g. loss = loss_fn(model(x), y)."
        )
    for tensor in tensors:
        if tensor.grad_fn is None and not tensor.requires_grad:
            raise NoGraphError(
                f"loss {_short(tensor)} has no autograd graph (grad_fn is None, requires_grad is "
                "False); expected a tensor computed with autograd. It was computed under "
                "torch.no_grad() or torch.inference_mode(), or nothing before "
                "it requires grad (every parameter frozen or cut). Compute it with grad "
                "enabled and at least one learning parameter."
            )
    return tensors


def check_model(model: object) -> None:
    """Raise :class:`InvalidOptionError` unless ``model`` is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise InvalidOptionError(
            f"model has type {type(model).__name__}; expected a torch.nn.Module (or None)."
        )


def _walk_graph(roots: list[torch.Tensor]) -> Walk:
    order = list(walk(root_node(root) for root in roots))
    return Walk(order, {node: inputs_of(node) for node in order})


def _short(tensor: torch.Tensor) -> str:
    return f"(a {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} tensor)"
