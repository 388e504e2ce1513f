"""The demo's report: one self-contained HTML page that reads like a short notebook.

Inline SVG and CSS only: no scripts, no network, so it opens offline and from an attachment.
"""

from __future__ import annotations

import html
import io
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import gradgate as gg

from .._plumbing.html import page
from ._scenarios import SETUP
from ._tables import html_table, human_count

if TYPE_CHECKING:
    from ._answers import Answer
    from ._digits import Run
    from ._scenarios import Scenario

REPORT_NAME = "gradgate-demo.html"
_DOCS = Path(__file__).resolve().parents[3] / "docs"  # present in a source checkout

_STYLE = """
body{max-width:1180px;margin:0 auto;padding:1em 1.5em;line-height:1.45;color:#1d1d1d}
h1{margin-bottom:.2em}h2{margin-top:2.2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
h3{margin-top:1.8em}
pre{background:#f6f8fa;border:1px solid #e1e4e8;border-radius:6px;padding:.7em 1em;
overflow-x:auto;font-size:14px;line-height:1.35}
code{font-family:ui-monospace,Menlo,Consolas,monospace}
table{margin:.6em 0;font-size:15px}th{text-align:left;background:#f6f8fa}
td,th{padding:3px 10px}tr.total td{font-weight:600;border-top:2px solid #999}
td.w{color:#b00;font-weight:600}
.cols{display:flex;flex-wrap:wrap;gap:1.5em;align-items:flex-start}
.cols>.text{flex:1 1 600px;min-width:min(600px,100%)}
.cols>.graph{flex:0 1 auto;max-width:100%}td:first-child{white-space:nowrap}
.graph svg{max-width:100%;height:auto}
dl.words dt{font-weight:600;margin-top:.4em}dl.words dd{margin-left:1.2em}
.answer{background:#eef7ee;border-left:4px solid #2e8b57;padding:.4em .9em}
.legend{display:flex;flex-wrap:wrap;gap:.5em;margin:.4em 0 1em}
.legend .key{padding:.25em .7em;font-size:14px;line-height:1.3}
"""


def write_report(
    out: Path, scenarios: list[Scenario], runs: list[Run], answers: list[Answer]
) -> Path:
    """Write ``out/gradgate-demo.html`` and return its path."""
    body = [
        "<h1>gradgate demo</h1>",
        "<p>Where do gradients flow in a PyTorch model, and what does backward really "
        "compute? Each section below asks one common question, shows the few lines of code "
        "that answer it, and the evidence measured when this page was written "
        f"(PyTorch {html.escape(torch.__version__)}, on this machine).</p>",
        _words_section(),
        "<h2>Which gradients does backward compute?</h2>",
        "<p>Every example starts from these lines:</p>",
        _code(SETUP),
        _legend(scenarios),
        *(_scenario_section(s) for s in scenarios),
        _digits_section(runs),
        "<h2>More questions</h2>",
        *(_answer_section(a) for a in answers),
        _docs_footer(),
    ]
    path = out / REPORT_NAME
    path.write_text(page("gradgate demo", "".join(body), style=_STYLE), encoding="utf-8")
    return path


def _words_section() -> str:
    return (
        "<h2>Two words used below</h2><dl class='words'>"
        "<dt>wgrad (weight gradient)</dt><dd>the gradient of the loss with respect to a "
        "layer's own parameters: what the optimizer needs to update that layer.</dd>"
        "<dt>dgrad (input gradient)</dt><dd>the gradient with respect to a layer's input: "
        "needed only to pass the gradient on to an earlier layer that learns.</dd></dl>"
        f"<p>More: {_doc_link('questions/what-are-wgrad-and-dgrad.md')}, "
        f"{_doc_link('concepts.md')}.</p>"
    )


def _scenario_section(scenario: Scenario) -> str:
    return (
        f"<section class='scenario'><h3>{html.escape(scenario.question)}</h3>"
        "<div class='cols'><div class='text'>"
        f"{_code(scenario.code)}{html_table(scenario.report)}"
        f"<p class='answer'>{html.escape(scenario.why)}</p>"
        f"<p>More: {_doc_link(scenario.doc)}</p></div>"
        f"<div class='graph'>{_graph_svg(scenario.picture)}</div></div></section>"
    )


def _answer_section(answer: Answer) -> str:
    parts = [f"<section class='more'><h3>{html.escape(answer.question)}</h3>", _code(answer.code)]
    if answer.report is not None:
        parts.append(html_table(answer.report))
    if answer.table_html:
        parts.append(answer.table_html)
    parts.append(f"<p class='answer'>{html.escape(answer.sentence)}</p>")
    parts.append(f"<p>More: {_doc_link(answer.doc)}</p></section>")
    return "".join(parts)


