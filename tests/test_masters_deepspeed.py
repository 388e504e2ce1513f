"""LearnerMasters under DeepSpeed ZeRO 1, 2 and 3: fp32 masters and state only for what learns.

ZeRO is told to keep no fp32 copy (``bf16_master_weights_and_grads`` and
``bf16_optimizer_states``); ``step_learners_only`` hands LearnerMasters each parameter's stretch
of ZeRO's flat bf16 partition, so each rank holds masters and AdamW state only for its share of
the learners. Two spawned gloo ranks (CPU) run every scenario; the reference is one process:
the same bf16 model and plans, each rank's gradient computed apart and averaged, the same
LearnerMasters. The checks are bit for bit.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_deepspeed import BATCH, BLOCKS, DECAY, LR, PLANS, batch, free_port, make_model
from torch import nn

import gradgate as gg

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
    ),
]
WORLD = 2
TIMEOUT = timedelta(seconds=90)
KNOBS = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
ADAMW_BYTES = 12  # fp32 master, exp_avg, exp_avg_sq per element
STEP_BYTES = 4  # AdamW's step count, a float32 scalar per stretch


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x.to(torch.bfloat16)).float().pow(2).mean()


def learner_masters(model: nn.Module, **options: Any) -> gg.optim.LearnerMasters:
    return gg.optim.LearnerMasters(
        torch.optim.AdamW, model.parameters(), lr=LR, weight_decay=DECAY, **options
    )


def bits(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.view(torch.int16) if tensor.element_size() == 2 else tensor


# -- the one-process reference ------------------------------------------------------------------
def average(grads: list[torch.Tensor]) -> torch.Tensor:
    """What ZeRO's reduction of bf16 gradients gives for two ranks: the bf16 sum, halved (exact:
    halving commutes with rounding, so pre- and post-division agree)."""
    total = grads[0].clone()
    for grad in grads[1:]:
        total += grad
    return total / len(grads)


def reference(steps: int, gas: int, order: str, **options: Any) -> tuple[nn.Module, Any, list]:
    """(model, LearnerMasters, per step the names that learned). ``order``: "ranks first" (each
    micro-batch's gradients averaged over the ranks, then summed over the micro-batches, as
    ZeRO 2 and 3 reduce them) or "micro first" (each rank sums its micro-batches, then the
    ranks are averaged, as ZeRO 1)."""
    model = make_model().bfloat16()
    optimizer = learner_masters(model, **options)
    gate = gg.BackpropGate(model, blocks=BLOCKS)
    named = list(model.named_parameters())
    learned = []
    for step in range(steps):
        grads: dict[str, list[list[torch.Tensor]]] = {}  # name -> [micro][rank]
        for m in range(gas):
            micro = step * gas + m
            PLANS[micro % len(PLANS)].apply(gate)
            for rank in range(WORLD):
                model.zero_grad(set_to_none=True)
                (loss_of(model, batch(rank, micro)) / gas).backward()
                for name, param in named:
                    if param.grad is not None:
                        per_micro = grads.setdefault(name, [[] for _ in range(gas)])
                        per_micro[m].append(param.grad.clone())
        model.zero_grad(set_to_none=True)
        for name, param in named:
            if name not in grads:
                continue
            zero = torch.zeros_like(param)
            cells = [row + [zero] * (WORLD - len(row)) for row in grads[name]]
            cells = [row if row else [zero] * WORLD for row in cells]
            if order == "ranks first":
                param.grad = average([average(row) for row in cells]) * gas
            else:
                param.grad = average([average(col) * gas for col in zip(*cells, strict=True)])
        learned.append(set(grads))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    gate.remove()
    return model, optimizer, learned


# -- the DeepSpeed side -------------------------------------------------------------------------
def engine_for(stage: int, gas: int = 1, optimizer: Any = None, **options: Any) -> Any:
    import deepspeed

    model = make_model().bfloat16()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0
        "steps_per_print": 10**9,
        "bf16": KNOBS,
        **options,
    }
    if optimizer is None:
        optimizer = learner_masters(model)
    elif callable(optimizer):
        optimizer = optimizer(model)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def full_params(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}


def local_share(handle: Any) -> dict[int, int]:
    """Per parameter position, the elements of it this rank's stretches hold."""
    found: dict[int, int] = {}
    for segments in handle.segments.values():
        for segment in segments:
            found[segment.index] = found.get(segment.index, 0) + segment.numel
    return found


