"""DDP over 2 gloo processes with LearnerMasters + BAdam: what one process computes, with only
the learners on the wire (gg.distributed.allreduce_trained).

BAdam's own README warned that DDP was "unpredictable": its reducer is built for the first
block's parameters only. The gate keeps every parameter registered, so the reducer covers all of
them and the comm hook sends only the active block and the head.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_masters import OPTS, N, batches, loss_of, make, same
from torch.nn.parallel import DistributedDataParallel

import gradgate as gg

pytestmark = pytest.mark.slow  # two spawned processes: a few seconds
STEPS, K, HALF = 8, 2, 4


def schedule() -> gg.schedules.BAdam:
    return gg.schedules.BAdam(N, K, order="random", seed=1)


def rank_run(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    model = make()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    handle = gg.distributed.allreduce_trained(ddp)
    gate = gg.BackpropGate(model, "blocks.*", check_ranks=True)
    sched = schedule()
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    sent, held = [], []
    for t, (x, y) in enumerate(batches(STEPS)):
        sched.apply(gate, t)
        before = handle.bytes_reduced
        loss_of(
            ddp, x[rank * HALF : (rank + 1) * HALF], y[rank * HALF : (rank + 1) * HALF]
        ).backward()
        sent.append(handle.bytes_reduced - before)
        opt.step()
        opt.zero_grad()
        held.append(opt.master_bytes())
        gg.optim.drop_finished(opt, gate, sched, t + 1)
    torch.save(
        {"params": [p.detach() for p in model.parameters()], "sent": sent, "held": held},
        f"{out}.{rank}",
    )
    gate.remove()
    handle.remove()
    dist.destroy_process_group()


def one_process() -> torch.nn.Module:
    """The hook's arithmetic in one process: each half-batch's bf16 gradient halved, summed."""
    model = make()
    gate = gg.BackpropGate(model, "blocks.*")
    sched = schedule()
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    for t, (x, y) in enumerate(batches(STEPS)):
        sched.apply(gate, t)
        halves = []
        for r in range(2):
            loss_of(model, x[r * HALF : (r + 1) * HALF], y[r * HALF : (r + 1) * HALF]).backward()
            halves.append({p: p.grad for p in model.parameters() if p.grad is not None})
            opt.zero_grad()
        for p, grad in halves[0].items():
            p.grad = grad / 2 + halves[1][p] / 2
        opt.step()
        opt.zero_grad()
        gg.optim.drop_finished(opt, gate, sched, t + 1)
    gate.remove()
    return model


def test_ddp_ranks_agree_with_one_process_and_send_only_the_learners(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    mp.spawn(rank_run, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    reference = one_process()
    for i, p in enumerate(reference.parameters()):
        assert same(ranks[0]["params"][i], ranks[1]["params"][i]), i
        assert same(ranks[0]["params"][i], p), i
    sched = schedule()
    head = sum(2 * p.numel() for p in reference.head.parameters())
    block = sum(2 * p.numel() for p in reference.blocks[0].parameters())
    assert ranks[0]["sent"] == ranks[1]["sent"] == [block + head] * STEPS
    held = [12 * (block + head) // 2 + 4 * (4 + 2)] * STEPS  # masters + AdamW: 12 B a parameter
    assert ranks[0]["held"] == ranks[1]["held"] == held
    assert len({sched.active(t) for t in range(STEPS)}) == N  # every block learned
