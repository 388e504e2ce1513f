"""``Graph``: the picture of an autograd graph, with DOT, SVG and PNG output."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import get_args

from ..._plumbing.errors import GraphvizError
from ..._plumbing.validate import check_choice
from .dot import run_dot, to_dot
from .parts import GraphCluster, GraphEdge, GraphNode, RenderFormat


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
        self._inline_svg: tuple[str | None, str] | None = None

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
        return to_dot(self.nodes, self.edges, self.clusters, legend=legend)

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

    def _repr_svg_(self) -> str | None:
        """Jupyter shows the picture inline; ``None`` (no SVG) when ``dot`` cannot render."""
        return self._inline()[0]

    def _repr_html_(self) -> str | None:
        """``None`` when the SVG can be drawn (Jupyter then shows it); else the reason and the
        DOT text, so a notebook without Graphviz still shows something useful."""
        svg, problem = self._inline()
        if svg is not None:
            return None
        return (
            f"<p>{html.escape(repr(self))}: not drawn ({html.escape(problem)})</p>"
            f"<details><summary>DOT source</summary><pre>{html.escape(self.to_dot())}"
            "</pre></details>"
        )

    def _inline(self) -> tuple[str | None, str]:
        """The SVG for inline display (rendered once), or ``None`` and why not."""
        if self._inline_svg is None:
            try:
                self._inline_svg = (self.to_svg(), "")
            except GraphvizError as error:
                self._inline_svg = (None, str(error))
        return self._inline_svg

    def __repr__(self) -> str:
        ops = sum(node.kind in ("op", "loss") for node in self.nodes)
        stop = ", with a stop" if self.stop_edges else ""
        return f"<gradgate.Graph {ops} ops, {len(self.clusters)} clusters{stop}>"