def full_masters(handle: Any, engine: Any, stage: int) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's master and AdamW state, put together from every rank's stretches."""
    rank = dist.get_rank()
    named = list(engine.module.named_parameters())
    names = {id(p): n for n, p in named}
    sizes = {n: int(p.ds_numel) if stage == 3 else p.numel() for n, p in named}
    keys = ("master", "exp_avg", "exp_avg_sq")
    found = {n: {k: torch.zeros(size) for k in keys} for n, size in sizes.items()}
    for name in found:
        found[name]["step"] = torch.zeros(1)
    for segments in handle.segments.values():
        for segment in segments:
            state = handle.base.state.get(segment.tensor)
            if not state:
                continue
            param = handle.params[segment.index]
            name = names[id(param)]
            if stage == 3:
                offset = rank * int(param.partition_numel())
            else:
                offset = param._hp_mapping.lp_fragment_address.start
            count = min(segment.numel, sizes[name] - offset)
            for key in keys:
                found[name][key][offset : offset + count] = state[key][:count]
            found[name]["step"][0] = float(state["step"])
    for name in sorted(found):  # the same all-reduces in the same order on every rank
        for key, value in found[name].items():
            dist.all_reduce(value, op=dist.ReduceOp.MAX if key == "step" else dist.ReduceOp.SUM)
    return found


def check_bytes(handle: Any, optimizer: Any, stage: int, record: dict[str, Any]) -> None:
    """This rank holds masters and state for its stretches of the learners, and nothing else."""
    share = local_share(handle)
    learners = handle.stepped
    want = sum(ADAMW_BYTES * share.get(i, 0) + STEP_BYTES * (i in share) for i in learners)
    got = optimizer.master_bytes()
    assert got == want, (stage, got, want)
    held = torch.tensor([sum(share.get(i, 0) for i in learners)])
    dist.all_reduce(held)
    total = sum(handle.params[i].ds_numel if stage == 3 else 0 for i in learners)
    if stage == 3:  # every parameter split evenly: each rank's share within padding
        padded = sum(WORLD * int(handle.params[i].partition_numel()) for i in learners)
        assert int(held) == padded and padded - total < WORLD * len(learners)
        mine = sum(share.get(i, 0) for i in learners)
        assert abs(mine - total / WORLD) < len(learners), (mine, total)
    else:  # one flat cut in contiguous pieces: the ranks' shares add up to the learners
        assert int(held) == sum(handle.params[i].numel() for i in learners)
    record.setdefault("bytes", []).append(got)


ORDER = {1: "micro first", 2: "ranks first", 3: "ranks first"}


def run_exact(rank: int, stage: int, gas: int, record: dict[str, Any], **options: Any) -> None:
    import gradgate.integrations.deepspeed as ggds

    steps = 6 if gas == 1 else 3
    want_model, want_opt, learned = reference(steps, gas, ORDER[stage], **options)
    engine = engine_for(stage, gas, functools.partial(learner_masters, **options))
    handle = ggds.step_learners_only(engine)
    gate = gg.BackpropGate(engine.module, blocks=BLOCKS)
    for step in range(steps):
        before = full_params(engine, stage)
        for m in range(gas):
            micro = step * gas + m
            PLANS[micro % len(PLANS)].apply(gate)
            engine.backward(loss_of(engine, batch(rank, micro)))
            engine.step()
        after = full_params(engine, stage)
        for name, value in after.items():
            if name not in learned[step]:
                assert torch.equal(bits(value), bits(before[name])), f"step {step}: {name} moved"
        check_bytes(handle, engine.optimizer.optimizer, stage, record)
    got = full_params(engine, stage)
    for name, param in want_model.named_parameters():
        assert torch.equal(bits(got[name]), bits(param)), name
    masters = full_masters(handle, engine, stage)
    for name, param in want_model.named_parameters():
        state = want_opt.state.get(param)
        if not state:
            assert not float(masters[name]["step"]), name
            continue
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(masters[name][key], state[key].reshape(-1)), (name, key)
        assert float(masters[name]["step"]) == float(state["step"]), name
    gate.remove()
    handle.remove()


def make_exact(stage: int, gas: int = 1, **options: Any) -> Callable[[int, dict[str, Any]], None]:
    def scenario(rank: int, record: dict[str, Any]) -> None:
        run_exact(rank, stage, gas, record, **options)

    extra = "_offload_cpu" if options.get("offload") else ""
    scenario.__name__ = f"exact_stage{stage}_gas{gas}{extra}"
    return scenario


SCENARIOS: list[Callable[[int, dict[str, Any]], None]] = [
    *[make_exact(stage) for stage in (1, 2, 3)],
    *[make_exact(stage, gas=2) for stage in (1, 2, 3)],
    make_exact(3, offload="cpu"),
]


def run_rank(rank: int, port: int, out: str) -> None:
    import logging
    import warnings

    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GRADGATE_TEST_OUT=out,
    )
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed collectives
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {}  # no op probing nor the CPU shm all-reduce build
    deepspeed.utils.logger.setLevel(logging.WARNING)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=TIMEOUT)
    deepspeed.init_distributed(dist_backend="gloo", timeout=TIMEOUT)
    results: dict[str, Any] = {}
    wanted = os.environ.get("GRADGATE_SCENARIOS", "")
    for scenario in SCENARIOS:
        if wanted and scenario.__name__ not in wanted.split(","):
            continue
        record: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            scenario(rank, record)
            record["outcome"] = "ok"
        except (Exception, pytest.fail.Exception):
            record["outcome"] = traceback.format_exc()
        record["seconds"] = time.perf_counter() - start
        results[scenario.__name__] = record
        dist.barrier()
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("masters_deepspeed")
    mp.spawn(run_rank, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("scenario", [s.__name__ for s in SCENARIOS])
def test_scenario(results: list[dict[str, Any]], scenario: str) -> None:
    for rank, result in enumerate(results):
        if scenario not in result:
            pytest.skip("left out by GRADGATE_SCENARIOS")
        outcome = result[scenario]["outcome"]
        assert outcome == "ok", f"rank {rank}:\n{outcome}"
