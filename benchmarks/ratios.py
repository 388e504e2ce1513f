"""Render the ratio tables of benchmarks/RESULTS.md from a ``gradgate bench`` JSON file.

python benchmarks/ratios.py gradgate-out/bench.json > gradgate-out/ratios.md
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _r(a: float | None, b: float | None, digits: int = 2) -> str:
    return "–" if a is None or not b else f"{a / b:.{digits}f}"


def _exact(a: int, b: int) -> str:
    return "**1 (equal)**" if a == b else _r(a, b, 4)


def model_table(rows: list[dict[str, Any]], model: str) -> list[str]:
    mine = {(r["method"], r["depth"]): r for r in rows if r["model"] == model}
    full = mine["full", None]
    depths = list(dict.fromkeys(d for (m, d) in mine if m == "gradgate"))
    out = [
        f"### {model} (full backprop: {full['step_seconds'] * 1e3:.0f} ms per step, "
        f"{full['backward_flops'] / 1e9:.2f} backward GFLOP, "
        f"{full['saved_bytes'] / 2**20:.1f} MiB saved)",
        "",
        "| depth | gg/ideal time | gg/full time | toggle/ideal | toggle/full | late/ideal "
        "| late/full | gg/ideal FLOPs | gg/ideal saved | gg/full FLOPs | toggle/ideal saved "
        "| late/full FLOPs | gg/ideal peak RSS |",
        "|---:" * 13 + "|",
    ]
    for depth in depths:
        g, i = mine["gradgate", depth], mine["ideal", depth]
        t, late = mine.get(("toggle", depth)), mine.get(("late-freeze", depth))

        def get(row: dict[str, Any] | None, key: str) -> Any:
            return None if row is None else row[key]

        out.append(
            "| "
            + " | ".join(
                [
                    "all (None)" if depth is None else str(depth),
                    _r(g["step_seconds"], i["step_seconds"], 3),
                    _r(g["step_seconds"], full["step_seconds"]),
                    _r(get(t, "step_seconds"), i["step_seconds"]),
                    _r(get(t, "step_seconds"), full["step_seconds"]),
                    _r(get(late, "step_seconds"), i["step_seconds"]),
                    _r(get(late, "step_seconds"), full["step_seconds"]),
                    _exact(g["backward_flops"], i["backward_flops"]),
                    _exact(g["saved_bytes"], i["saved_bytes"]),
                    _r(g["backward_flops"], full["backward_flops"]),
                    _r(get(t, "saved_bytes"), i["saved_bytes"]),
                    _r(get(late, "backward_flops"), full["backward_flops"]),
                    _r(g["peak_rss_bytes"], i["peak_rss_bytes"], 3),
                ]
            )
            + " |"
        )
    return out


def main(path: str) -> None:
    with open(path) as handle:
        document = json.load(handle)
    rows = document["results"]
    lines: list[str] = []
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += [*model_table(rows, model), ""]
    if document["compile"]:
        hits = document["machine"].get("compile_recompile_limit_hits", {})
        lines += ["| method | graphs | recompiles after warm-up | hit recompile limit |"]
        lines += ["|---|---:|---:|---|"]
        for row in document["compile"]:
            hit = "yes" if hits.get(row["method"]) else "no"
            lines.append(f"| {row['method']} | {row['graphs']} | {row['recompiles']} | {hit} |")
        lines.append("")
    over = document["machine"].get("overheads")
    if over:
        lines.append(
            f"Depth change (48 blocks): {over['depth_change_seconds'] * 1e6:.2f} µs per change, "
            f"{over['depth_change_step_fraction'] * 100:.4f}% of a step. Audit overhead "
            f"(audited / plain step): {over['audit_ratio'] and round(over['audit_ratio'], 2)}."
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
