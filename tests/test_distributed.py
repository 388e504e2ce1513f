"""Real DDP processes (gloo on CPU) with a per-step depth: averaged gradients are exact.

DDP needs ``find_unused_parameters=True`` with a cut: the parameters before it get no gradient
in that step, and DDP leaves their ``.grad`` as None on every rank.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gradgate as gg

DEPTHS = [1, 3, None, 2]
WORLD = 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)])


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def train_rank(rank: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    gate = gg.BackpropGate(model)
    grads = []
    for step, depth in enumerate(DEPTHS):
        ddp.zero_grad(set_to_none=True)
        gate.depth = depth
        ddp(batch(rank, step)).pow(2).sum().backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
    gate.remove()
    torch.save(grads, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_ddp_with_a_per_step_depth_matches_the_averaged_reference(tmp_path: Path) -> None:
    mp.spawn(train_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    model = make_model()
    params = list(model.parameters())
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for step, depth in enumerate(DEPTHS):
            losses = [model(batch(r, step)).pow(2).sum() for r in range(WORLD)]
            reference = torch.autograd.grad(sum(losses) / WORLD, params)
            first_learning = 0 if depth is None else 2 * (4 - depth)
            for i, (grad, expected) in enumerate(zip(got[step], reference, strict=True)):
                if i < first_learning:
                    assert grad is None, (rank, step, i)
                else:
                    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
