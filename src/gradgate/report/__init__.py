"""How a person sees an audit: a text table, JSON, and a self-contained HTML page.

Each renderer is a small module of its own; nothing heavy is imported until it is used.
"""

from ._html import audit_sections, html_page, page, write_html
from ._json import SCHEMA, dumps, loads
from ._text import render_table

__all__ = [
    "SCHEMA",
    "audit_sections",
    "dumps",
    "html_page",
    "loads",
    "page",
    "render_table",
    "write_html",
]
