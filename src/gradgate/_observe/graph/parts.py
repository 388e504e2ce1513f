"""The pieces of a graph picture: nodes, edges, clusters, and small name helpers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..._plumbing.autograd import Node
from ..._plumbing.units import in_units
from ..._select.names import ancestors

NodeKind = Literal["op", "loss", "param", "frozen", "late_frozen", "cut", "input", "stop"]
EdgeKind = Literal["grad", "cut", "to_stop"]
ClusterState = Literal["learning", "frozen", "cut", "mixed", "none"]
RenderFormat = Literal["svg", "png"]


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


@dataclass
class Walk:
    """Every autograd node reachable from the roots, in discovery order, with its inputs."""

    order: list[Node]
    inputs: dict[Node, list[Node]]


def common(a: str, b: str) -> str:
    parts = []
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        parts.append(x)
    return ".".join(parts) if a and b else ""


def _inside(name: str, ancestor: str) -> bool:
    return not ancestor or name == ancestor or name.startswith(f"{ancestor}.")


def ancestors_and_self(name: str) -> list[str]:
    return [name, *ancestors(name)]


def format_bytes(size: float) -> str:
    if size < 1024:
        return f"{size:.0f} B"
    return in_units(size / 1024, ("KiB", "MiB", "GiB"), 1024, "{:.1f}".format)


def format_flops(flops: float) -> str:
    if flops < 1000:
        return f"{flops:.0f} FLOP"
    return in_units(flops / 1000, ("kFLOP", "MFLOP", "GFLOP"), 1000, "{:.1f}".format)
