"""Interleaved A/B of ``gradgate bench``: this checkout against an earlier commit.

Two versions of gradgate cannot share a process, so each round runs the benchmark once per
version, in alternating order (drifts in machine load hit both alike), each in its own process
with ``PYTHONPATH`` on that version's ``src``. The table gives, per model and depth, the median
over rounds of gradgate / ideal step time (depth ``None``: gradgate / the plain model)::

    python tools/ab_bench.py --base 2280912 --rounds 5 -- --quick

Arguments after ``--`` go to ``python -m gradgate._bench``. Uses the stdlib and git only; the
earlier commit is checked out in a temporary git worktree, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_bench(src: Path, extra: list[str], out: Path) -> dict[tuple[str, str], float]:
    """One benchmark run; gradgate / ideal median step time per (model, depth), and the two
    step times in ms (keys with depth ``"<depth> gradgate ms"`` and ``"<depth> ideal ms"``)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    command = [sys.executable, "-m", "gradgate._bench", *extra, "--no-plot", "--no-progress"]
    subprocess.run([*command, "--json", str(out)], env=env, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["results"]
    step = {(r["model"], r["method"], str(r["depth"])): r["step_seconds"] for r in rows}
    ratios = {}
    for (model, method, depth), seconds in step.items():
        if method == "gradgate":
            ideal = step[(model, "ideal", depth)]
            ratios[(model, depth)] = seconds / ideal
            ratios[(model, f"{depth} gradgate ms")] = seconds * 1e3
            ratios[(model, f"{depth} ideal ms")] = ideal * 1e3
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the earlier commit (A)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("bench", nargs="*", help="arguments for gradgate bench (after --)")
    args = parser.parse_args()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ratios: dict[str, list[dict[tuple[str, str], float]]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(worktree), args.base],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            sources = {"base": worktree / "src", "head": ROOT / "src"}
            for round_ in range(args.rounds):
                order = ["base", "head"] if round_ % 2 == 0 else ["head", "base"]
                for version in order:
                    out = Path(tmp) / f"{version}-{round_}.json"
                    ratios[version].append(run_bench(sources[version], args.bench, out))
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, check=False
            )
    print(f"gradgate / ideal, median of {args.rounds} interleaved rounds (ideal at depth None:")
    print(f"the plain model); A = {args.base}, B = {head}; bench arguments: {args.bench}\n")
    print("| model | depth | A | B | A gradgate / ideal ms | B gradgate / ideal ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    medians = {
        v: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for v, runs in ratios.items()
    }
    for model, depth in [key for key in medians["head"] if " " not in key[1]]:
        a, b = medians["base"][(model, depth)], medians["head"][(model, depth)]
        ms = [
            f"{m[(model, f'{depth} gradgate ms')]:.2f} / {m[(model, f'{depth} ideal ms')]:.2f}"
            for m in (medians["base"], medians["head"])
        ]
        print(f"| {model} | {depth} | {a:.3f} | {b:.3f} | {ms[0]} | {ms[1]} |")
    for version in ("base", "head"):
        values = {k: r for k, r in medians[version].items() if " " not in k[1]}
        cut = [r for (_, depth), r in values.items() if depth != "None"]
        plain = [r for (_, depth), r in values.items() if depth == "None"]
        print(
            f"\n{version}: median of all rows {statistics.median(values.values()):.3f}, highest "
            f"with a cut {max(cut):.3f}, depth None highest {max(plain):.3f}",
            end="",
        )
    print()


if __name__ == "__main__":
    main()
