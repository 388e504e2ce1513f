"""The ``--prefix-cache`` section: a step with ``gg.PrefixCache`` against the gate alone, at depth
1 of 12 on the bench models, measured in one process, interleaved.

Each model trains on a few batches of distinct samples (an epoch). From the second epoch every
sample is a hit: ``memory`` keeps the entries in host memory, ``disk`` memory-maps them (the
page cache warm: they were just written). ``first epoch`` is an epoch that stores every sample
(a cleared cache, so it also pays the first miss's one-time work). The methods' epochs run in
lockstep, batch by batch in a new order each time, so that a busy machine slows them alike;
each figure is the median over the rounds of the epoch's time over the gate alone's.
"""

from __future__ import annotations

import copy
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import gradgate as gg

from ..catalog import FACTORIES
from ..workloads import Size, Workload

MODELS = ("transformer", "gpt2", "llama", "conv_stack")
BLOCKS, DEPTH = 12, 1
METHODS = ("gate", "memory", "disk", "first epoch")


def measure(
    *,
    size: Size = "full",
    models: tuple[str, ...] = MODELS,
    batches: int = 8,
    repeats: int = 7,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """One row per model: the gate alone's step and each method's ratio to it."""
    device = device or torch.device("cpu")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gradgate-prefix-cache-") as folder:
        for name in models:
            workload = FACTORIES[name](size=size, n=BLOCKS, device=device)
            rows.append(_row(workload, f"{folder}/{name}", batches, repeats, device))
    return rows


def _row(
    workload: Workload, folder: str, batches: int, repeats: int, device: torch.device
) -> dict[str, Any]:
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    size = workload.batch.shape[0]
    inputs = [_variant(workload.batch, k) for k in range(batches)]
    keys = [list(range(k * size, (k + 1) * size)) for k in range(batches)]
    steps: dict[str, Callable[[int], None]] = {}
    caches: dict[str, gg.PrefixCache] = {}
    for method in METHODS:
        model = copy.deepcopy(workload.model)
        gate = gg.BackpropGate(model, workload.blocks, depth=DEPTH)
        cache = None
        if method != "gate":
            disk = {"store": "disk", "path": folder} if method == "disk" else {}
            cache = caches[method] = gg.PrefixCache(gate, check=0.0, **disk)  # type: ignore[arg-type]
        fresh = method == "first epoch"
        steps[method] = _stepper(workload, model, cache, inputs, keys, fresh=fresh)
    for method in METHODS:  # warm-up: the caches hold every sample from here on
        for k in range(batches):
            steps[method](k)
    ratios: dict[str, list[float]] = {method: [] for method in METHODS}
    gate_steps = []
    for round_ in range(repeats):  # the methods' epochs in lockstep: batch k of each in turn
        seconds = dict.fromkeys(METHODS, 0.0)
        for k in range(batches):
            order = list(METHODS)
            random.Random(round_ * batches + k).shuffle(order)
            for method in order:
                sync()
                start = time.perf_counter()
                steps[method](k)
                sync()
                seconds[method] += time.perf_counter() - start
        gate_steps.append(seconds["gate"] / batches)
        for method in METHODS:
            ratios[method].append(seconds[method] / seconds["gate"])
    stats = caches["memory"].stats
    for cache in caches.values():
        cache.remove()
    return {
        "model": workload.name,
        "gate_step_seconds": statistics.median(gate_steps),
        "memory": statistics.median(ratios["memory"]),
        "disk": statistics.median(ratios["disk"]),
        "first_epoch": statistics.median(ratios["first epoch"]),
        "bytes_per_sample": stats.stored_bytes // max(stats.entries, 1),
    }


def _stepper(
    workload: Workload,
    model: torch.nn.Module,
    cache: gg.PrefixCache | None,
    inputs: list[torch.Tensor],
    keys: list[list[int]],
    *,
    fresh: bool,
) -> Callable[[int], None]:
    """Step ``k`` of an epoch; with ``fresh``, step 0 starts from an empty cache (the epoch
    stores every sample, paying the first miss's one-time work too)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(k: int) -> None:
        if fresh and k == 0 and cache is not None:
            cache.clear()
        optimizer.zero_grad(set_to_none=True)
        if cache is None:
            loss = workload.loss(workload.forward(model, inputs[k]))
        else:
            with cache.keys(keys[k]):
                loss = workload.loss(workload.forward(model, inputs[k]))
        loss.backward()
        optimizer.step()

    return step


def _variant(batch: torch.Tensor, k: int) -> torch.Tensor:
    """Other samples of the same shape: token ids rotated, images scaled."""
    if batch.is_floating_point():
        return batch * (1 + k / 8)
    return torch.roll(batch, shifts=k, dims=-1)


def table(rows: list[dict[str, Any]]) -> str:
    """The section as text: per model, the gate alone's step and each ratio to it."""
    lines = [
        f"Skip the frozen prefix: gg.PrefixCache at depth {DEPTH} of {BLOCKS}, step time as a "
        "ratio to the gate alone (median of rounds of lockstep epochs)",
        "",
        "| model | gate alone (s/step) | from the 2nd epoch, memory | disk, page cache warm "
        "| first epoch | bytes per sample |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['gate_step_seconds']:.3f} | {row['memory']:.2f} "
            f"| {row['disk']:.2f} | {row['first_epoch']:.2f} | {row['bytes_per_sample']:,} |"
        )
    return "\n".join(lines)


def main() -> None:
    """The section alone: ``python -m gradgate._bench.sections.prefix_cache [--quick | --tiny]
    [--threads N] [--device cuda]`` (``gradgate bench --prefix-cache`` adds it to the whole
    benchmark)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gradgate._bench.sections.prefix_cache")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--tiny", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the store stays on the host)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen: Size = "tiny" if args.tiny else "quick" if args.quick else "full"
    device = torch.device(args.device)
    print(table(measure(size=chosen, models=tuple(args.models), device=device)))


if __name__ == "__main__":
    main()