def _digits_section(runs: list[Run]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td><td class='n'>{r.accuracy[-1]:.1%}</td>"
        f"<td class='n'>{human_count(r.backward_flops)}</td>"
        f"<td class='n'>{r.median_step * 1e3:.2f} ms</td></tr>"
        for r in runs
    )
    table = (
        "<table><thead><tr><th>run</th><th>test accuracy</th><th>backward FLOPs, all steps"
        f"</th><th>median step</th></tr></thead><tbody>{rows}</tbody></table>"
    )
    epochs = len(runs[0].accuracy)
    return (
        "<h2>Does training with a random depth per minibatch still learn?</h2>"
        "<p>A real training run: scikit-learn's bundled handwritten digits (8×8 images, no "
        "download), a small network of 6 residual blocks, the same initial weights and "
        f"batches for both runs, {epochs} epochs. One run trains every block on every step; "
        "the other draws the number of blocks that learn for each minibatch. Their steps "
        "alternate in one process, so both see the same machine load. The random-depth "
        "loop, in short:</p>"
        + _code(
            "gate = gg.BackpropGate(net)  # finds the 6 blocks\n"
            "for x, y in batches:\n"
            "    gate.depth = random.choice([1, 2, 3, 4, 6, None])  # None: every block learns\n"
            "    loss = cross_entropy(net(x), y)\n"
            "    loss.backward(); optimizer.step(); optimizer.zero_grad()\n"
        )
        + table
        + _accuracy_plot(runs)
        + f"<p>More: {_doc_link('questions/backprop-last-k-layers.md')}, "
        f"{_doc_link('performance.md')}.</p>"
    )


def _accuracy_plot(runs: list[Run]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    with matplotlib.rc_context({"font.size": 11, "svg.fonttype": "none"}):
        figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
        for run in runs:
            epochs = range(1, len(run.accuracy) + 1)
            left.plot(epochs, run.accuracy, marker="o", label=run.name)
        left.set(xlabel="epoch", ylabel="test accuracy", title="accuracy after each epoch")
        left.set_xticks(range(1, len(runs[0].accuracy) + 1))
        left.legend()
        millions = [r.backward_flops / 1e6 for r in runs]
        right.barh([r.name for r in runs], millions, color=["#888", "#2a7"])
        right.set(xlabel="backward FLOPs, all steps (millions)", title="backward work")
        figure.tight_layout()
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg")
        plt.close(figure)
    svg = buffer.getvalue()
    return f"<div class='plot'>{svg[svg.index('<svg') :]}</div>"


def _code(text: str) -> str:
    return f"<pre><code>{html.escape(text.rstrip())}</code></pre>"


def _doc_link(relative: str) -> str:
    """A docs page named in words, with its title when the docs are next to the package: a
    link to this machine's files would break once the report is copied or sent."""
    name = f"<code>{html.escape(f'docs/{relative}')}</code> in the gradgate repository"
    target = _DOCS / relative
    if not target.is_file():
        return name
    title = target.read_text(encoding="utf-8").partition("\n")[0].removeprefix("# ").strip()
    return f"“{html.escape(title)}” ({name})" if title else name


def _docs_footer() -> str:
    return (
        "<h2>Where next</h2><p>Every question of the documentation, with runnable code: "
        f"{_doc_link('index.md')}. The command-line benchmark: <code>gradgate bench</code> "
        f"({_doc_link('performance.md')}).</p>"
    )


# --- graphs: one legend for the page, graphs drawn without their own -----------------------

_NO_DOT = (
    "<p class='note'>Graph not drawn: Graphviz's <code>dot</code> program is not installed "
    "(Debian: <code>apt-get install graphviz</code>).</p>"
)


def _graph_svg(picture: gg.Graph | None) -> str:
    if picture is None:
        return ""
    try:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "graph.svg"
            picture.render(path, format="svg", legend=False)
            return _inline(path.read_text(encoding="utf-8"))
    except gg.GraphvizNotFoundError:
        return _NO_DOT


def _legend(scenarios: list[Scenario]) -> str:
    """The graphs' legend, once for the page, as a row of keys under its sentence that wraps on
    a narrow screen: each key styled as the graph module draws it (the legend part of a graph's
    DOT text)."""
    pictures = [s.picture for s in scenarios if s.picture is not None]
    if not pictures or shutil.which("dot") is None:
        return ""  # no graph is drawn
    with_legend = pictures[0].to_dot().splitlines()
    without = pictures[0].to_dot(legend=False).splitlines()
    if with_legend[: len(without) - 1] != without[:-1]:
        return ""  # the legend is not a plain suffix: draw none rather than a wrong one
    entries = [_LEGEND_ENTRY.search(line) for line in with_legend[len(without) - 1 :]]
    keys = [_key(dict(_DOT_ATTRIBUTE.findall(e.group(1)))) for e in entries if e is not None]
    return (
        "<p>Each question comes with its autograd graph: the operations backward runs, grouped "
        "by the layer that recorded them. The loss is at the bottom; backward runs upward from "
        "it, along the arrows in reverse. Repeated identical layers are drawn once "
        f"(<code>0–9 ×10</code>). The colours:</p><div class='legend'>{''.join(keys)}</div>"
    )


_LEGEND_ENTRY = re.compile(r"^\s*legend_\d+ \[(.*)\];$")
_DOT_ATTRIBUTE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _key(attributes: dict[str, str]) -> str:
    """One legend entry of the DOT text as a small HTML box in the same colours and outline."""
    style = attributes.get("style", "")
    line = "dashed" if "dashed" in style else "solid"
    css = [
        f"background:{attributes.get('fillcolor', '#ffffff')}",
        f"border:{attributes.get('penwidth', '1')}px {line} {attributes.get('color', '#000')}",
        f"color:{attributes.get('fontcolor', '#222222')}",
    ]
    if "rounded" in style or attributes.get("shape") == "octagon":
        css.append("border-radius:.6em")
    label = "<br>".join(html.escape(part) for part in attributes["label"].split("\\n"))
    return f"<span class='key' style='{html.escape(';'.join(css))}'>{label}</span>"


def _inline(svg: str) -> str:
    """An SVG document as inline markup (no XML declaration or doctype)."""
    return svg[svg.index("<svg") :]
