"""DeepSpeed ZeRO 0-3 with a plan that changes every step, on 1 and 2 gloo processes (CPU).

Each spawned job runs every scenario in turn (starting processes costs seconds) and records
"ok" or the failure's traceback; the tests read that record. The reference is plain torch in
one process: the same model and plans, the loss averaged over the ranks' batches (as ZeRO
averages gradients), ``torch.optim.AdamW`` stepping only what has a gradient (non-learners
keep ``.grad = None``). DeepSpeed keeps float32 master copies whatever the model's dtype, so
both run in float32 and agree to float32 rounding; a parameter that did not learn in a step
must be bit-identical.
"""

from __future__ import annotations

import importlib.util
import os
import socket
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
from torch import nn

import gradgate as gg
from gradgate.schedules import Plan

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NO_DEEPSPEED = "deepspeed is not installed (pip install gradgate[deepspeed])"

TIMEOUT = timedelta(seconds=60)  # a rank that never arrives fails the job instead of hanging
N, WIDTH, BATCH = 5, 6, 3
BLOCKS = [str(i) for i in range(1, N + 1)]  # 0 is the embedding, N + 1 the head
LR, DECAY = 0.05, 0.1
# float32 rounding (DeepSpeed averages and flattens in another order)
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
PLANS = [  # one per micro-batch; every kind of plan and every schedule
    Plan(depth=None),
    Plan(depth=2),
    Plan(learn=frozenset({0, 3})),
    gg.schedules.LISA(N, k=2, every=1, seed=3).plan(3),
    gg.schedules.DropBP(N, rate=0.5, seed=1).plan(4),
    Plan(depth=0),
    gg.schedules.RandomDepth(N, seed=2).plan(6),
    Plan(learn=frozenset({1, "0"})),
    gg.schedules.GradualUnfreeze(N, every=2).plan(2),
    gg.schedules.FreezeOut(N, total_steps=12).plan(9),
]


