"""Run the benchmark: every (model, method, depth), interleaved; returns the JSON document."""

from __future__ import annotations

import datetime
import gc
import os
import platform
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from .._plumbing.progress import Progress
from . import compiled, measure
from .catalog import FACTORIES
from .cost import overheads
from .device import Meter, describe, meter_for
from .methods import Runner, configurations
from .workloads import Depth, Size

Config = tuple[str, Depth]


@dataclass
class Options:
    """What to run; ``--quick`` and ``--tiny`` only change these numbers."""

    size: Size = "full"
    repeats: int = 7
    warmup: int = 1
    models: list[str] = field(default_factory=lambda: list(FACTORIES))
    device: str = "cpu"
    amp: str | None = None
    compile: bool = True
    compile_backend: str = "aot_eager"
    compile_blocks: int = 12
    overheads: bool = True
    progress: bool = True
    command: str = "gradgate bench"


def run(options: Options) -> dict[str, Any]:
    """The whole benchmark as the JSON document (``machine``, ``results``, ``compile``)."""
    device = torch.device(options.device)
    meter = meter_for(device)
    machine = _machine(options, device, meter)
    results: list[dict[str, Any]] = []
    for name in options.models:
        results.extend(_bench_model(name, options, device, meter))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    compile_rows: list[dict[str, Any]] = []
    if options.compile:
        compile_rows, machine["compile_recompile_limit_hits"] = _compile_section(options, device)
    if options.overheads:
        small: Size = "quick" if options.size == "full" else "tiny"
        machine["overheads"] = overheads.measure(size=small, device=device)
    machine["load_average_end"] = _load()
    return {"machine": machine, "results": results, "compile": compile_rows}


def _bench_model(
    name: str, options: Options, device: torch.device, meter: Meter
) -> list[dict[str, Any]]:
    workload = FACTORIES[name](size=options.size, device=device)
    runner = Runner(workload, amp=options.amp)
    configs = configurations(workload.depths)
    counts: dict[Config, dict[str, int]] = {}
    peaks: dict[Config, int | None] = {}
    times: dict[Config, list[float]] = {config: [] for config in configs}
    progress = Progress(
        total=len(configs) * (2 + options.warmup + options.repeats),
        description=f"bench {name}",
        enabled=options.progress,
    )
    try:
        for method, depth in configs:  # counted steps, which also warm every configuration up
            counts[method, depth] = measure.counts(runner, method, depth)
            progress.advance(f"{method} depth {depth}: counted")
        for _ in range(options.warmup):
            for method, depth in configs:
                runner.step(method, depth)
                progress.advance(f"{method} depth {depth}: warm-up")
        for method, depth in configs:
            peaks[method, depth] = meter.peak_bytes(_step(runner, method, depth))
            progress.advance(f"{method} depth {depth}: peak memory")
        for round_ in range(options.repeats):
            for method, depth in round_order(configs, round_):
                times[method, depth].append(meter.seconds(_step(runner, method, depth)))
                progress.advance(f"{method} depth {depth}: timed")
    finally:
        progress.close()
        runner.close()
    return [
        {
            "model": name,
            "method": method,
            "depth": depth,
            "step_seconds": statistics.median(times[method, depth]),
            **counts[method, depth],
            "peak_bytes": peaks[method, depth],
        }
        for method, depth in configs
    ]


def round_order(configs: list[Config], round_: int) -> list[Config]:
    """The configurations in a new order each round (the same at every run): a step's time
    depends on the steps before it (their memory and cache traffic), and in a fixed order, even
    a rotated one, each configuration would always follow the same one.

    >>> round_order(["a", "b", "c"], 0) == round_order(["a", "b", "c"], 0)
    True
    >>> sorted(round_order(["a", "b", "c"], 1))
    ['a', 'b', 'c']
    """
    order = list(configs)
    random.Random(round_).shuffle(order)
    return order


def _step(runner: Runner, method: str, depth: Depth) -> Any:
    return lambda: runner.step(method, depth)


def _compile_section(
    options: Options, device: torch.device
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    rows, hits = [], {}
    methods = ("toggle+compile", "gradgate+compile", "gate+torch.compile")
    progress = Progress(total=len(methods), description="bench compile", enabled=options.progress)
    try:
        for method in methods:
            row = compiled.compile_counts(
                method,
                backend=options.compile_backend,
                size="quick" if options.size == "full" else "tiny",
                n=options.compile_blocks,
                device=device,
            )
            hits[method] = row.pop("recompile_limit_hits")
            rows.append(row)
            progress.advance(method)
    finally:
        progress.close()
    return rows, hits


def _machine(options: Options, device: torch.device, meter: Meter) -> dict[str, Any]:
    return {
        "command": options.command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": describe(device),
        "amp": options.amp,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "size": options.size,
        "repeats": options.repeats,
        "warmup": options.warmup,
        "compile_backend": options.compile_backend if options.compile else None,
        "load_average_start": _load(),
        "timing": f"median of interleaved rounds; {meter.timing}",
        "saved_bytes": "distinct storages saved for backward, parameters excluded",
        "peak_bytes": meter.peak,
        "optimizer": "SGD, lr 1e-4",
    }


def _load() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None
