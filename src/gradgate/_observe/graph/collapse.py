"""Runs of identical numbered blocks (``h.0`` … ``h.23``) drawn as one cluster with a count."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

from torch import nn

from ..._select.names import ancestors
from .parts import GraphCluster, GraphEdge, GraphNode


def collapse(
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
        self.build_clusters, self._own, self._children = clusters, own, children
        self._cache: dict[str, object] = {}

    def __call__(self, name: str) -> object:
        if name not in self._cache:
            cluster = self.build_clusters[name]
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
