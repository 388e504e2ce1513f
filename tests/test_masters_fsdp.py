"""LearnerMasters over FSDP2 (``fully_shard``) on 2 and 4 gloo ranks: bit for bit against one
process that averages the ranks' gradients, with masters and state only for the learners' local
shards.

One spawned job per world size runs every scenario below in turn on every rank (as
tests/test_distributed.py does); each rank records "ok" or the traceback, and the numbers.

The reference runs in each rank's own process, without the process group: the same bf16 model,
each rank's micro-batch run in turn, the gradients averaged exactly and rounded once to bf16,
then LearnerMasters steps. With 2 ranks FSDP2's bf16 reduce-scatter gives exactly that average
(one rounding of a + b, then an exact halving). With 4 ranks gloo's bf16 reduce-scatter adds the
four gradients in an order that differs from chunk to chunk (measured: no one order matches all
ranks' chunks), so those runs reduce in float32 (``MixedPrecisionPolicy(reduce_dtype=
torch.float32)``, FSDP2 casts the result back to bf16): that sum of four bf16 values is exact.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_distributed import TIMEOUT, free_port, needs_fsdp2_on_cpu
from test_masters import OPTS, N, batches, loss_of, make, same
from torch import nn

import gradgate as gg

pytestmark = [pytest.mark.slow, needs_fsdp2_on_cpu]  # spawned processes: seconds
STEPS = 8


# -- the sharded model and the reference ------------------------------------------------------
def sharded(world: int, **options: Any) -> nn.Module:
    """test_masters' bf16 Net, each block and then the root fully_shard-ed over ``world``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32 if world > 2 else None)
    model = make()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, **options)
    fully_shard(model, mesh=mesh, mp_policy=policy, **options)
    return model


def part(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    size = t.shape[0] // world
    return t[rank * size : (rank + 1) * size]


def averaged_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, world: int) -> None:
    """Each rank's micro-batch in turn; ``.grad`` = their exact average rounded once."""
    grads: dict[torch.Tensor, list[torch.Tensor]] = {}
    for rank in range(world):
        loss_of(model, part(x, rank, world), part(y, rank, world)).backward()
        for p in model.parameters():
            if p.grad is not None:
                grads.setdefault(p, []).append(p.grad)
                p.grad = None
    for p, each in grads.items():
        p.grad = (sum(g.double() for g in each) / world).to(p.dtype)


Step = Callable[[nn.Module, torch.optim.Optimizer, int], None]


def run(
    model: nn.Module,
    schedule: gg.schedules.Schedule,
    *,
    world: int,
    rank: int | None,
    steps: range = range(STEPS),
    opt: gg.optim.LearnerMasters | None = None,
    offload: str | None = None,
    each_step: Step | None = None,
) -> tuple[gg.optim.LearnerMasters, list[dict[str, Any]]]:
    """Train ``model`` (sharded when ``rank`` is given, else the reference) through ``steps``;
    per step: the learners' names and what the optimizer holds."""
    gate = gg.BackpropGate(model, "blocks.*")
    if opt is None:
        opt = gg.optim.LearnerMasters(
            torch.optim.AdamW, model.parameters(), offload=offload, **OPTS
        )
    seen = []
    data = batches(STEPS)
    for t in steps:
        x, y = data[t]
        schedule.apply(gate, t)
        if rank is None:
            averaged_backward(model, x, y, world)
        else:
            loss_of(model, part(x, rank, world), part(y, rank, world)).backward()
        learners = [n for n, p in model.named_parameters() if p.grad is not None]
        if each_step is not None:
            each_step(model, opt, t)
        opt.step()
        opt.zero_grad()
        seen.append(
            {"learners": learners, "held": opt.master_bytes(), "all": gg.optim.state_bytes(opt)}
        )
        gg.optim.drop_finished(opt, gate, schedule, t + 1)
    gate.remove()
    return opt, seen


def assert_same_as(model: nn.Module, reference: nn.Module, where: str) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert same(p.full_tensor(), q), f"{where}: {name} differs from the reference"


def local_numel(model: nn.Module, names: list[str]) -> int:
    params = dict(model.named_parameters())
    return sum(params[n].to_local().numel() for n in names)


# -- scenarios, run on every rank --------------------------------------------------------------
def master_bytes_count_the_local_shards(rank: int, world: int, record: dict[str, Any]) -> None:
    """BAdam: after each step this rank holds 12 bytes (master, exp_avg, exp_avg_sq) for each
    element of the learners' local shards, and each learner's 4-byte step count."""
    model = sharded(world)
    opt, seen = run(model, gg.schedules.BAdam(N, 2, order="random", seed=1), world=world, rank=rank)
    held = [s["held"] for s in seen]
    assert [s["all"] for s in seen] == held  # on the CPU the step counts are counted too
    want = [12 * local_numel(model, s["learners"]) + 4 * len(s["learners"]) for s in seen]
    assert held == want, (held, want)
    for p, entry in opt.state.items():
        assert entry["master"].to_local().shape == p.to_local().shape
    total = torch.tensor(held)
    dist.all_reduce(total)
    whole = dict(make().named_parameters())
    elements = [sum(whole[n].numel() for n in s["learners"]) for s in seen]
    counts = [4 * world * len(s["learners"]) for s in seen]
    assert total.tolist() == [12 * e + c for e, c in zip(elements, counts, strict=True)]
    record["held"] = held


SCENARIOS = [master_bytes_count_the_local_shards]


# -- the spawned job ---------------------------------------------------------------------------
def run_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    results: dict[str, Any] = {}
    for scenario in SCENARIOS:
        record: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            scenario(rank, world, record)
            record["outcome"] = "ok"
        except Exception:
            record["outcome"] = traceback.format_exc()
        record["seconds"] = time.perf_counter() - start
        results[scenario.__name__] = record
        dist.barrier()  # a failed scenario leaves no collective behind for the next one
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    world = request.param
    out = tmp_path_factory.mktemp(f"fsdp{world}")
    mp.spawn(run_rank, args=(world, free_port(), str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


@pytest.mark.parametrize("scenario", [s.__name__ for s in SCENARIOS])
def test_scenario(results: list[dict[str, Any]], scenario: str) -> None:
    for rank, result in enumerate(results):
        outcome = result[scenario]["outcome"]
        assert outcome == "ok", f"rank {rank}:\n{outcome}"