class Residual(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.checkpointed = checkpointed

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return x + torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return x + self.inner(x)


def make_model(checkpointed: bool = False) -> nn.Module:
    torch.manual_seed(0)
    blocks = [Residual(checkpointed) for _ in range(N)]
    model = nn.Sequential(nn.Linear(3, WIDTH), *blocks, nn.Linear(WIDTH, 1))
    return model


def batch(rank: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * micro + rank)
    return torch.randn(BATCH, 3, generator=generator)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def reference(
    steps: int, gas: int, world: int, clip: float, keep_state: bool = True
) -> tuple[nn.Module, Any, list]:
    """Plain torch: (model, optimizer, per step the names of the parameters that learned)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    gate = gg.BackpropGate(model, blocks=BLOCKS)
    learned = []
    for step in range(steps):
        for m in range(gas):
            micro = step * gas + m
            PLANS[micro % len(PLANS)].apply(gate)
            loss = sum(loss_of(model, batch(r, micro)) for r in range(world)) / (world * gas)
            loss.backward()
        learned.append({n for n, p in model.named_parameters() if p.grad is not None})
        if clip:
            torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.grad is not None], clip
            )
        optimizer.step()
        if not keep_state:  # BAdam: what does not learn now keeps no state
            for param in model.parameters():
                if param.grad is None:
                    optimizer.state.pop(param, None)
        optimizer.zero_grad(set_to_none=True)
    gate.remove()
    return model, optimizer, learned


# -- DeepSpeed side ---------------------------------------------------------------------------
def engine_for(
    model: nn.Module,
    stage: int,
    gas: int,
    clip: float = 0.0,
    optimizer: torch.optim.Optimizer | None = None,
    **options: Any,
) -> Any:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        **options,
    }
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def full_params(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}


def full_state(handle: Any, engine: Any, stage: int) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's optimizer state, put together from every rank's stretches."""
    named = list(engine.module.named_parameters())
    if stage == 0:
        return {n: handle.base.state.get(p, {}) for n, p in named}
    rank = dist.get_rank()
    names = {id(p): n for n, p in named}
    sizes = {n: int(p.ds_numel) if stage == 3 else p.numel() for n, p in named}
    found = {
        n: {
            "exp_avg": torch.zeros(size, dtype=torch.float32),
            "exp_avg_sq": torch.zeros(size, dtype=torch.float32),
            "step": torch.zeros(1, dtype=torch.float32),
        }
        for n, size in sizes.items()
    }
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
            for key in ("exp_avg", "exp_avg_sq"):
                found[name][key][offset : offset + count] = state[key][:count]
            found[name]["step"][0] = float(state["step"])
    for name in sorted(found):  # the same all-reduces in the same order on every rank
        for key, value in found[name].items():
            dist.all_reduce(value, op=dist.ReduceOp.MAX if key == "step" else dist.ReduceOp.SUM)
    return found


def compare_state(found: dict[str, Any], optimizer: Any, model: nn.Module) -> None:
    for name, param in model.named_parameters():
        want, got = optimizer.state.get(param, {}), found[name]
        if not want:
            assert not got or not float(got["step"]), f"{name}: state in DeepSpeed, none in torch"
            continue
        assert float(got["step"]) == float(want["step"]), (name, got["step"], want["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                got[key].reshape(-1), want[key].reshape(-1), **TOLERANCE, msg=name
            )


def run_exact(
    rank: int, stage: int, gas: int, checkpointed: bool, clip: float, keep_state: bool = True
) -> None:
    import gradgate.integrations.deepspeed as ggds

    world = dist.get_world_size()
    steps = 6 if gas == 1 else 3
    expected_model, expected_optimizer, learned = reference(steps, gas, world, clip, keep_state)
    engine = engine_for(make_model(checkpointed), stage, gas, clip)
    handle = ggds.step_learners_only(engine, keep_state=keep_state)
    gate = gg.BackpropGate(engine.module, blocks=BLOCKS)
    held: list[nn.Parameter] = []
    for step in range(steps):
        before = full_params(engine, stage)
        for m in range(gas):
            micro = step * gas + m
            plan = PLANS[micro % len(PLANS)]
            plan.apply(gate)
            if checkpointed and gas == 1:  # non-reentrant recomputation needs the flags of
                held = hold_frozen(engine.module, plan)  # the forward for the whole step
            engine.backward(loss_of(engine, batch(rank, micro)))
            release(held)
            engine.step()
        after = full_params(engine, stage)
        for name, value in after.items():
            if name not in learned[step]:
                assert torch.equal(value, before[name]), f"step {step}: {name} moved"
    got = full_params(engine, stage)
    for name, param in expected_model.named_parameters():
        torch.testing.assert_close(
            got[name], param.detach(), **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}"
        )
    compare_state(full_state(handle, engine, stage), expected_optimizer, expected_model)
    gate.remove()
    handle.remove()


def hold_frozen(model: nn.Module, plan: Plan) -> list[nn.Parameter]:
    """Freeze the blocks that do not learn for the whole step (what GateCallback does)."""
    learning = plan.learning(N)
    held = []
    for position, name in enumerate(BLOCKS):
        if position not in learning:
            for param in model.get_submodule(name).parameters():
                param.requires_grad_(False)
                held.append(param)
    return held


def release(held: list[nn.Parameter]) -> None:
    for param in held:
        param.requires_grad_(True)
    held.clear()


# -- scenarios ------------------------------------------------------------------------------------
FORGOTTEN = r"gg\.integrations\.deepspeed\.step_learners_only\(engine\)"


def plain_deepspeed_moves_blocks_that_did_not_learn(rank: int, record: dict[str, Any]) -> None:
    """Why the integration exists: without it ZeRO steps the zeros of the cut blocks."""
    moved = {}
    for stage in (1, 2, 3):
        engine = engine_for(make_model(), stage, gas=1)
        gate = gg.BackpropGate(engine.module, blocks=BLOCKS)
        engine.backward(loss_of(engine, batch(rank, 0)))
        engine.step()
        gate.depth = 1
        before = full_params(engine, stage)["1.linear.weight"]
        engine.backward(loss_of(engine, batch(rank, 1)))
        with pytest.warns(gg.GradgateWarning, match=FORGOTTEN):  # the missing line, asked for
            engine.step()
        moved[stage] = float((full_params(engine, stage)["1.linear.weight"] - before).abs().max())
        gate.remove()
    record["moved"] = moved
    assert all(value > 0 for value in moved.values()), moved


def forgetting_step_learners_only_warns_with_the_line_to_add(
    rank: int, record: dict[str, Any]
) -> None:
    """A gate on a ZeRO engine with no step_learners_only: the first step whose plan leaves a
    block out warns, with the line to add, before the step (raised as an error, nothing moves).
    Once added, or with no block left out, nothing is said; stage 0 (a torch optimizer holding
    the model's own parameters) needs no handle: no block that did not learn moves."""
    import warnings

    import gradgate.integrations.deepspeed as ggds

    said: dict[int, list[str]] = {}
    for stage in (0, 1, 2, 3):
        engine = engine_for(make_model(), stage, gas=1)
        gate = gg.BackpropGate(engine.module, blocks=BLOCKS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.backward(loss_of(engine, batch(rank, 0)))
            engine.step()  # every block learned: nothing to say
            gate.depth = 2
            before = full_params(engine, stage)
            for micro in (1, 2):  # warned once per optimizer; the steps go ahead, as DeepSpeed's
                engine.backward(loss_of(engine, batch(rank, micro)))
                engine.step()
        said[stage] = [str(w.message) for w in caught if issubclass(w.category, gg.GradgateWarning)]
        moved = full_params(engine, stage)["1.linear.weight"] - before["1.linear.weight"]
        assert bool(moved.abs().max() > 0) == (stage > 0), stage  # what the warning is about
        gate.remove()
        if stage:  # raised as an error (-W error): before ZeRO's step moved anything
            engine = engine_for(make_model(), stage, gas=1)
            gate = gg.BackpropGate(engine.module, blocks=BLOCKS, depth=2)
            before = full_params(engine, stage)
            engine.backward(loss_of(engine, batch(rank, 0)))
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with pytest.raises(gg.GradgateWarning, match=FORGOTTEN):
                    engine.step()
            after = full_params(engine, stage)
            assert all(torch.equal(after[name], value) for name, value in before.items())
            gate.remove()
    record["said"] = said
    assert said[0] == [] and all(len(said[stage]) == 1 for stage in (1, 2, 3)), said
    assert "ZeRO stage 3" in said[3][0] and "ZeRO stage 1 or 2" in said[1][0]
    for stage in (1, 3):  # with the handle: nothing to say, and the cut blocks stay put
        engine = engine_for(make_model(), stage, gas=1)
        handle = ggds.step_learners_only(engine)
        gate = gg.BackpropGate(engine.module, blocks=BLOCKS, depth=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error", gg.GradgateWarning)
            engine.backward(loss_of(engine, batch(rank, 0)))
            engine.step()
        gate.remove()
        handle.remove()


def refuses_what_it_cannot_make_exact(rank: int, record: dict[str, Any]) -> None:
    import gradgate.integrations.deepspeed as ggds

    bf16 = engine_for(make_model(), 0, 1, bf16={"enabled": True})
    with pytest.raises(gg.InvalidOptionError, match=r"ZeRO stage 0 with fp16 or bf16.*stage to 1"):
        ggds.step_learners_only(bf16)
    model = make_model()
    adagrad = engine_for(model, 1, 1, optimizer=torch.optim.Adagrad(model.parameters()))
    with pytest.raises(gg.InvalidOptionError, match=r"ZeRO stage 1 with Adagrad"):
        ggds.step_learners_only(adagrad)
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    offloaded = engine_for(
        make_model(), 2, 1, zero_optimization=offload, zero_force_ds_cpu_optimizer=False
    )
    with pytest.raises(gg.InvalidOptionError, match=r"ZeRO stage 2 with offload_optimizer"):
        ggds.step_learners_only(offloaded)
    engine = engine_for(make_model(), 2, 1)
    handle = ggds.step_learners_only(engine)
    with pytest.raises(gg.InvalidOptionError, match="already active"):
        ggds.step_learners_only(engine.optimizer)
    with pytest.raises(gg.InvalidOptionError, match=r"what deepspeed\.initialize returned"):
        ggds.step_learners_only(make_model())
    handle.remove()
    ggds.step_learners_only(engine).remove()  # a fresh handle once the first is removed


def remove_gives_deepspeed_its_step_and_the_state_back(rank: int, record: dict[str, Any]) -> None:
    import gradgate.integrations.deepspeed as ggds

    for stage in (1, 3):
        engine = engine_for(make_model(), stage, 1)
        handle = ggds.step_learners_only(engine)
        gate = gg.BackpropGate(engine.module, blocks=BLOCKS, depth=1)
        engine.backward(loss_of(engine, batch(rank, 0)))
        engine.step()
        pieces = {
            segment.tensor: handle.base.state[segment.tensor]["exp_avg"].clone()
            for segments in handle.segments.values()
            for segment in segments
            if segment.tensor in handle.base.state
        }
        count = torch.tensor([len(pieces)])
        dist.all_reduce(count)  # the last block and the head, on whichever ranks hold them
        assert int(count) > 0
        handle.remove()
        assert "step" not in vars(engine.optimizer) and "step" not in vars(handle.base)
        for flat_id, segments in handle.segments.items():
            flat_state = handle.base.state.get(handle.flats[flat_id], {})
            if not any(segment.tensor in pieces for segment in segments):
                assert "exp_avg" not in flat_state  # nothing learned here: made at first step
                continue
            for segment in segments:
                piece = flat_state["exp_avg"].narrow(0, segment.start, segment.numel)
                want = pieces.get(segment.tensor, torch.zeros(segment.numel))
                assert torch.equal(piece, want)
        before = full_params(engine, stage)["1.linear.weight"]
        engine.backward(loss_of(engine, batch(rank, 1)))
        engine.step()  # DeepSpeed's own step again: the cut block moves (weight decay)
        assert not torch.equal(full_params(engine, stage)["1.linear.weight"], before)
        gate.remove()


def checkpoint_keeps_each_stretch_state(rank: int, record: dict[str, Any]) -> None:
    """save_checkpoint / load_checkpoint with the handle active: the run goes on identically."""
    import gradgate.integrations.deepspeed as ggds

    folder = str(Path(os.environ["GRADGATE_TEST_OUT"]) / "checkpoints")

    def run(engine: Any, micros: range) -> None:
        gate = gg.BackpropGate(engine.module, blocks=BLOCKS)
        for micro in micros:
            PLANS[micro % len(PLANS)].apply(gate)
            engine.backward(loss_of(engine, batch(rank, micro)))
            engine.step()
        gate.remove()

    for stage in (2, 3):
        engine = engine_for(make_model(), stage, 1)
        handle = ggds.step_learners_only(engine)
        run(engine, range(4))
        engine.save_checkpoint(folder, tag=f"stage{stage}")
        run(engine, range(4, 8))
        want, want_state = full_params(engine, stage), full_state(handle, engine, stage)
        handle.remove()
        resumed = engine_for(make_model(), stage, 1)
        handle = ggds.step_learners_only(resumed)
        resumed.load_checkpoint(folder, tag=f"stage{stage}")
        run(resumed, range(4, 8))
        got, got_state = full_params(resumed, stage), full_state(handle, resumed, stage)
        handle.remove()
        for name, value in want.items():
            assert torch.equal(got[name], value), (stage, name)
            for key, tensor in want_state[name].items():
                assert torch.equal(got_state[name][key], tensor), (stage, name, key)


def hf_trainer_with_deepspeed_steps_only_learners(rank: int, record: dict[str, Any]) -> None:
    """GateCallback under TrainingArguments(deepspeed=...): a block moves in a step exactly
    when the plan says it learns (plain ZeRO moves them all: weight decay, momentum)."""
    if dist.get_world_size() > 1:
        return  # one process is enough for the hook-up; the 2-rank exactness is above
    import transformers
    from models import tiny_gpt2, trainer_args

    from gradgate.integrations.transformers import GateCallback

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class Moved(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
            self.before = [[p.detach().clone() for p in b.parameters()] for b in blocks]

        def on_step_end(self, args, state, control, **kwargs) -> None:
            moved.append(
                {
                    i
                    for i, (block, before) in enumerate(zip(blocks, self.before, strict=True))
                    if not all(map(torch.equal, block.parameters(), before))
                }
            )
            plans.append(callback.plan.learning(4))

    model = tiny_gpt2(4)
    blocks = [model.get_submodule(name) for name in gg.blocks(model)]
    moved: list[set[int]] = []
    plans: list[frozenset[int]] = []
    callback = GateCallback(gg.schedules.LISA(4, k=1, every=1, seed=0))
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
    }
    args = trainer_args(
        Path(os.environ["GRADGATE_TEST_OUT"]) / "hf",
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        weight_decay=0.1,
        deepspeed=config,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[callback, Moved()]
    )
    trainer.train()
    assert moved == [set(plan) for plan in plans] and len(set(map(frozenset, moved))) > 1
    assert callback._deepspeed is None  # removed when training ended
    record["moved"] = moved


def bf16_moves_exactly_what_learned(rank: int, record: dict[str, Any]) -> None:
    """With bf16 (fp32 master copies, bf16 parameters) a parameter changes in a step exactly
    when it learned in the float32 reference."""
    import gradgate.integrations.deepspeed as ggds

    _, _, learned = reference(6, 1, dist.get_world_size(), 0.0)
    for stage in (1, 2, 3):
        engine = engine_for(make_model(), stage, 1, bf16={"enabled": True})
        handle = ggds.step_learners_only(engine)
        gate = gg.BackpropGate(engine.module, blocks=BLOCKS)
        names = [name for name, _ in engine.module.named_parameters()]
        for micro in range(6):
            PLANS[micro].apply(gate)
            before = full_params(engine, stage)
            x = batch(rank, micro).to(torch.bfloat16)
            engine.backward(loss_of(engine, x).float())
            engine.step()
            after = full_params(engine, stage)
            moved = {name for name in after if not torch.equal(after[name], before[name])}
            assert moved == learned[micro], (stage, micro, moved ^ learned[micro])
            assert {names[i] for i in handle.stepped} == learned[micro]
        gate.remove()
        handle.remove()


def make_exact(
    stage: int,
    gas: int = 1,
    checkpointed: bool = False,
    clip: float = 0.0,
    keep_state: bool = True,
):
    def scenario(rank: int, record: dict[str, Any]) -> None:
        run_exact(rank, stage, gas, checkpointed, clip, keep_state)

    scenario.__name__ = (
        f"stage{stage}_gas{gas}"
        + ("_checkpointed" if checkpointed else "")
        + ("_clipped" if clip else "")
        + ("" if keep_state else "_state_of_learners_only")
    )
    return scenario


SCENARIOS: list[Callable[[int, dict[str, Any]], None]] = [
    plain_deepspeed_moves_blocks_that_did_not_learn,
    forgetting_step_learners_only_warns_with_the_line_to_add,
    refuses_what_it_cannot_make_exact,
    remove_gives_deepspeed_its_step_and_the_state_back,
    checkpoint_keeps_each_stretch_state,
    bf16_moves_exactly_what_learned,
    hf_trainer_with_deepspeed_steps_only_learners,
    *[make_exact(stage) for stage in (0, 1, 2, 3)],
    *[make_exact(stage, gas=2) for stage in (1, 2, 3)],
    *[make_exact(stage, checkpointed=True) for stage in (2, 3)],
    *[make_exact(stage, clip=0.05) for stage in (1, 2, 3)],
    *[make_exact(stage, keep_state=False) for stage in (0, 1, 3)],
]


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    import logging
    import warnings

    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
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
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    deepspeed.init_distributed(dist_backend="gloo", timeout=TIMEOUT)
    results: dict[str, Any] = {}
    for scenario in SCENARIOS:
        if os.environ.get("GRADGATE_SHOW_DISTRIBUTED"):
            print(f"rank {rank}: {scenario.__name__}", flush=True)
        record: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            scenario(rank, record)
            record["outcome"] = "ok"
        except (Exception, pytest.fail.Exception):
            record["outcome"] = traceback.format_exc()
            if os.environ.get("GRADGATE_SHOW_DISTRIBUTED"):
                print(f"rank {rank}: {record['outcome']}", flush=True)
        record["seconds"] = time.perf_counter() - start
        results[scenario.__name__] = record
        dist.barrier()
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list:
    if not HAS_DEEPSPEED:
        pytest.skip(NO_DEEPSPEED)
    world = request.param
    out = tmp_path_factory.mktemp(f"ranks{world}")
    mp.spawn(run_rank, args=(world, free_port(), str(out)), nprocs=world, join=True)
    loaded = [torch.load(out / f"rank{rank}.pt") for rank in range(world)]
    if os.environ.get("GRADGATE_SHOW_DISTRIBUTED"):
        print({k: (v["seconds"], v.get("moved")) for k, v in loaded[0].items()})
    return loaded


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s.__name__ for s in SCENARIOS])
def test_scenario(results: list[dict[str, Any]], scenario: str) -> None:
    for rank, result in enumerate(results):
        outcome = result[scenario]["outcome"]
        assert outcome == "ok", f"rank {rank}:\n{outcome}"


def test_skipped_block_passes_around_arguments_a_later_hook_replaced() -> None:
    """ZeRO-3 wraps each module's inputs in a forward pre-hook registered before the gate's,
    which runs after it (the gate's is prepended), so under the skipped block's no-grad: the
    gradient must pass around through the arguments the gate saw."""
    model, reference = make_model(), make_model()
    for module in model.modules():
        module.register_forward_pre_hook(lambda module, args: tuple(a * 1 for a in args))
    x = batch(0, 0)
    with gg.BackpropGate(model, blocks=BLOCKS) as gate:
        gate.skip = {2}
        loss_of(model, x).backward()
    with gg.BackpropGate(reference, blocks=BLOCKS) as gate:
        gate.skip = {2}
        loss_of(reference, x).backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (got.grad is None) == (want.grad is None), name
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, msg=name)
    assert model[1].linear.weight.grad is not None  # before the skipped block: it learns


