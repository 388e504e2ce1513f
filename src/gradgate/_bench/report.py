"""The benchmark's outputs: a text table, the JSON file and a PNG plot (matplotlib, lazily)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .methods import METHODS

RESULT_KEYS = (
    "model",
    "method",
    "depth",
    "step_seconds",
    "backward_flops",
    "saved_bytes",
    "peak_rss_bytes",
)
COMPILE_KEYS = ("method", "graphs", "recompiles")


def validate(document: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless the document has exactly the bench's JSON schema."""
    if set(document) != {"machine", "results", "compile"}:
        raise ValueError(f"top-level keys {sorted(document)}")
    if not isinstance(document["machine"], dict):
        raise ValueError("machine is not an object")
    for row in document["results"]:
        if tuple(row) != RESULT_KEYS:
            raise ValueError(f"result keys {list(row)}")
        if row["depth"] is not None and type(row["depth"]) is not int:
            raise ValueError(f"depth {row['depth']!r}")
    for row in document["compile"]:
        if tuple(row) != COMPILE_KEYS:
            raise ValueError(f"compile keys {list(row)}")


def write_json(document: dict[str, Any], path: Path) -> None:
    validate(document)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def _label(depth: int | None) -> str:
    return "all" if depth is None else str(depth)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.3f}"


def table(document: dict[str, Any]) -> str:
    """Per model: median step ms per method and depth, and the ratios that matter."""
    lines: list[str] = []
    rows = document["results"]
    for model in dict.fromkeys(row["model"] for row in rows):
        mine = {(r["method"], r["depth"]): r for r in rows if r["model"] == model}
        full = mine["full", None]
        depths = list(dict.fromkeys(d for (_, d) in mine if (_, d) != ("full", None)))
        lines.append(
            f"\n{model}: median step ms (full backprop {full['step_seconds'] * 1e3:.1f} ms)"
        )
        header = f"{'depth':>5} " + "".join(f"{m:>12}" for m in METHODS[1:])
        header += f"{'gg/ideal':>10}{'gg/full':>9}{'flops g/i':>10}{'saved g/i':>10}"
        lines.append(header)
        for depth in depths:
            cells = []
            for method in METHODS[1:]:
                row = mine.get((method, depth))
                cells.append(f"{row['step_seconds'] * 1e3:>12.1f}" if row else f"{'-':>12}")
            gate, ideal = mine.get(("gradgate", depth)), mine.get(("ideal", depth))
            assert gate is not None and ideal is not None
            lines.append(
                f"{_label(depth):>5} "
                + "".join(cells)
                + f"{_ratio(gate['step_seconds'], ideal['step_seconds']):>10}"
                + f"{_ratio(gate['step_seconds'], full['step_seconds']):>9}"
                + f"{_exact(gate['backward_flops'], ideal['backward_flops']):>10}"
                + f"{_exact(gate['saved_bytes'], ideal['saved_bytes']):>10}"
            )
    if document["compile"]:
        hits = document["machine"].get("compile_recompile_limit_hits", {})
        lines.append("\ntorch.compile over every depth (warm-up: depths all, 0, n)")
        lines.append(f"{'method':>18}{'graphs':>8}{'recompiles':>12}{'hit limit':>11}")
        for row in document["compile"]:
            hit = "yes" if hits.get(row["method"]) else "no"
            lines.append(f"{row['method']:>18}{row['graphs']:>8}{row['recompiles']:>12}{hit:>11}")
    over = document["machine"].get("overheads")
    if over:
        audit = over["audit_ratio"]
        lines.append(
            f"\ndepth change, 48 blocks: {over['depth_change_seconds'] * 1e6:.1f} us per change "
            f"= {over['depth_change_step_fraction'] * 100:.5f}% of a step; audit overhead: "
            + ("not measured (gg.audit unavailable)" if audit is None else f"x{audit:.2f}")
        )
    return "\n".join(lines)


def _exact(a: int, b: int) -> str:
    return "1 (=)" if a == b else f"{a / b:.4f}" if b else "-"


def plot(document: dict[str, Any], path: Path) -> None:
    """Step time and backward FLOPs against depth, one column per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["results"]
    models = list(dict.fromkeys(row["model"] for row in rows))
    figure, axes = plt.subplots(
        2, len(models), figsize=(4.5 * len(models), 7), squeeze=False, constrained_layout=True
    )
    for column, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        full = next(r for r in mine if r["method"] == "full")
        for row_index, (key, scale, unit) in enumerate(
            [("step_seconds", 1e3, "step ms (median)"), ("backward_flops", 1e-9, "backward GFLOP")]
        ):
            ax = axes[row_index][column]
            ax.axhline(full[key] * scale, color="grey", linestyle="--", label="full")
            for method in METHODS[1:]:
                points = [r for r in mine if r["method"] == method]
                xs = _positions(r["depth"] for r in points)
                ax.plot(xs, [r[key] * scale for r in points], marker="o", label=method)
            depths = list(dict.fromkeys(r["depth"] for r in mine if r["method"] == "gradgate"))
            ax.set_xticks(_positions(depths), [_label(d) for d in depths])
            ax.set_xlabel("depth (blocks that learn)")
            ax.set_ylabel(unit)
            ax.set_title(model)
    axes[0][0].legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _positions(depths: Iterable[int | None]) -> list[int]:
    values = list(depths)
    top = max((d for d in values if d is not None), default=0)
    return [top + 2 if d is None else d for d in values]
