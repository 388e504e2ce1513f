"""The compile section: graphs and recompiles over a per-minibatch depth schedule.

``toggle+compile`` compiles the whole model and toggles ``requires_grad`` on the prefix;
``gradgate+compile`` compiles each block with :func:`gradgate.compile_blocks` and cuts with a
:class:`gradgate.BackpropGate`; ``gate+torch.compile`` gates the model and compiles it whole with
``torch.compile(model)``. All see the same schedule: a warm-up over depths
``[None, 0, n]`` (the three states a block can be in), then every depth ``0..n`` in a shuffled
order, twice. ``graphs`` counts the distinct graphs dynamo compiled over the whole schedule;
``recompiles`` counts the compilations after the warm-up.
"""

from __future__ import annotations

import logging
import random
from contextlib import nullcontext
from typing import Any

import torch

import gradgate as gg

from .workloads import Depth, Size, transformer

_LIMIT_MESSAGE = "hit config.recompile_limit"


class _LimitWatcher(logging.Filter):
    """Counts dynamo's 'hit the recompile limit' messages and keeps them off the screen."""

    def __init__(self) -> None:
        super().__init__()
        self.hits = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if _LIMIT_MESSAGE in record.getMessage():
            self.hits += 1
            return False
        return True


def schedule(n: int, *, seed: int = 0) -> tuple[list[Depth], list[Depth]]:
    """(warm-up depths, measured depths) for ``n`` blocks.

    >>> warm, rest = schedule(3)
    >>> warm, sorted(rest, key=str)
    ([None, 0, 3], [0, 0, 1, 1, 2, 2, 3, 3, None, None])
    """
    rng = random.Random(seed)
    rest: list[Depth] = []
    for _ in range(2):
        round_: list[Depth] = [*range(n + 1), None]
        rng.shuffle(round_)
        rest.extend(round_)
    return [None, 0, n], rest


def compile_counts(
    method: str,
    *,
    backend: str = "aot_eager",
    size: Size = "tiny",
    n: int = 12,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """``{"method", "graphs", "recompiles", "recompile_limit_hits"}`` for one method above."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    start = int(counters["stats"]["unique_graphs"])
    workload = transformer(size=size, n=n, d_model=32 if size != "tiny" else None, device=device)
    model, batch = workload.model, workload.batch
    warm, rest = schedule(n)
    watcher = _LimitWatcher()
    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    dynamo_log.addFilter(watcher)
    try:
        if method == "toggle+compile":
            compiled = torch.compile(model, backend=backend)

            def step(depth: Depth) -> None:
                frozen = {id(p) for p in workload.prefix_parameters(model, depth)}
                for param in model.parameters():
                    param.requires_grad_(id(param) not in frozen)
                workload.loss(compiled(batch)).backward()
                for param in model.parameters():
                    param.requires_grad_(True)
                model.zero_grad(set_to_none=True)

            graphs_at_warm = _run(step, warm, counters)
            graphs = _run(step, rest, counters)
        elif method in ("gradgate+compile", "gate+torch.compile"):
            whole = method == "gate+torch.compile"
            with (
                nullcontext()
                if whole
                else gg.compile_blocks(model, workload.blocks, backend=backend),
                gg.BackpropGate(model, blocks=workload.blocks) as gate,
            ):
                call = torch.compile(model, backend=backend) if whole else model

                def step(depth: Depth) -> None:
                    gate.depth = depth
                    workload.loss(call(batch)).backward()
                    model.zero_grad(set_to_none=True)

                graphs_at_warm = _run(step, warm, counters)
                graphs = _run(step, rest, counters)
        else:
            raise gg.InvalidOptionError(
                f"compile method {method!r}; expected 'toggle+compile', 'gradgate+compile' or "
                "'gate+torch.compile'."
            )
    finally:
        dynamo_log.removeFilter(watcher)
    return {
        "method": method,
        "graphs": graphs - start,
        "recompiles": graphs - graphs_at_warm,
        "recompile_limit_hits": watcher.hits,
    }


def _run(step: Any, depths: list[Depth], counters: Any) -> int:
    for depth in depths:
        step(depth)
    return int(counters["stats"]["unique_graphs"])


def step_overhead(blocks: int = 12, rounds: int = 5, steps: int = 200) -> dict[str, float]:
    """CPU µs per step of a gated residual model: uncompiled, ``gg.compile_blocks``, and
    ``torch.compile(model)``, backend ``eager`` (only dynamo's own per-call cost shows).

    One model copy and gate per method, interleaved rounds, medians;
    ``python -m gradgate._bench.compiled``.
    """
    import copy
    import statistics
    import time

    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(blocks)]
    model, x = nn.Sequential(*layers, nn.Linear(16, 1)), torch.randn(4, 16)
    names = [str(i) for i in range(blocks)]
    depths = [None, 0, blocks, 1, blocks // 4, blocks // 2]
    torch._dynamo.reset()
    runs = {}
    for method in ("uncompiled", "compile_blocks", "torch.compile(model)"):
        net = copy.deepcopy(model)
        if method == "compile_blocks":
            gg.compile_blocks(net, names, backend="eager")
        gate = gg.BackpropGate(net, names)  # before torch.compile: see docs/performance.md
        call = torch.compile(net, backend="eager") if method.startswith("torch") else net
        runs[method] = (net, call, gate)

    def run(method: str, count: int) -> float:
        net, call, gate = runs[method]
        start = time.process_time()
        for i in range(count):
            gate.depth = depths[i % len(depths)]
            call(x).sum().backward()
            net.zero_grad(set_to_none=True)
        return (time.process_time() - start) / count * 1e6

    for method in runs:
        run(method, 2 * len(depths))  # every graph compiled before the clock starts
    times: dict[str, list[float]] = {method: [] for method in runs}
    for _ in range(rounds):
        for method in runs:
            times[method].append(run(method, steps))
    return {method: statistics.median(values) for method, values in times.items()}


if __name__ == "__main__":
    for method, micros in step_overhead().items():
        print(f"{method:>22}: {micros:7.0f} us per step")
