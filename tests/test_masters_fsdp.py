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

import copy
import importlib
import io
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
from torch.distributed.tensor import DTensor

import gradgate as gg

pytestmark = [pytest.mark.slow, needs_fsdp2_on_cpu]  # spawned processes: seconds
STEPS = 8


# -- the sharded model and the reference ------------------------------------------------------
def sharded(world: int, seed: int = 0, **options: Any) -> nn.Module:
    """test_masters' bf16 Net, each block and then the root fully_shard-ed over ``world``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32 if world > 2 else None)
    model = make(seed=seed)
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


def run(
    model: nn.Module,
    schedule: gg.schedules.Schedule,
    *,
    world: int,
    rank: int | None,
    steps: range = range(STEPS),
    opt: gg.optim.LearnerMasters | None = None,
    offload: str | None = None,
    clip: tuple[Callable[..., torch.Tensor], float] | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> tuple[gg.optim.LearnerMasters, list[dict[str, Any]]]:
    """Train ``model`` (sharded when ``rank`` is given, else the reference) through ``steps``:
    the schedule's plan, backward, ``clip = (function, max_norm)``, the step, ``scheduler``'s
    step, the finished blocks' state dropped. Per step: the learners and the bytes held."""
    gate = gg.BackpropGate(model, "blocks.*")
    opt = opt or masters(model, offload)
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
        norm = None
        if clip is not None:
            norm = clip[0](model.parameters(), clip[1])
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        held, everything = opt.master_bytes(), gg.optim.state_bytes(opt)
        seen.append({"learners": learners, "held": held, "all": everything, "norm": norm})
        gg.optim.drop_finished(opt, gate, schedule, t + 1)
    gate.remove()
    return opt, seen


def masters(model: nn.Module, offload: str | None = None) -> gg.optim.LearnerMasters:
    return gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), offload=offload, **OPTS)


def warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A linear warmup over 3 steps (from lr / 4), then a decay: every step has its own lr."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: (t + 1) / 4 if t < 3 else 0.9**t)


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


def schedules() -> dict[str, gg.schedules.Schedule]:
    return {
        "BAdam": gg.schedules.BAdam(N, 2, order="random", seed=1),
        "LISA": gg.schedules.LISA(N, 1, every=3, seed=2),
        "GradualUnfreeze": gg.schedules.GradualUnfreeze(N, every=2, start=1, then_all=True),
        "RandomDepth": gg.schedules.RandomDepth(N, seed=3),
    }


def schedules_are_exact(rank: int, world: int, record: dict[str, Any]) -> None:
    """BAdam, LISA and two depth schedules, with and without offload: every parameter equals
    the reference's, bit for bit, after 8 steps."""
    for name, offloads in [
        ("BAdam", (None, "cpu")),
        ("LISA", (None,)),
        ("GradualUnfreeze", ("cpu",)),
        ("RandomDepth", (None,)),
    ]:
        for offload in offloads:
            model, reference = sharded(world), make()
            run(model, schedules()[name], world=world, rank=rank, offload=offload)
            run(reference, schedules()[name], world=world, rank=None, offload=offload)
            assert_same_as(model, reference, f"{name}, offload={offload}")


def clipping_and_an_lr_scheduler_are_exact(rank: int, world: int, record: dict[str, Any]) -> None:
    """gg.optim.clip_grad_norm_ on the DTensor gradients and a LambdaLR warmup: the norm is the
    reference's over the whole model, and so are the parameters, bit for bit. torch's own
    clip_grad_norm_ sees the whole model too, within a bf16 rounding of its norm."""
    for clip in (gg.optim.clip_grad_norm_, torch.nn.utils.clip_grad_norm_, None):
        model, reference = sharded(world), make()
        opts = {"world": world, "clip": None if clip is None else (clip, 0.05)}
        got = run(
            model,
            schedules()["LISA"],
            rank=rank,
            scheduler=warmup(o := masters(model)),
            opt=o,
            **opts,
        )[1]
        want = run(
            reference,
            schedules()["LISA"],
            rank=None,
            scheduler=warmup(r := masters(reference)),
            opt=r,
            **opts,
        )[1]
        if clip is torch.nn.utils.clip_grad_norm_:
            for g, w in zip(got, want, strict=True):
                # a norm per rank would be off by sqrt(world) or so
                torch.testing.assert_close(g["norm"], w["norm"], rtol=0.02, atol=0)
            continue  # the parameters follow the norm's rounding
        if clip is not None:
            norms = [(g["norm"], w["norm"]) for g, w in zip(got, want, strict=True)]
            assert all(same(g, w) for g, w in norms), norms
            assert all(w > 0.05 for _, w in norms)  # it clipped every step
            record["norms"] = [w.item() for _, w in norms]
        assert_same_as(model, reference, f"clip={clip}")


