"""Temporary: the old import path of the demo's ``GraphvizNotFoundError`` (now imported from
``gradgate._errors``); the DOT writer lives in ``gradgate._graph.dot``."""

from ._errors import GraphvizError, GraphvizNotFoundError

__all__ = ["GraphvizError", "GraphvizNotFoundError"]
