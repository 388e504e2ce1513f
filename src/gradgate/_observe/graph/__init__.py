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

from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ..._plumbing.autograd import Node
from ..._plumbing.errors import GraphvizError, GraphvizNotFoundError, NoGraphError
from ..._plumbing.tagging import ModuleTagger
from .build import build, check_model
from .graph import Graph
from .parts import GraphCluster, GraphEdge, GraphNode

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


class GraphRecording:
    """Records which module creates each autograd node; see :func:`graph` ``.recording``.

    Forward hooks are registered on entry and removed on exit; ``graph(loss)`` works after
    the ``with`` block too. The recording keeps the tagged nodes alive while it lives.
    """

    def __init__(self, model: nn.Module) -> None:
        check_model(model)
        self.model: nn.Module = model
        self._tagger = ModuleTagger(model)

    @property
    def labels(self) -> dict[Node, str]:
        """The module name of every node tagged so far."""
        return self._tagger.labels

    def __enter__(self) -> GraphRecording:
        self._tagger.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._tagger.remove()

    def graph(
        self,
        loss: torch.Tensor | Sequence[torch.Tensor],
        *,
        collapse: bool = True,
        saved: bool = False,
        audit: Any = None,
    ) -> Graph:
        """The graph of ``loss``, with the module of every node as recorded."""
        return build(loss, self.model, self.labels, collapse=collapse, saved=saved, audit=audit)

    def __repr__(self) -> str:
        state = "recording" if self._tagger.active else "stopped"
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
        return build(loss, model, None, collapse=collapse, saved=saved, audit=audit)

    def __repr__(self) -> str:
        return "<function gradgate.graph>"


graph = _GraphFunction()
graph.__doc__ = _GraphFunction.__call__.__doc__
