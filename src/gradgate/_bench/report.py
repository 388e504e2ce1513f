"""The benchmark's files: the JSON document (schema checked) and a PNG plot (matplotlib, lazily).

The table lives in :mod:`.table`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._plumbing.errors import InvalidOptionError
from .methods import METHODS
from .table import heading

RESULT_KEYS = (
    "model",
    "method",
    "depth",
    "step_seconds",
    "backward_flops",
    "saved_bytes",
    "peak_bytes",
)
COMPILE_KEYS = ("method", "graphs", "recompiles")
SECTIONS = ("schedules", "distributed", "prefix_cache")  # optional, printed in this order


def read_json(path: Path) -> dict[str, Any]:
    """A document written by :func:`write_json`; a clear error when it is not one."""
    try:
        document = json.loads(path.read_text())
        validate(document)
    except (OSError, ValueError) as error:
        raise InvalidOptionError(
            f"--from-json {path}: not a gradgate bench JSON file ({error}); expected the file "
            "written by gradgate bench --json."
        ) from None
    return document  # type: ignore[no-any-return]


def validate(document: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless the document has exactly the bench's JSON schema."""
    required = {"machine", "results", "compile"}
    if not isinstance(document, dict) or not required <= set(document) <= required | set(SECTIONS):
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
    """Write the document as indented JSON, after checking its schema."""
    validate(document)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def _label(depth: int | None) -> str:
    return "all" if depth is None else str(depth)


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
    figure.suptitle(heading(document["machine"]), fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _positions(depths: Iterable[int | None]) -> list[int]:
    values = list(depths)
    top = max((d for d in values if d is not None), default=0)
    return [top + 2 if d is None else d for d in values]