def resume_from_the_sharded_state_dict(rank: int, world: int, record: dict[str, Any]) -> None:
    """5 steps; each rank saves its model's, LearnerMasters' and the LR scheduler's state_dict
    (the masters and moments of its local shards, as DTensors) with torch.save; a model built
    afresh loads them and trains 3 more steps: bit for bit the reference's 8 steps."""
    for offload in (None, "cpu"):
        reference = make()
        ref_opt = masters(reference, offload)
        run(
            reference,
            schedules()["BAdam"],
            world=world,
            rank=None,
            opt=ref_opt,
            scheduler=warmup(ref_opt),
        )
        first = sharded(world)
        opt = masters(first, offload)
        scheduler = warmup(opt)
        run(
            first,
            schedules()["BAdam"],
            world=world,
            rank=rank,
            steps=range(5),
            opt=opt,
            scheduler=scheduler,
        )
        buffer = io.BytesIO()
        torch.save(
            {"model": first.state_dict(), "opt": opt.state_dict(), "lr": scheduler.state_dict()},
            buffer,
        )
        saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        assert all(
            isinstance(v, DTensor)
            for e in saved["opt"]["state"].values()
            for k, v in e.items()
            if k != "step"
        )
        second = sharded(world, seed=7)
        second.load_state_dict(saved["model"])
        opt = masters(second, offload)
        scheduler = warmup(opt)  # before the optimizer's state: it sets the lr of step 0
        opt.load_state_dict(saved["opt"])
        scheduler.load_state_dict(saved["lr"])
        run(
            second,
            schedules()["BAdam"],
            world=world,
            rank=rank,
            steps=range(5, STEPS),
            opt=opt,
            scheduler=scheduler,
        )
        assert_same_as(second, reference, f"resumed, offload={offload}")


