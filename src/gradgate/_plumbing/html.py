"""The small HTML page shell shared by every self-contained page gradgate writes.

No scripts and no external files: the page opens offline and from a mail attachment.

>>> text = page("a <title>", "<p>body</p>")
>>> text.startswith("<!DOCTYPE html>"), "a &lt;title&gt;" in text, "<p>body</p>" in text
(True, True, True)
"""

from __future__ import annotations

import html

STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em}"
    "table{border-collapse:collapse}td,th{padding:2px 10px;border-bottom:1px solid #ddd}"
    "td.n{text-align:right;font-variant-numeric:tabular-nums}.waste{color:#b00}"
    "svg{max-width:100%;height:auto}.note{color:#666}"
)


def page(title: str, body: str, *, style: str = "") -> str:
    """A complete HTML document around trusted ``body`` HTML; ``title`` is escaped and
    ``style`` is CSS added after the shared rules."""
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}{style}</style></head>"
        f"<body>{body}</body></html>\n"
    )
