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
from test_deepspeed import (
    BATCH,
    BLOCKS,
    DECAY,
    LR,
    PLANS,
    batch,
    free_port,
    hold_frozen,
    make_model,
    release,
)
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


def learner_masters(
    model: nn.Module, groups: bool = False, **options: Any
) -> gg.optim.LearnerMasters:
    """LearnerMasters(AdamW); ``groups``: weights decayed, biases not, in two groups (as the
    HF Trainer makes them), which ZeRO steps one at a time."""
    params: Any = model.parameters()
    if groups:
        named = list(model.named_parameters())
        params = [
            {"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
        ]
    return gg.optim.LearnerMasters(torch.optim.AdamW, params, lr=LR, weight_decay=DECAY, **options)


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


def reference(
    steps: int,
    gas: int,
    order: str,
    edit: dict[int, Callable[[nn.Module], None]] | None = None,
    **options: Any,
) -> tuple[nn.Module, Any, list]:
    """(model, LearnerMasters, per step the names that learned). ``order``: "ranks first" (each
    micro-batch's gradients averaged over the ranks, then summed over the micro-batches, as
    ZeRO 2 and 3 reduce them) or "micro first" (each rank sums its micro-batches, then the
    ranks are averaged, as ZeRO 1). ``edit[step](model)`` runs before that step."""
    model = make_model().bfloat16()
    optimizer = learner_masters(model, **options)
    gate = gg.BackpropGate(model, blocks=BLOCKS)
    named = list(model.named_parameters())
    learned = []
    for step in range(steps):
        if edit and step in edit:
            edit[step](model)
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
def engine_for(
    stage: int, gas: int = 1, optimizer: Any = None, checkpointed: bool = False, **options: Any
) -> Any:
    import deepspeed

    model = make_model(checkpointed).bfloat16()
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
    """Every parameter's full value (the engine's module, or a module)."""
    import deepspeed

    params = dict(getattr(engine, "module", engine).named_parameters())
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


def run_exact(
    rank: int,
    stage: int,
    gas: int,
    record: dict[str, Any],
    checkpointed: bool = False,
    **options: Any,
) -> None:
    import gradgate.integrations.deepspeed as ggds

    steps = 6 if gas == 1 else 3
    config = {k: options.pop(k) for k in list(options) if k == "zero_optimization"}
    want_model, want_opt, learned = reference(steps, gas, ORDER[stage], **options)
    optimizer = functools.partial(learner_masters, **options)
    engine = engine_for(stage, gas, optimizer, checkpointed, **config)
    handle = ggds.step_learners_only(engine)
    gate = gg.BackpropGate(engine.module, blocks=BLOCKS)
    for step in range(steps):
        before = full_params(engine, stage)
        for m in range(gas):
            micro = step * gas + m
            plan = PLANS[micro % len(PLANS)]
            plan.apply(gate)
            # non-reentrant recomputation needs the flags of the forward (GateCallback's hold)
            held = hold_frozen(engine.module, plan) if checkpointed else []
            engine.backward(loss_of(engine, batch(rank, micro)))
            release(held)
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


def make_exact(
    stage: int, gas: int = 1, checkpointed: bool = False, **options: Any
) -> Callable[[int, dict[str, Any]], None]:
    def scenario(rank: int, record: dict[str, Any]) -> None:
        run_exact(rank, stage, gas, record, checkpointed, **options)

    extra = "_offload_cpu" if options.get("offload") else ""
    extra += "_checkpointed" if checkpointed else ""
    extra += "_two_groups" if options.get("groups") else ""
    extra += "_sub_groups" if "zero_optimization" in options else ""
    scenario.__name__ = f"exact_stage{stage}_gas{gas}{extra}"
    return scenario


def run_plans(engine: Any, rank: int, micros: range) -> None:
    gate = gg.BackpropGate(engine.module, blocks=BLOCKS)
    for micro in micros:
        PLANS[micro % len(PLANS)].apply(gate)
        engine.backward(loss_of(engine, batch(rank, micro)))
        engine.step()
    gate.remove()


def checkpoint_resumes_bit_for_bit(rank: int, record: dict[str, Any]) -> None:
    """save_checkpoint / load_checkpoint: masters and moments come back, the run goes on with
    the same bits as the run that was not stopped (the loaded partitions equal the masters
    rounded, so no master is remade)."""
    import gradgate.integrations.deepspeed as ggds

    folder = str(Path(os.environ["GRADGATE_TEST_OUT"]) / "checkpoints")
    for stage in (1, 2, 3):
        engine = engine_for(stage)
        handle = ggds.step_learners_only(engine)
        run_plans(engine, rank, range(3))
        engine.save_checkpoint(folder, tag=f"stage{stage}")
        run_plans(engine, rank, range(3, 7))
        want, want_masters = full_params(engine, stage), full_masters(handle, engine, stage)
        handle.remove()
        resumed = engine_for(stage)
        handle = ggds.step_learners_only(resumed)
        resumed.load_checkpoint(folder, tag=f"stage{stage}")
        run_plans(resumed, rank, range(3, 7))
        got, got_masters = full_params(resumed, stage), full_masters(handle, resumed, stage)
        handle.remove()
        for name, value in want.items():
            assert torch.equal(bits(got[name]), bits(value)), (stage, name)
            for key, tensor in want_masters[name].items():
                assert torch.equal(got_masters[name][key], tensor), (stage, name, key)


def written_partitions_get_new_masters(rank: int, record: dict[str, Any]) -> None:
    """A parameter set through DeepSpeed between steps (ZeRO-3's GatheredParameters) is the
    truth: its master is remade from the new value, as LearnerMasters does in one process for a
    parameter written from outside; the other masters are kept. Bit for bit."""
    import deepspeed

    import gradgate.integrations.deepspeed as ggds

    def write(model: nn.Module) -> None:
        with torch.no_grad():
            model[-1].weight.fill_(0.5)

    want_model, want_opt, _ = reference(2, 1, ORDER[3], edit={1: write})
    engine = engine_for(3)
    handle = ggds.step_learners_only(engine)
    run_plans(engine, rank, range(1))
    head = engine.module[-1].weight
    with deepspeed.zero.GatheredParameters([head], modifier_rank=0):
        if rank == 0:
            write(engine.module)
    run_plans(engine, rank, range(1, 2))
    got, masters = full_params(engine, 3), full_masters(handle, engine, 3)
    for name, param in want_model.named_parameters():
        assert torch.equal(bits(got[name]), bits(param)), name
        state = want_opt.state.get(param)
        if state:
            assert torch.equal(masters[name]["master"], state["master"].reshape(-1)), name
    handle.remove()


def remove_gives_back_what_it_changed(rank: int, record: dict[str, Any]) -> None:
    """remove(): the masters go (LearnerMasters stepped only the stretches), ZeRO-3's copy of
    its partitions gets its own memory back, and LearnerMasters refuses ZeRO's flat partitions
    again with the line to add."""
    import gradgate.integrations.deepspeed as ggds

    for stage in (1, 3):
        engine = engine_for(stage)
        outer = engine.optimizer
        copies = outer.fp32_partitioned_groups_flat if stage == 3 else []
        partitions = outer.fp16_partitioned_groups_flat if stage == 3 else []
        assert all(c.data_ptr() != p.data_ptr() for c, p in zip(copies, partitions, strict=True))
        handle = ggds.step_learners_only(engine)
        assert all(c.data_ptr() == p.data_ptr() for c, p in zip(copies, partitions, strict=True))
        run_plans(engine, rank, range(1, 2))
        optimizer = outer.optimizer
        total = torch.tensor([optimizer.master_bytes()])
        dist.all_reduce(total)
        assert int(total) > 0
        handle.remove()
        assert not any(optimizer.state.values()) and optimizer.master_bytes() == 0
        for copy, partition in zip(copies, partitions, strict=True):
            assert copy.data_ptr() != partition.data_ptr() and torch.equal(copy, partition)
        engine.backward(loss_of(engine, batch(rank, 0)))
        with pytest.raises(gg.InvalidOptionError, match=r"step_learners_only\(engine\) after"):
            engine.step()


def refuses_with_the_reason_and_what_works(rank: int, record: dict[str, Any]) -> None:
    import gradgate.integrations.deepspeed as ggds

    for stage in (1, 2, 3):  # bf16 without DeepSpeed's two options: fp32 masters of everything
        engine = engine_for(stage, bf16={"enabled": True})
        wanted = rf"stage {stage}: ZeRO keeps a torch.float32 master.*bf16_master_weights_and_grads"
        with pytest.raises(gg.InvalidOptionError, match=wanted):
            ggds.step_learners_only(engine)
    offload = {"stage": 3, "offload_param": {"device": "cpu"}}
    offloaded = engine_for(3, zero_optimization=offload)
    with pytest.raises(gg.InvalidOptionError, match=r"offload_param.*saves nothing"):
        ggds.step_learners_only(offloaded)
    fp32_accumulation = engine_for(
        1, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}
    )
    with pytest.raises(gg.InvalidOptionError, match=r"BF16_Optimizer.*leave grad_accum_dtype out"):
        ggds.step_learners_only(fp32_accumulation)
    forgotten = engine_for(2)  # the options set, the handle not: the step asks for it
    forgotten.backward(loss_of(forgotten, batch(rank, 0)))
    with pytest.raises(gg.InvalidOptionError, match=r"DeepSpeed ZeRO replaces the groups"):
        forgotten.step()


