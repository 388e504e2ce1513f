"""What ``find_unused_parameters=True`` costs DDP with a gate: step time with and without it.

Two gloo processes on the CPU train the residual MLP stack of ``gradgate bench`` (8 blocks),
each arm with its own ``DistributedDataParallel``, at full depth and at depth 1:

- hand-written, ``find_unused_parameters=False``: the whole model at full depth; at depth 1
  the prefix frozen before DDP is built and run under ``torch.no_grad()``, so that DDP never
  waits for it (the best there is for a depth that never changes);
- the same with ``find_unused_parameters=True``: the flag's own cost (after each forward DDP
  walks the autograd graph from the outputs to find the parameters that get no gradient, wraps
  the outputs in its ``_DDPSink`` and all-reduces a bitmap of the parameters used);
- a ``BackpropGate`` at that depth with ``find_unused_parameters=True`` and
  ``gg.distributed.allreduce_trained``: what a plan that changes needs (the gate refuses DDP
  without the flag), as docs/distributed.md sets it up.

A step is ``zero_grad``, forward, backward (with DDP's all-reduce) and an SGD step. The arms
run in turn, a few steps each, round after round, so that the machine's noise falls on all of
them; the medians (wall time, and the CPU time of the rank's process) and their ratios are
measured in one run. Usage::

    python tools/ddp_find_unused.py [--blocks 8] [--width 256] [--batch 32] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import spawn

import gradgate as gg
from gradgate._bench.sections.schedules import _model

WORLD = 2
ARMS = (  # (depth, find_unused_parameters, gated)
    (None, False, False),
    (None, True, False),
    (None, True, True),
    (1, False, False),
    (1, True, False),
    (1, True, True),
)


class _HandWritten(nn.Module):
    """The stack with its first ``cut`` modules run under ``torch.no_grad()``."""

    def __init__(self, model: nn.Sequential, cut: int) -> None:
        super().__init__()
        self.prefix, self.suffix = model[:cut], model[cut:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = self.prefix(x)
        return self.suffix(x)


def _arm(
    depth: int | None, find_unused: bool, gated: bool, settings: dict[str, Any]
) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    blocks = settings["blocks"]
    torch.manual_seed(0)
    model = _model(blocks, settings["width"])
    gate = None
    if gated:
        wrapped: nn.Module = model
    else:
        cut = 0 if depth is None else 1 + blocks - depth  # the input layer and the cut blocks
        model[:cut].requires_grad_(False)
        wrapped = _HandWritten(model, cut)
    ddp = DistributedDataParallel(wrapped, find_unused_parameters=find_unused)
    handle = None
    if gated:
        handle = gg.distributed.allreduce_trained(ddp)
        gate = gg.BackpropGate(model, [str(i) for i in range(1, blocks + 1)], depth=depth)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return {"ddp": ddp, "gate": gate, "handle": handle, "opt": opt, "times": [], "cpu": []}


def _steps(arm: dict[str, Any], batches: list[torch.Tensor], *, record: bool) -> None:
    ddp, opt = arm["ddp"], arm["opt"]
    for x in batches:
        dist.barrier()  # both ranks start the step together
        start, cpu = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        ddp(x).pow(2).mean().backward()
        opt.step()
        if record:
            arm["times"].append(time.perf_counter() - start)
            arm["cpu"].append(time.process_time() - cpu)


def _rank(rank: int, port: int, out: str, settings: dict[str, Any]) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    try:
        generator = torch.Generator().manual_seed(rank)
        batches = [torch.randn(settings["batch"], 16, generator=generator) for _ in range(5)]
        arms = [_arm(*arm, settings) for arm in ARMS]
        for arm in arms:
            _steps(arm, batches[:3], record=False)  # DDP rebuilds its buckets at first
        for round_ in range(settings["rounds"]):
            order = arms[round_ % len(arms) :] + arms[: round_ % len(arms)]
            for arm in order:
                _steps(arm, batches, record=True)
        if rank == 0:
            medians = {k: [statistics.median(arm[k]) for arm in arms] for k in ("times", "cpu")}
            (Path(out) / "medians.json").write_text(json.dumps(medians))
        for arm in arms:
            if arm["gate"] is not None:
                arm["gate"].remove()
                arm["handle"].remove()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(*, blocks: int = 8, width: int = 256, batch: int = 32, rounds: int = 20) -> str:
    """Spawn the two ranks; the table of median step times and ratios, as text."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    settings = {"blocks": blocks, "width": width, "batch": batch, "rounds": rounds}
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # DDP warns that all is used
    with tempfile.TemporaryDirectory() as out:
        spawn(_rank, args=(port, out, settings), nprocs=WORLD, join=True)
        medians = json.loads((Path(out) / "medians.json").read_text())
    lines = [
        f"DDP step time, {WORLD} gloo ranks on the CPU, {blocks} residual MLP blocks of width "
        f"{width}, batch {batch} a rank, median of {rounds * 5} steps an arm (rank 0)",
        f"{'':>16}  {'hand-written, find_unused=':>27}  {'gate, f_u=True':>14}  "
        f"{'flag: T / F':>11}  {'gate / F':>8}",
        f"{'':>16}  {'False':>12}  {'True':>12}  {'+ allreduce_tr.':>15}",
    ]
    for key, what in (("times", "wall"), ("cpu", "CPU")):
        for i, label in ((0, "full depth"), (3, "depth 1")):
            without, with_, gate = medians[key][i : i + 3]
            lines.append(
                f"{label + ', ' + what:>16}  {1e3 * without:>9.2f} ms  {1e3 * with_:>9.2f} ms  "
                f"{1e3 * gate:>12.2f} ms  {with_ / without:>11.3f}  {gate / without:>8.3f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    print(measure(blocks=args.blocks, width=args.width, batch=args.batch, rounds=args.rounds))


if __name__ == "__main__":
    sys.exit(main())