def full_state_dicts_move_between_world_sizes(
    rank: int, world: int, record: dict[str, Any]
) -> None:
    """A whole-tensor state_dict moves between one process and ``world`` ranks: the single
    process's loads into the sharded LearnerMasters (each rank keeps its shards), and
    torch.distributed.checkpoint's full_state_dict of the sharded one equals the single
    process's bit for bit and loads back (strict=False: only the learners have state). Each
    way, 3 more steps give the reference's 8."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    names = [n for n, _ in make().named_parameters()]
    reference = make()
    ref_opt, _ = run(reference, schedules()["LISA"], world=world, rank=None, steps=range(5))
    saved = copy.deepcopy(ref_opt.state_dict())  # its tensors go on stepping
    reference_at_5 = {n: p.detach().clone() for n, p in reference.named_parameters()}
    run(reference, schedules()["LISA"], world=world, rank=None, steps=range(5, STEPS), opt=ref_opt)

    model = sharded(world, seed=7)  # one process -> world ranks
    set_model_state_dict(model, reference_at_5, options=full)
    opt = masters(model)
    opt.load_state_dict(saved)
    for p, entry in opt.state.items():
        assert entry["master"].to_local().shape == p.to_local().shape
    run(model, schedules()["LISA"], world=world, rank=rank, steps=range(5, STEPS), opt=opt)
    assert_same_as(model, reference, "loaded from one process")

    model = sharded(world)  # world ranks -> a full state dict -> world ranks
    opt, _ = run(model, schedules()["LISA"], world=world, rank=rank, steps=range(5))
    gathered = get_optimizer_state_dict(model, opt, options=full)
    assert sorted(gathered["state"]) == sorted(names[i] for i in saved["state"])
    for i, entry in saved["state"].items():
        for key, value in entry.items():
            assert same(gathered["state"][names[i]][key], value), (names[i], key)
    weights = get_model_state_dict(model, options=full)
    again = sharded(world, seed=7)
    set_model_state_dict(again, weights, options=full)
    opt = masters(again)
    opt.load_state_dict(gathered)  # keyed by name: each rank cuts its shards
    run(again, schedules()["LISA"], world=world, rank=rank, steps=range(5, STEPS), opt=opt)
    assert_same_as(again, reference, "loaded from a gathered state dict")

    model = sharded(world)  # torch.distributed.checkpoint's sharded state dict, both ways
    opt, _ = run(model, schedules()["LISA"], world=world, rank=rank, steps=range(5))
    optim_state = get_optimizer_state_dict(model, opt)
    again = sharded(world, seed=7)
    set_model_state_dict(again, get_model_state_dict(model))
    opt = masters(again)
    # strict=False: a parameter that requires grad but has no state is not an error here
    set_optimizer_state_dict(again, opt, optim_state, options=StateDictOptions(strict=False))
    run(again, schedules()["LISA"], world=world, rank=rank, steps=range(5, STEPS), opt=opt)
    assert_same_as(again, reference, "loaded from torch.distributed.checkpoint's sharded dict")


def checkpoint_probe_makes_no_masters(rank: int, world: int, record: dict[str, Any]) -> None:
    """torch.distributed.checkpoint steps an optimizer without state once (lr 0, zero grads)
    to see its layout: LearnerMasters makes no master and moves nothing."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = sharded(world)
    model.head.requires_grad_(False)  # the probe gives it no .grad
    opt = masters(model)
    before = [p.to_local().clone() for p in model.parameters()]
    assert get_optimizer_state_dict(model, opt)["state"] == {}
    assert not opt.state and opt.master_bytes() == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(same(p.to_local(), b) for p, b in zip(model.parameters(), before, strict=True))


SCENARIOS = [
    master_bytes_count_the_local_shards,
    schedules_are_exact,
    clipping_and_an_lr_scheduler_are_exact,
    resume_from_the_sharded_state_dict,
    full_state_dicts_move_between_world_sizes,
    checkpoint_probe_makes_no_masters,
]


# -- the spawned job ---------------------------------------------------------------------------
def run_rank(rank: int, world: int, port: int, out: str, module: str) -> None:
    """Every scenario of ``module``'s SCENARIOS in turn, in one gloo process group (the
    environment says it as torchrun would, for the trainers)."""
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "NODE_RANK": 0}
    os.environ.update({k: str(v) for k, v in env.items()})
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    results: dict[str, Any] = {}
    for scenario in importlib.import_module(module).SCENARIOS:
        record: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            scenario(rank, world, record)
            record["outcome"] = "ok"
        except (Exception, pytest.fail.Exception):  # a failed pytest.raises is no Exception
            record["outcome"] = traceback.format_exc()
        record["seconds"] = time.perf_counter() - start
        results[scenario.__name__] = record
        dist.barrier()  # a failed scenario leaves no collective behind for the next one
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def spawn(module: str, world: int, out: Path) -> list[dict[str, Any]]:
    mp.spawn(run_rank, args=(world, free_port(), str(out), module), nprocs=world, join=True)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    world = request.param
    return spawn(__name__, world, tmp_path_factory.mktemp(f"fsdp{world}"))


@pytest.mark.parametrize("scenario", [s.__name__ for s in SCENARIOS])
def test_scenario(results: list[dict[str, Any]], scenario: str) -> None:
    for rank, result in enumerate(results):
        outcome = result[scenario]["outcome"]
        assert outcome == "ok", f"rank {rank}:\n{outcome}"
