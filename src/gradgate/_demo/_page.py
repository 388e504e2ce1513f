"""The demo's report: one self-contained HTML file (inline SVG and CSS, no network)."""

from __future__ import annotations

import html
import io
from pathlib import Path
from typing import TYPE_CHECKING

from ..report import audit_sections, page

if TYPE_CHECKING:
    from ._answers import Answer
    from ._digits import Run
    from ._scenarios import Scenario

_NO_DOT = "<p class='note'>Graph not drawn: Graphviz's <code>dot</code> is not installed \
(Debian package <code>graphviz</code>).</p>"


def write_report(
    out: Path, scenarios: list[Scenario], runs: list[Run], answers: list[Answer]
) -> Path:
    """Write ``out/gradgate-demo.html`` and return its path."""
    out.mkdir(parents=True, exist_ok=True)
    body = [
        "<h1>gradgate demo</h1>",
        "<p>Where gradients flow, and what backward computed, measured on this machine.</p>",
        "<h2>The seeds' conv stacks</h2>",
        *(_scenario_section(s) for s in scenarios),
        _digits_section(runs),
        "<h2>Answers</h2>",
        *(_answer_section(a) for a in answers),
    ]
    path = out / "gradgate-demo.html"
    path.write_text(page("gradgate demo", "".join(body)), encoding="utf-8")
    return path


def _scenario_section(scenario: Scenario) -> str:
    totals = scenario.report.totals
    figure = scenario.svg if scenario.svg is not None else _NO_DOT
    return (
        f"<section class='scenario'><h3>{html.escape(scenario.title)}</h3>"
        f"<p><b>{totals['wgrad']} wgrad, {totals['dgrad']} dgrad</b></p>"
        f"<div class='graph'>{figure}</div>{audit_sections(scenario.report)}</section>"
    )


def _digits_section(runs: list[Run]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td><td class='n'>{r.accuracy[-1]:.3f}</td>"
        f"<td class='n'>{r.backward_flops:,}</td><td class='n'>{r.median_step * 1e3:.2f}</td></tr>"
        for r in runs
    )
    table = (
        "<table><tr><th>run</th><th>test accuracy</th><th>backward FLOPs</th>"
        f"<th>median step (ms)</th></tr>{rows}</table>"
    )
    return (
        "<h2>Digits: full backprop vs a random depth per minibatch</h2>"
        "<p>scikit-learn's bundled digits (no download); a stem, 6 residual MLP blocks and a head; "
        "the same initial weights and batches for both runs.</p>"
        f"{table}{_accuracy_plot(runs)}"
    )


def _accuracy_plot(runs: list[Run]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        return "<p class='note'>Plots need matplotlib (pip install 'gradgate[demo]').</p>"
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3))
    for run in runs:
        epochs = range(1, len(run.accuracy) + 1)
        left.plot(epochs, run.accuracy, marker="o", label=run.name)
    left.set(xlabel="epoch", ylabel="test accuracy", title="accuracy")
    left.legend()
    right.bar([r.name for r in runs], [r.backward_flops for r in runs], color=["#888", "#2a7"])
    right.set(ylabel="backward FLOPs (total)", title="backward work")
    figure.tight_layout()
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    plt.close(figure)
    svg = buffer.getvalue()
    return f"<div class='plot'>{svg[svg.index('<svg') :]}</div>"


def _answer_section(answer: Answer) -> str:
    parts = [f"<h3>{html.escape(answer.question)}</h3><p>{html.escape(answer.sentence)}</p>"]
    if answer.report is not None:
        parts.append(audit_sections(answer.report))
    return "<section class='answer'>" + "".join(parts) + "</section>"
