"""Steady gradgate / ideal step ratios for an A/B: many interleaved steps in one process.

``gradgate bench --quick`` times 3 steps per row; on a shared machine its ratios move by a few
percent between runs. This script times ``steps`` interleaved pairs of a gradgate step and a
hand-written ideal step (optimizer step included) per model and depth, and prints the median
ratio. Run it once per version, alternating, with ``PYTHONPATH`` on that version's ``src``::

    PYTHONPATH=src python tools/ab_inproc.py B conv_stack,llama,gpt2,transformer 0,2,all 40
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from gradgate._bench.catalog import FACTORIES
from gradgate._bench.methods import Runner


def main(label: str, models: str, depths: str, steps: str = "40") -> None:
    torch.set_num_threads(1)
    for name in models.split(","):
        runner = Runner(FACTORIES[name](size="quick"))
        rows = []
        for depth in [None if d == "all" else int(d) for d in depths.split(",")]:
            for _ in range(5):  # warm-up
                runner.step("gradgate", depth)
                runner.step("ideal", depth)
            times: dict[str, list[float]] = {"gradgate": [], "ideal": []}
            for _ in range(int(steps)):
                for method, samples in times.items():
                    start = time.perf_counter()
                    runner.step(method, depth)
                    samples.append(time.perf_counter() - start)
            gated, ideal = (statistics.median(times[m]) for m in ("gradgate", "ideal"))
            rows.append(f"d={depth}: {gated / ideal:.3f} ({gated * 1e3:.2f}/{ideal * 1e3:.2f} ms)")
        print(label, name, " | ".join(rows), flush=True)
        runner.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