def test_importing_gradgate_integrations_does_not_import_deepspeed() -> None:
    import subprocess
    import sys

    code = (
        "import sys, gradgate, gradgate.integrations.deepspeed as d; "
        "print('deepspeed' in sys.modules, d.step_learners_only.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "step_learners_only"]


def test_bench_table_has_a_line_per_stage_and_depth() -> None:
    from gradgate._bench.sections.deepspeed import table

    row = {
        "stage": 3,
        "depth": None,
        "ZeRO_state_bytes": 800,
        "step_learners_only_state_bytes": 100,
        "state_ratio": 0.125,
        "state_ratio_all_ranks": 0.125,
        "ZeRO_bytes": 5000,
        "step_learners_only_bytes": 5000,
        "step_learners_only_agreement_bytes": 52,
    }
    text = table(
        {"world_size": 2, "backend": "gloo", "blocks": 8, "width": 4, "steps": 1, "rows": [row]}
    )
    assert text.splitlines()[-1].split() == [
        "3",
        "full",
        "800",
        "100",
        "0.125",
        "0.125",
        "5,000",
        "5,000",
        "52",
    ]


def test_learner_masters_refuses_fp16_weights_with_the_bf16_options() -> None:
    """fp16 cannot run on DeepSpeed's CPU accelerator: the check, on what ZeRO 2 exposes."""
    from types import SimpleNamespace

    from gradgate.integrations._zero_setups import check_masters

    zero2 = SimpleNamespace(partition_gradients=True, bit16_groups=[[torch.zeros(2).half()]])
    with pytest.raises(gg.InvalidOptionError, match=r"stage 2 with fp16 weights.*bf16_master_"):
        check_masters(zero2, "zero12", [torch.zeros(2)])
    check_masters(zero2, "plain", [])  # stage 0: the engine steps LearnerMasters itself


def test_zero_masters_bench_table_has_a_line_per_stage_plan_and_rank() -> None:
    from gradgate._bench.sections.zero_masters import table

    row = {"stage": 3, "plan": "BAdam", "rank": 1, "ZeRO": 6000, "share": 790}
    row |= {"AdamW, learners' state": 2600, "LearnerMasters": 792}
    section = {"world_size": 2, "backend": "gloo", "blocks": 8, "width": 128, "steps": 3}
    text = table({**section, "rows": [row], "beside": {"3": {"copy": 0, "gradients": 1058}}})
    lines = text.splitlines()
    assert lines[2].split() == ["3", "BAdam", "1", "6,000", "2,600", "792", "790"]
    assert lines[-1].split() == ["3", "0", "1,058"]
