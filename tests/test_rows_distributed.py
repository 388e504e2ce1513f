"""``gg.learn_rows`` on real processes (gloo on CPU, 2 ranks): DDP averages the rows parameter
alone and stays exact; FSDP2 is refused with the reason. One spawned job runs every scenario;
each rank records "ok" or the traceback, and the tests read that record."""

from __future__ import annotations

import copy
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradgate as gg
from gradgate._plumbing.torch_internals import TORCH_RELEASE

pytestmark = pytest.mark.slow

WORLD = 2
ROWS = [9, 2, 5]
VOCAB = 12


class TinyLM(nn.Module):
    """An embedding, two blocks and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def ids(rank: int, step: int) -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(10 * step + rank)
    )


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def ddp_averages_the_rows_exactly(rank: int, record: dict[str, Any]) -> None:
    model = TinyLM()
    reference = copy.deepcopy(model)
    start = model.embed.weight.detach().clone()
    handle = gg.learn_rows(model, "embed", rows=ROWS)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(2):
        loss_of(ddp, ids(rank, step)).backward()
        if step == 0:  # DDP's average of the rows' gradient is the ranks' mean loss's
            loss = sum(loss_of(reference, ids(r, step)) for r in range(WORLD)) / WORLD
            (expected,) = torch.autograd.grad(loss, [reference.embed.weight])
            torch.testing.assert_close(handle.parameter.grad, expected[ROWS], rtol=1e-6, atol=0)
        opt.step()
        opt.zero_grad()
    weight = model.embed.weight
    others = [i for i in range(VOCAB) if i not in ROWS]
    assert torch.equal(weight[others], start[others])
    gathered = [torch.empty_like(handle.parameter) for _ in range(WORLD)]
    dist.all_gather(gathered, handle.parameter.detach())
    assert torch.equal(gathered[0], gathered[1])  # every rank learned the same rows
    record["rows_changed"] = not torch.equal(weight[ROWS], start[ROWS])


def ddp_with_a_gate_and_the_trained_share_comm_hook(rank: int, record: dict[str, Any]) -> None:
    model = TinyLM()
    reference = copy.deepcopy(model)
    handle = gg.learn_rows(model, "embed", rows=ROWS)
    ddp = DDP(model, find_unused_parameters=True)
    gg.distributed.allreduce_trained(ddp)
    gate = gg.BackpropGate(model, blocks=["blocks.0", "blocks.1"])
    gate.learn = {1, "embed"}
    loss_of(ddp, ids(rank, 0)).backward()
    with gg.BackpropGate(reference, blocks=["blocks.0", "blocks.1"]) as plain:
        plain.learn = {1, "embed"}
        loss = sum(loss_of(reference, ids(r, 0)) for r in range(WORLD)) / WORLD
        loss.backward()
    expected = reference.embed.weight.grad[ROWS]
    torch.testing.assert_close(handle.parameter.grad, expected, rtol=1e-6, atol=1e-7)
    assert model.blocks[0][0].weight.grad is None
    gate.remove()


def fsdp2_is_refused_with_the_reason(rank: int, record: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = TinyLM()
    fully_shard(model, mesh=mesh)
    try:
        gg.learn_rows(model, "embed", rows=ROWS)
    except gg.RowsError as error:
        assert "is sharded (FSDP2's fully_shard" in str(error), error
        assert "Learn rows with DDP" in str(error), error
    else:
        raise AssertionError("learn_rows on an FSDP2 model was not refused")
    later = TinyLM()
    gg.learn_rows(later, "embed", rows=ROWS)
    fully_shard(later, mesh=mesh)  # sharded after learn_rows: the forward refuses
    try:
        later(ids(rank, 0))
    except gg.RowsError as error:
        assert "FSDP2's fully_shard" in str(error), error
    else:
        raise AssertionError("a forward of an FSDP2 model sharded after learn_rows ran")


SCENARIOS: list[Callable[[int, dict[str, Any]], None]] = [
    ddp_averages_the_rows_exactly,
    ddp_with_a_gate_and_the_trained_share_comm_hook,
    fsdp2_is_refused_with_the_reason,
]


def run_rank(rank: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    results: dict[str, Any] = {}
    for scenario in SCENARIOS:
        record: dict[str, Any] = {}
        try:
            scenario(rank, record)
            record["outcome"] = "ok"
        except Exception:
            record["outcome"] = traceback.format_exc()
        results[scenario.__name__] = record
        dist.barrier()
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ranks")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    mp.spawn(run_rank, args=(port, str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("scenario", [s.__name__ for s in SCENARIOS])
def test_scenario(results: list[dict[str, Any]], scenario: str) -> None:
    if scenario.startswith("fsdp2") and TORCH_RELEASE < (2, 7):
        pytest.skip("FSDP2 on CPU needs torch 2.7")
    for rank, result in enumerate(results):
        outcome = result[scenario]["outcome"]
        assert outcome == "ok", f"rank {rank}:\n{outcome}"


def test_the_rows_learned_under_ddp(results: list[dict[str, Any]]) -> None:
    assert all(result["ddp_averages_the_rows_exactly"]["rows_changed"] for result in results)
