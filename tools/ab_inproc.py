"""Gate cost A/B in one process: an earlier commit's gate, this checkout's, and the ideal.

On a shared machine, step times drift by several percent between processes (and memory
layouts differ between them), more than a change to the gate's hot path moves them. Here both
versions run in the same process: the earlier commit's package is exported with ``git archive``
and imported under another name (its modules import each other relatively). Per model and
depth, each round runs one step of each (A's gated copy, B's gated copy, the hand-written
ideal; optimizer step included) and the table gives the median over rounds of A / ideal and
B / ideal::

    PYTHONPATH=src python tools/ab_inproc.py --base d42f23c --steps 60
    PYTHONPATH=src python tools/ab_inproc.py --base d42f23c --cycle   # a new depth every step
    PYTHONPATH=src python tools/ab_inproc.py --base-dir old/src --device cuda --amp bf16

Uses the stdlib, git and torch; the exported copy lives in a temporary folder. Where there is
no git (a lent GPU machine gets a copy of the working tree), ``--base-dir`` names a ``src``
folder exported beforehand (``git archive <commit> src | tar -x -C old``).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import io
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
BASE_NAME = "gradgate_base"


def import_base(commit: str | None, folder: Path, exported: Path | None = None) -> Any:
    """The package ``gradgate`` of ``commit`` (or of the ``src`` folder ``exported``),
    imported as ``gradgate_base``."""
    if exported is not None:
        shutil.copytree(exported / "gradgate", folder / BASE_NAME)
    else:
        archive = subprocess.run(
            ["git", "archive", str(commit), "src/gradgate"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
        (folder / "src" / "gradgate").rename(folder / BASE_NAME)
    sys.path.insert(0, str(folder))
    return importlib.import_module(BASE_NAME)


def compare(
    base: Any,
    name: str,
    depths: list[int | None],
    rounds: int,
    *,
    cycle: bool = False,
    device: torch.device | None = None,
    amp: str | None = None,
) -> str:
    """One model's row: per depth, the medians of A / ideal and B / ideal."""
    from gradgate._bench.catalog import FACTORIES
    from gradgate._bench.methods import Runner

    device = device or torch.device("cpu")
    runner = Runner(FACTORIES[name](size="quick", device=device), amp=amp)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = copy.deepcopy(runner.workload.model)
    gate = base.BackpropGate(model, blocks=runner.workload.blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step_a(depth: int | None) -> None:
        gate.depth = depth
        runner.loss(model).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steps: dict[str, Callable[[int | None], None]] = {
        "A": step_a,
        "B": lambda depth: runner.step("gradgate", depth),
        "ideal": lambda depth: runner.step("ideal", depth),
    }
    # with ``cycle`` every round runs each depth in turn (a depth that changes at every step,
    # as in random-depth loops); else the rounds of one depth run together
    groups = [depths] if cycle else [[depth] for depth in depths]
    times: dict[tuple[str, int | None], list[float]] = {}
    for group in groups:
        for _ in range(5):  # warm-up
            for depth in group:
                for step in steps.values():
                    step(depth)
        for round_ in range(rounds):
            for depth in group:
                # each takes its turn to run first: the step after another depth's (a full
                # backward at depth None) runs slower, and a fixed order charged it to A
                keys = list(steps)[round_ % 3 :] + list(steps)[: round_ % 3]
                for key in keys:
                    step = steps[key]
                    sync()
                    start = time.perf_counter()
                    step(depth)
                    sync()
                    times.setdefault((key, depth), []).append(time.perf_counter() - start)
    cells = []
    for depth in depths:
        ideal = times["ideal", depth]
        a, b = (
            statistics.median(t / i for t, i in zip(times[k, depth], ideal, strict=True))
            for k in ("A", "B")
        )
        pairs = zip(times["A", depth], times["B", depth], strict=True)
        low, high = interval([time_b / time_a for time_a, time_b in pairs])
        cells.append(f"d={depth}: A {a:.3f} B {b:.3f} (B/A {low:.3f}-{high:.3f})")
    gate.remove()
    runner.close()
    return f"{name} " + " | ".join(cells)


def interval(ratios: list[float], resamples: int = 400) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of per-round ratios: a change whose interval
    holds 1 is not one this run can see."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the earlier commit (A)")
    parser.add_argument("--base-dir", type=Path, help="or its exported src folder (no git)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--amp", choices=["bf16"], help="forward under autocast")
    parser.add_argument("--models", default="conv_stack,gpt2,llama,transformer")
    parser.add_argument("--depths", default="0,1,2,3,all")
    parser.add_argument("--steps", type=int, default=60, help="rounds per model and depth")
    parser.add_argument(
        "--cycle", action="store_true", help="a new depth at every step (each round: all depths)"
    )
    args = parser.parse_args()
    if (args.base is None) == (args.base_dir is None):
        parser.error("give one of --base and --base-dir")
    depths = [None if d == "all" else int(d) for d in args.depths.split(",")]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        base = import_base(args.base, Path(folder), args.base_dir)
        print(
            f"A = {args.base or args.base_dir}, B = this checkout; median of gated / ideal step "
            f"time per round ({args.device}{', ' + args.amp if args.amp else ''})"
        )
        device = torch.device(args.device)
        for name in args.models.split(","):
            row = compare(
                base, name, depths, args.steps, cycle=args.cycle, device=device, amp=args.amp
            )
            print(row, flush=True)


if __name__ == "__main__":
    main()