def float32_models_need_no_options(rank: int, record: dict[str, Any]) -> None:
    """A float32 model: ZeRO's partitions are the weights (ZeRO-3 shares them), LearnerMasters
    steps them in place, with state only for what learned."""
    import deepspeed

    import gradgate.integrations.deepspeed as ggds

    for stage in (0, 2, 3):
        model = make_model()
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,
            "steps_per_print": 10**9,
        }
        engine = deepspeed.initialize(model=model, optimizer=learner_masters(model), config=config)[
            0
        ]
        handle = ggds.step_learners_only(engine)
        gate = gg.BackpropGate(engine.module, blocks=BLOCKS, depth=1)
        before = full_params(engine, stage)
        engine.backward(engine(batch(rank, 0)).pow(2).mean())
        engine.step()
        after = full_params(engine, stage)
        moved = {name for name in after if not torch.equal(after[name], before[name])}
        assert moved == {"5.linear.weight", "5.linear.bias", "6.weight", "6.bias"}, (stage, moved)
        optimizer = handle.base
        assert all("master" not in entry for entry in optimizer.state.values())
        gate.remove()
        handle.remove()


def hf_trainer_zero3_holds_masters_for_the_block_that_learns(
    rank: int, record: dict[str, Any]
) -> None:
    """TrainingArguments(deepspeed=config) with ZeRO-3, LearnerMasters and its scheduler passed
    in ``optimizers`` (GateCallback keeps them: transformers would build its own under
    DeepSpeed) and GateCallback driving BAdam: each step moves exactly the block BAdam picked,
    and each rank holds masters for its share of that block only."""
    import transformers
    from models import tiny_gpt2, trainer_args

    from gradgate.integrations.transformers import GateCallback

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class Watch(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
            self.before = full_params(model, 3)

        def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
            after = full_params(model, 3)
            moved.append({n.split(".")[2] for n in after if n.startswith("transformer.h.")
                          and not torch.equal(bits(after[n]), bits(self.before[n]))})  # fmt: skip
            plans.append({str(i) for i in callback.plan.learning(4)})
            rates.append(optimizer.param_groups[0]["lr"])
            check_bytes(callback._deepspeed, optimizer, 3, record)

    moved: list[set[str]] = []
    plans: list[set[str]] = []
    callback = GateCallback(gg.schedules.BAdam(4, 1, order="descending"))
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3},
        "bf16": KNOBS,
    }
    args = trainer_args(
        Path(os.environ["GRADGATE_TEST_OUT"]) / "hf",
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        bf16=True,
        deepspeed=config,
    )
    # built after the arguments, under DeepSpeed's zero.Init: each rank holds its partitions only
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_gpt2(4).config, dtype=torch.bfloat16)
    assert int(model.transformer.h[0].mlp.c_fc.weight.ds_numel) == 16 * 64
    gg.freeze(model, "transformer.wte")  # tied to the head: BAdam leaves them
    optimizer = learner_masters(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    rates: list[float] = []
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        optimizers=(optimizer, scheduler),
        callbacks=[callback, Watch()],
    )
    trainer.train()
    assert moved == plans and len({frozenset(p) for p in plans}) == 4, (moved, plans)
    assert rates == [LR * (1 / (1 + step)) for step in range(1, 5)], rates  # the given one
    assert callback._deepspeed is None  # removed when training ended


SCENARIOS: list[Callable[[int, dict[str, Any]], None]] = [
    refuses_with_the_reason_and_what_works,
    remove_gives_back_what_it_changed,
    checkpoint_resumes_bit_for_bit,
    written_partitions_get_new_masters,
    float32_models_need_no_options,
    hf_trainer_zero3_holds_masters_for_the_block_that_learns,
    *[make_exact(stage) for stage in (1, 2, 3)],
    *[make_exact(stage, gas=2) for stage in (1, 2, 3)],
    make_exact(3, offload="cpu"),
    make_exact(3, checkpointed=True),
    make_exact(1, groups=True),
    make_exact(3, groups=True, zero_optimization={"stage": 3, "sub_group_size": 100}),
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
