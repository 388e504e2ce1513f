"""DOT text for a graph picture (nodes, edges, clusters), and Graphviz's ``dot`` program run.

Written by hand: no Python graphviz package is needed, only the ``dot`` program to render.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from ..._plumbing.errors import GraphvizError, GraphvizNotFoundError

if TYPE_CHECKING:
    from .parts import GraphCluster, GraphEdge, GraphNode


RED, GREEN, GREY, DARK = "#c0392b", "#2e8b57", "#9a9a9a", "#555555"

NODE_STYLES: dict[str, dict[str, str]] = {
    "op": {"style": "rounded,filled", "fillcolor": "#dbe9f6", "color": "#5b8bb8"},
    "loss": {"style": "rounded,filled", "fillcolor": "#fde2c4", "color": "#d9822b"},
    "param": {"style": "filled", "fillcolor": "#c9ecc9", "color": GREEN},
    "frozen": {"style": "filled", "fillcolor": "#e4e4e4", "color": GREY, "fontcolor": "#6b6b6b"},
    "late_frozen": {
        "style": "filled",
        "fillcolor": "#e4e4e4",
        "color": RED,
        "fontcolor": "#6b6b6b",
        "penwidth": "1.5",
    },
    "cut": {"style": "dashed,filled", "fillcolor": "#ffffff", "color": GREY, "fontcolor": GREY},
    "input": {"style": "filled", "fillcolor": "#fff6c4", "color": "#b59a00"},
    "stop": {
        "shape": "octagon",
        "style": "filled",
        "fillcolor": "#f9d5d3",
        "color": RED,
        "fontcolor": RED,
    },
}

CLUSTER_STYLES: dict[str, dict[str, str]] = {
    "learning": {"style": "rounded,filled", "fillcolor": "#f3fbf3", "color": GREEN},
    "frozen": {
        "style": "rounded,filled",
        "fillcolor": "#f0f0f0",
        "color": GREY,
        "fontcolor": "#6b6b6b",
    },
    "cut": {"style": "rounded,dashed,filled", "fillcolor": "#ffffff", "color": GREY},
    "mixed": {"style": "rounded,filled", "fillcolor": "#ffffff", "color": DARK},
    "none": {"style": "rounded,filled", "fillcolor": "#ffffff", "color": "#bbbbbb"},
}

EDGE_STYLES: dict[str, dict[str, str]] = {
    "grad": {"color": DARK, "arrowsize": "0.6"},
    "cut": {"color": RED, "style": "dashed", "penwidth": "1.5", "arrowsize": "0.8"},
    "to_stop": {"color": GREY, "style": "dashed", "arrowhead": "none"},
}

LEGEND = (
    ("param", "learning parameter"),
    ("frozen", "frozen parameter: no wgrad"),
    ("late_frozen", "frozen after the forward:\nwgrad still computed"),
    ("cut", "cut or unreached:\nno graph, no gradient"),
    ("op", "autograd op"),
    ("loss", "loss"),
    ("stop", "gradient stops here"),
)


def quote(text: str) -> str:
    """A DOT double-quoted string: backslashes and quotes escaped, newlines as ``\\n``.

    >>> print(quote('a "b"\\\\c\\nd'))
    "a \\"b\\"\\\\c\\nd"
    """
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\\n")
    return f'"{escaped}"'


def attributes(values: dict[str, str]) -> str:
    """``[key="value", ...]`` with every value quoted."""
    return "[" + ", ".join(f"{key}={quote(value)}" for key, value in values.items()) + "]"


def to_dot(
    nodes: Sequence[GraphNode],
    edges: Sequence[GraphEdge],
    clusters: Mapping[str, GraphCluster],
    *,
    legend: bool = True,
) -> str:
    """The whole picture as DOT text: clusters nested as the modules nest."""
    lines = [
        "digraph gradgate {",
        '  graph [rankdir="TB", compound="true", fontname="Helvetica", fontsize="11", '
        'nodesep="0.25", ranksep="0.35", newrank="true"];',
        '  node [shape="box", fontname="Helvetica", fontsize="10", height="0.3", '
        'margin="0.08,0.03"];',
        '  edge [fontname="Helvetica", fontsize="9"];',
    ]
    by_cluster: dict[str | None, list[GraphNode]] = {}
    for node in nodes:
        by_cluster.setdefault(node.module, []).append(node)
    children: dict[str | None, list[GraphCluster]] = {}
    for cluster in clusters.values():
        children.setdefault(cluster.parent, []).append(cluster)
    ids = {name: f"cluster_{i}" for i, name in enumerate(clusters)}
    lines.extend(_cluster_body(None, by_cluster, children, ids, "  "))
    home = {node.id: node.module for node in nodes}
    for edge in edges:
        style = dict(EDGE_STYLES[edge.kind])
        if edge.kind == "cut":
            style["label"] = " no gradient\n above"
        tail = home.get(edge.src)
        if edge.kind == "to_stop" and tail is not None and tail in ids:
            style["ltail"] = ids[tail]
        lines.append(f"  {edge.src} -> {edge.dst} {attributes(style)};")
    if legend:
        lines.extend(_legend())
    lines.append("}")
    return "\n".join(lines) + "\n"


def _cluster_body(
    parent: str | None,
    by_cluster: dict[str | None, list[GraphNode]],
    children: dict[str | None, list[GraphCluster]],
    ids: dict[str, str],
    indent: str,
) -> Iterator[str]:
    for node in by_cluster.get(parent, []):
        yield f"{indent}{node.id} {attributes(_node_attributes(node))};"
    for cluster in children.get(parent, []):
        style = {
            "label": cluster.title,
            "tooltip": cluster.tooltip,
            "fontcolor": "#222222",
            "penwidth": "1.2",
            "labeljust": "l",
        }
        style.update(CLUSTER_STYLES[cluster.state])
        yield f"{indent}subgraph {ids[cluster.name]} {{"
        yield f"{indent}  graph {attributes(style)};"
        yield from _cluster_body(cluster.name, by_cluster, children, ids, indent + "  ")
        yield f"{indent}}}"


def _node_attributes(node: GraphNode) -> dict[str, str]:
    values = {"label": node.label, "tooltip": node.tooltip or node.label}
    values.update(NODE_STYLES[node.kind])
    return values


def _legend() -> Iterable[str]:
    yield "  subgraph cluster_legend {"
    yield '    graph [label="legend", style="rounded", color="#bbbbbb", fontcolor="#222222"];'
    names = []
    for i, (kind, text) in enumerate(LEGEND):
        values = {"label": text, "tooltip": text}
        values.update(NODE_STYLES[kind])
        names.append(f"legend_{i}")
        yield f"    legend_{i} {attributes(values)};"
    yield f"    {{ rank=same; {'; '.join(names)}; }}"
    for left, right in itertools.pairwise(names):
        yield f'    {left} -> {right} [style="invis"];'
    yield "  }"


def run_dot(dot_text: str, fmt: str) -> bytes:
    """Render DOT text with Graphviz's ``dot`` program; clear errors when missing or failing."""
    program = shutil.which("dot")
    if program is None:
        raise GraphvizNotFoundError(
            "rendering needs Graphviz's 'dot' program, which is not on PATH. Install the "
            "Graphviz package: 'apt-get install graphviz' (Debian/Ubuntu package 'graphviz'), "
            "'brew install graphviz' or 'conda install graphviz'; or write g.to_dot() to a "
            "file and render it elsewhere."
        )
    try:
        done = subprocess.run(
            [program, f"-T{fmt}"],
            input=dot_text.encode("utf-8"),
            capture_output=True,
            check=False,
            timeout=120,
        )
    except subprocess.TimeoutExpired as error:
        raise GraphvizError(
            f"Graphviz 'dot -T{fmt}' took over 120 s; build the graph with collapse=True "
            "(the default) or from a smaller model."
        ) from error
    if done.returncode != 0:
        message = done.stderr.decode("utf-8", "replace").strip()
        raise GraphvizError(
            f"Graphviz 'dot -T{fmt}' failed with exit status {done.returncode}: {message}"
        )
    return done.stdout
