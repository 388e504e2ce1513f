"""The bench's noise floor: an A/A run, the hand-written ideal in gradgate's place.

The ``gradgate`` cells run the ideal forward on the gated copy with its gate removed, so every
ratio gradgate / ideal would be 1 on a perfect machine; what the table reads instead is what the
bench cannot resolve. ``--shared`` runs the ideal on full backprop's copy instead of its own
(before, it shared that copy with late-freeze and toggle too)::

    PYTHONPATH=src python tools/bench_aa.py --runs 3
    PYTHONPATH=src python tools/bench_aa.py --runs 3 --shared

Prints, per run, the median and the largest ratio over the quick bench's 16 cells, then each
cell.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from gradgate._bench import methods
from gradgate._bench import run as bench


def a_a_runner(*, shared: bool) -> type[methods.Runner]:
    class Runner(methods.Runner):
        def __init__(self, workload: Any, **kwargs: Any) -> None:
            super().__init__(workload, **kwargs)
            self.gate.remove()
            if shared:
                self._models["ideal"] = self.model
                self._optimizers["ideal"] = self._optimizers["full"]
            self._steps["gradgate"] = self._ideal_on_the_gated_copy

        def _ideal_on_the_gated_copy(self, depth: Any, backward: Any) -> None:
            backward(self.loss(self.gated, depth, ideal=True))

    return Runner


def ratios(document: dict[str, Any]) -> dict[tuple[str, Any], float]:
    steps = {(r["model"], r["method"], r["depth"]): r["step_seconds"] for r in document["results"]}
    return {
        (model, depth): seconds / steps[model, "ideal", depth]
        for (model, method, depth), seconds in steps.items()
        if method == "gradgate"
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9, help="as gradgate bench --quick")
    parser.add_argument("--shared", action="store_true", help="the ideal on full's copy")
    args = parser.parse_args()
    bench.Runner = a_a_runner(shared=args.shared)  # type: ignore[misc]
    options = bench.Options(
        size="quick", repeats=args.repeats, compile=False, overheads=False, progress=False
    )
    for run in range(args.runs):
        cells = ratios(bench.run(options))
        values = list(cells.values())
        print(
            f"run {run + 1}: median {statistics.median(values):.3f} max {max(values):.3f} | "
            + " ".join(f"{model}/{depth} {ratio:.3f}" for (model, depth), ratio in cells.items())
        )


if __name__ == "__main__":
    main()
