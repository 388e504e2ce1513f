"""The ``--distributed`` section: bytes all-reduced per step, plain DDP against allreduce_trained.

Two gloo processes on the CPU train the residual MLP stack of the schedules section with
``DistributedDataParallel(find_unused_parameters=True)`` and a gate at several depths: once with
DDP's own averaging (its default all-reduce, registered as a comm hook so that it can be
counted) and once with ``gg.distributed.allreduce_trained``. Every ``torch.distributed.all_reduce``
is counted: gradient bytes, and apart from them the one byte per parameter with which
``allreduce_trained`` agrees on what to send. DDP's own per-step exchange of which parameters
were used (C++, the same for both) is not counted. The gradients of the two are compared.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

import gradgate as gg

from .schedules import _model

WORLD = 2
METHODS = ("DDP", "allreduce_trained")


@contextmanager
def counting_all_reduce() -> Iterator[list[tuple[torch.dtype, int]]]:
    """Record (dtype, bytes) of every torch.distributed.all_reduce called from Python."""
    calls: list[tuple[torch.dtype, int]] = []
    original = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((tensor.dtype, tensor.numel() * tensor.element_size()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield calls
    finally:
        dist.all_reduce = original


def measure(
    *,
    blocks: int = 8,
    width: int = 128,
    steps: int = 3,
    depths: Sequence[int | None] = (1, 2, 4, None),
) -> dict[str, Any]:
    """Spawn two gloo processes; one row per depth, bytes per step of each method."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory() as out:
        settings = {"blocks": blocks, "width": width, "steps": steps, "depths": list(depths)}
        quiet = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # DDP warns at full depth that all is used
        try:
            spawn(_rank, args=(port, out, settings), nprocs=WORLD, join=True)
        finally:
            if quiet is None:
                del os.environ["TORCH_CPP_LOG_LEVEL"]
            else:
                os.environ["TORCH_CPP_LOG_LEVEL"] = quiet
        rows = json.loads((Path(out) / "rows.json").read_text())
    return {"world_size": WORLD, "backend": "gloo", **settings, "rows": rows}


def _rank(rank: int, port: int, out: str, settings: dict[str, Any]) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        rows = [_depth_row(rank, depth, settings) for depth in settings["depths"]]
        if rank == 0:
            (Path(out) / "rows.json").write_text(json.dumps(rows))
        dist.barrier()  # tearing down while the other rank still talks aborts the process
    finally:
        dist.destroy_process_group()


def _depth_row(rank: int, depth: int | None, settings: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    blocks, steps = settings["blocks"], settings["steps"]
    torch.manual_seed(0)
    base = _model(blocks, settings["width"])
    generators = [torch.Generator().manual_seed(100 * step + rank) for step in range(steps)]
    batches = [torch.randn(16, 16, generator=g) for g in generators]
    row: dict[str, Any] = {"depth": depth}
    grads: dict[str, list[torch.Tensor | None]] = {}
    for method in METHODS:
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        if method == "DDP":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        else:
            handle = gg.distributed.allreduce_trained(ddp)
        gate = gg.BackpropGate(model, [str(i) for i in range(1, blocks + 1)], depth=depth)
        sent = agreed = 0
        for x in batches:
            ddp.zero_grad(set_to_none=True)
            with counting_all_reduce() as calls:
                ddp(x).pow(2).mean().backward()
            sent += sum(size for dtype, size in calls if dtype.is_floating_point)
            agreed += sum(size for dtype, size in calls if not dtype.is_floating_point)
        gate.remove()
        if method != "DDP":
            handle.remove()
        params = list(model.parameters())
        grads[method] = [p.grad for p in params]
        trained = sum(p.numel() * p.element_size() for p in params if p.grad is not None)
        row["trained_share"] = trained / sum(p.numel() * p.element_size() for p in params)
        row[f"{method}_bytes"] = sent // steps
        row[f"{method}_agreement_bytes"] = agreed // steps
    row["ratio"] = row["allreduce_trained_bytes"] / row["DDP_bytes"]
    row["max_grad_difference"] = max(
        (a - b).abs().max().item() if a is not None and b is not None else 0.0
        for a, b in zip(grads["DDP"], grads["allreduce_trained"], strict=True)
    )
    return row


def table(section: dict[str, Any]) -> str:
    """The section as text: one line per depth."""
    lines = [
        f"Distributed: bytes all-reduced per step ({section['world_size']} {section['backend']} "
        f"ranks on the CPU, {section['blocks']} residual MLP blocks of width {section['width']}, "
        "DDP with find_unused_parameters=True)",
        f"{'depth':>5}  {'trained share':>13}  {'DDP':>10}  {'allreduce_trained':>17}  "
        f"{'ratio':>6}  {'+ agreement':>11}  {'max |grad diff|':>15}",
    ]
    for row in section["rows"]:
        depth = "full" if row["depth"] is None else str(row["depth"])
        lines.append(
            f"{depth:>5}  {row['trained_share']:>13.3f}  {row['DDP_bytes']:>10,}  "
            f"{row['allreduce_trained_bytes']:>17,}  {row['ratio']:>6.3f}  "
            f"{row['allreduce_trained_agreement_bytes']:>11,}  {row['max_grad_difference']:>15.1e}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(measure()))
