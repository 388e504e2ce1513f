"""Where does gradgate's step time differ from the hand-written ideal?

Profiles gradgate steps with cProfile and reports the time spent inside gradgate's own code
(the gate's hooks and the depth setter) as a fraction of the step, per model, and the
median-of-alternating-steps ratio gradgate / ideal. A maintainer's tool, run as::

    python -m gradgate._bench.cost.profile --size quick --depth 3 --steps 10
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from ..catalog import FACTORIES
from ..methods import Runner


def gate_seconds(stats: pstats.Stats) -> float:
    """Total own time of functions defined in gradgate's package, excluding the bench."""
    total = 0.0
    for (filename, _, _), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "/gradgate/" in filename and "/_bench/" not in filename:
            total += own
    return total


def main() -> None:
    """Profile every workload and print one line each."""
    parser = argparse.ArgumentParser(
        prog="python -m gradgate._bench.cost.profile", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--size", default="quick", choices=["full", "quick", "tiny"])
    parser.add_argument("--depth", default="3", help="an integer, or 'all' for no cut")
    parser.add_argument("--models", nargs="+", choices=list(FACTORIES), default=list(FACTORIES))
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per model")
    args = parser.parse_args()
    depth = None if args.depth == "all" else int(args.depth)
    for name in args.models:
        runner = Runner(FACTORIES[name](size=args.size))
        for method in ("gradgate", "ideal"):
            runner.step(method, depth)
        times: dict[str, list[float]] = {"gradgate": [], "ideal": []}
        for _ in range(args.steps):
            for method in times:
                start = time.perf_counter()
                runner.step(method, depth)
                times[method].append(time.perf_counter() - start)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            runner.step("gradgate", depth)
        profiler.disable()
        stats = pstats.Stats(profiler)
        step = stats.total_tt / args.steps  # type: ignore[attr-defined]
        own = gate_seconds(stats) / args.steps
        ratio = statistics.median(times["gradgate"]) / statistics.median(times["ideal"])
        print(
            f"{name:>12} depth {args.depth}: gradgate/ideal median step {ratio:.3f}; "
            f"gradgate's own code {own * 1e6:.0f} us per step = {own / step * 100:.3f}% "
            "of a profiled step"
        )
        runner.close()


if __name__ == "__main__":
    main()
