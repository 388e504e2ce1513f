"""Cost of the gate's hooks per step, in CPU time: a gated step against the same step ungated.

``python -m gradgate._bench.cost.hook_cost [label]``; run it with ``PYTHONPATH`` pointing at another
checkout's ``src`` to compare versions. CPU time (``time.process_time``) rather than wall time,
so other processes on a shared machine disturb it less.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

import gradgate as gg


def main(label: str = "gradgate", blocks: int = 24, rounds: int = 21, steps: int = 100) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(blocks)])
    x = torch.randn(4, 16)

    def per_step() -> float:
        start = time.process_time()
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
        return (time.process_time() - start) / steps

    plain, gated = [], []
    for _ in range(rounds):  # interleaved, so drifts in machine load hit both alike
        plain.append(per_step())
        gate = gg.BackpropGate(model, depth=blocks)  # cut at block 0: every hook fires
        gated.append(per_step())
        gate.remove()
    p, g = statistics.median(plain), statistics.median(gated)
    gate = gg.BackpropGate(model)
    start = time.process_time()
    for i in range(200_000):
        gate.depth = i % blocks
    change = (time.process_time() - start) / 200_000
    gate.remove()
    print(
        f"{label}: gated/ungated step {g / p:.3f}, hooks {(g - p) * 1e6 / blocks:.1f} us per "
        f"block per step, depth change {change * 1e6:.2f} us"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gradgate")
