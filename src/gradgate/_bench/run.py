"""Run the benchmark: every (model, method, depth), interleaved; returns the JSON document."""

from __future__ import annotations

import datetime
import gc
import os
import platform
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from . import compiled, measure, overheads
from .methods import Runner, configurations
from .workloads import FACTORIES, Depth, Size


@dataclass
class Options:
    """What to run; ``--quick`` and ``--tiny`` only change these numbers."""

    size: Size = "full"
    repeats: int = 7
    warmup: int = 1
    models: list[str] = field(default_factory=lambda: list(FACTORIES))
    compile: bool = True
    compile_backend: str = "aot_eager"
    compile_blocks: int = 12
    overheads: bool = True
    progress: bool = True


def run(options: Options) -> dict[str, Any]:
    """The whole benchmark as the JSON document (``machine``, ``results``, ``compile``)."""
    machine = _machine(options)
    results: list[dict[str, Any]] = []
    for name in options.models:
        results.extend(_bench_model(name, options))
        gc.collect()
    compile_rows: list[dict[str, Any]] = []
    if options.compile:
        with _progress(2, "compile", enabled=options.progress) as advance:
            hits = {}
            for method in ("toggle+compile", "gradgate+compile"):
                row = compiled.compile_counts(
                    method,
                    backend=options.compile_backend,
                    size="tiny" if options.size == "tiny" else "quick",
                    n=options.compile_blocks,
                )
                hits[method] = row.pop("recompile_limit_hits")
                compile_rows.append(row)
                advance()
        machine["compile_recompile_limit_hits"] = hits
    if options.overheads:
        machine["overheads"] = overheads.measure(size="tiny" if options.size == "tiny" else "quick")
    machine["load_average_end"] = _load()
    return {"machine": machine, "results": results, "compile": compile_rows}


def _bench_model(name: str, options: Options) -> list[dict[str, Any]]:
    workload = FACTORIES[name](size=options.size)
    runner = Runner(workload)
    configs = configurations(workload.depths)
    figures: dict[tuple[str, Depth], dict[str, Any]] = {}
    units = len(configs) * (2 + options.warmup + options.repeats)
    try:
        with _progress(units, name, enabled=options.progress) as advance:
            for method, depth in configs:
                figures[method, depth] = {
                    "backward_flops": measure.backward_flops(runner, method, depth),
                    "saved_bytes": measure.saved_bytes(runner, method, depth),
                }
                advance()
            for method, depth in configs:
                figures[method, depth]["peak_rss_bytes"] = measure.peak_rss_bytes(
                    _step(runner, method, depth)
                )
                advance()
            for _ in range(options.warmup):
                for method, depth in configs:
                    runner.step(method, depth)
                    advance()
            times: dict[tuple[str, Depth], list[float]] = {config: [] for config in configs}
            for round_ in range(options.repeats):
                shift = round_ % len(configs)  # rotate so no configuration always runs first
                for method, depth in configs[shift:] + configs[:shift]:
                    times[method, depth].append(measure.timed(_step(runner, method, depth)))
                    advance()
    finally:
        runner.close()
    return [
        {
            "model": name,
            "method": method,
            "depth": depth,
            "step_seconds": statistics.median(times[method, depth]),
            "backward_flops": figures[method, depth]["backward_flops"],
            "saved_bytes": figures[method, depth]["saved_bytes"],
            "peak_rss_bytes": figures[method, depth]["peak_rss_bytes"],
        }
        for method, depth in configs
    ]


def _step(runner: Runner, method: str, depth: Depth) -> Callable[[], None]:
    return lambda: runner.step(method, depth)


@contextmanager
def _progress(total: int, description: str, *, enabled: bool) -> Iterator[Callable[[], None]]:
    """A tqdm bar on stderr when tqdm is installed, else one line per 10%."""
    if not enabled:
        yield lambda: None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        done = [0]

        def advance() -> None:
            done[0] += 1
            if done[0] * 10 // total != (done[0] - 1) * 10 // total:
                print(f"{description}: {done[0]}/{total}", file=sys.stderr, flush=True)

        yield advance
        return
    with tqdm(total=total, desc=f"{description:>12}", file=sys.stderr, leave=True) as bar:
        yield lambda: bar.update(1)


def _machine(options: Options) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cpu",
        "size": options.size,
        "repeats": options.repeats,
        "warmup": options.warmup,
        "compile_backend": options.compile_backend if options.compile else None,
        "load_average_start": _load(),
        "timing": "median wall seconds of forward + backward + SGD step, interleaved rounds",
        "saved_bytes": "distinct storages saved for backward, parameters excluded",
        "peak_rss_bytes": "VmHWM during one step, reset via /proc/self/clear_refs",
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _load() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None
