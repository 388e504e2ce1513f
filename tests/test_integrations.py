"""The real HF Trainer and Lightning Trainer, driven by GateCallback on tiny random models."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import Tokens, lightning_trainer, tiny_gpt2, tiny_llama, trainer_args
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradgate as gg

N = 4


@pytest.mark.slow
def test_importing_gradgate_integrations_loads_no_framework() -> None:
    code = (
        "import sys, gradgate as gg; gg.integrations; gg.schedules; gg.optim; "
        "print(sorted(m for m in ('transformers', 'lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_driver_rejects_bad_arguments() -> None:
    from gradgate.integrations import Driver

    sched = gg.schedules.RandomDepth(N)
    with pytest.raises(gg.InvalidOptionError, match=r"schedule='LISA'; expected a gradgate"):
        Driver("LISA", None, blocks=None, log=True, drop_state=True)  # type: ignore[arg-type]
    with pytest.raises(gg.InvalidOptionError, match=r"gate=.*Linear.*; expected a gradgate"):
        Driver(sched, nn.Linear(2, 2), blocks=None, log=True, drop_state=True)  # type: ignore
    with pytest.raises(gg.InvalidOptionError, match=r"log=1; expected True or False"):
        Driver(sched, None, blocks=None, log=1, drop_state=True)  # type: ignore[arg-type]
    driver = Driver(gg.schedules.RandomDepth(6), None, blocks=None, log=True, drop_state=True)
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(N)])
    with pytest.raises(gg.InvalidOptionError, match="plans over 6 blocks but the gate has 4"):
        driver.attach(net)
    driver.detach()


def test_a_callback_on_a_model_gated_already_says_to_give_it_that_gate() -> None:
    from gradgate.integrations import Driver

    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(N)])
    gate = gg.BackpropGate(net, depth=2)
    driver = Driver(gg.schedules.RandomDepth(N), None, blocks=None, log=True, drop_state=True)
    with pytest.raises(
        gg.AlreadyGatedError,
        match=r"Sequential already has a gate on the same blocks \('0', \.\.\.\).* Or give "
        r"that gate to the callback: GateCallback\(schedule, gate=gate\)\.",
    ):
        driver.attach(net)
    assert driver.gate is None and gate.depth == 2
    gate.remove()


def test_hf_callback_freeze_for_step_must_be_a_bool() -> None:
    transformers_callback = pytest.importorskip("gradgate.integrations.transformers")
    sched = gg.schedules.RandomDepth(N)
    with pytest.raises(gg.InvalidOptionError, match=r"freeze_for_step='no'; expected True, Fa"):
        transformers_callback.GateCallback(sched, freeze_for_step="no")  # type: ignore[arg-type]
    for value in (None, True, False):
        transformers_callback.GateCallback(sched, freeze_for_step=value)


# -- Hugging Face Trainer ----------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


class StepRecorder(transformers.TrainerCallback):
    """After GateCallback: per optimizer step, the plan, the forwards' plans and what moved."""

    def __init__(self, gate_callback, blocks: list[nn.Module]) -> None:
        self.gate_callback = gate_callback
        self.blocks = blocks
        self.steps: list[dict] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
        if not self.steps:
            model.register_forward_pre_hook(self._forward)
        self.before = [[p.detach().clone() for p in b.parameters()] for b in self.blocks]
        held = {
            i for i, b in enumerate(self.blocks) if not any(p.requires_grad for p in b.parameters())
        }
        self.steps.append({"plan": self.gate_callback.plan, "forwards": [], "held": held})

    def _forward(self, module, args) -> None:
        gate = self.gate_callback.gate
        self.steps[-1]["forwards"].append((gate.depth, gate.learn, gate.skip))

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.steps[-1]["moved"] = {
            i
            for i, (block, before) in enumerate(zip(self.blocks, self.before, strict=True))
            if not all(torch.equal(p, q) for p, q in zip(block.parameters(), before, strict=True))
        }


def train_hf(model, callback, tmp_path: Path, *, steps: int = 3, accumulate: int = 2, **kw):
    from transformers.modeling_utils import PreTrainedModel

    assert isinstance(model, PreTrainedModel)
    blocks = [model.get_submodule(name) for name in gg.blocks(model)]
    recorder = StepRecorder(callback, blocks)
    args = trainer_args(
        tmp_path,
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulate,
        learning_rate=1e-2,
        weight_decay=0.1,
        logging_steps=1,
        dataloader_num_workers=0,
        seed=0,
        **kw,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[callback, recorder]
    )
    trainer.train()
    return trainer, recorder


def plan_of_forward(plan: gg.schedules.Plan) -> tuple:
    return (plan.depth, plan.learn, plan.skip)


hf_warnings = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:transformers.*"),
    pytest.mark.filterwarnings("ignore::UserWarning:accelerate.*"),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.*"),
]


def hf_test(function):
    needs_accelerate = pytest.mark.skipif(
        importlib.util.find_spec("accelerate") is None, reason="the HF Trainer needs accelerate"
    )
    for mark in [needs_accelerate, *hf_warnings]:
        function = mark(function)
    return function


@hf_test
def test_hf_lisa_with_accumulation_learns_only_the_drawn_blocks(tmp_path: Path) -> None:
    model = tiny_llama(N)
    sched = gg.schedules.LISA(N, k=1, every=1, seed=3)
    callback = gg.integrations.transformers.GateCallback(sched)
    trainer, recorder = train_hf(model, callback, tmp_path)
    plans = [sched.plan(step) for step in range(3)]
    assert [s["plan"] for s in recorder.steps] == plans
    for step, record in zip(recorder.steps, plans, strict=True):
        # the same plan for both micro-batches of the step, set before their forwards
        # LISA's default: the embedding, the final norm and the head learn at every step
        learn = record.learn | {"model.embed_tokens", "model.norm", "lm_head"}
        assert step["forwards"] == [(None, learn, frozenset())] * 2
        assert step["moved"] == record.learning(N)  # the others bit-identical (AdamW, decay)
        assert step["held"] == set()  # no checkpointing: frozen only while each block runs
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["gradgate/learning_blocks"] for h in logged] == [1.0, 1.0, 1.0]
    assert [h["gradgate/learning_share"] for h in logged] == [0.25] * 3
    assert callback.gate is None  # the gate it made is removed when training ends


@hf_test
def test_hf_random_depth_logs_the_depth_and_reporters_see_it(tmp_path: Path) -> None:
    seen: list[dict] = []

    class Reporter(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs) -> None:
            seen.append(dict(logs))

    model = tiny_llama(N)
    sched = gg.schedules.RandomDepth(N, low=1, high=3, seed=5)
    callback = gg.integrations.transformers.GateCallback(sched)
    args = trainer_args(
        tmp_path,
        max_steps=4,
        per_device_train_batch_size=4,
        logging_steps=1,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[Reporter(), callback]
    )
    assert callback.put_first(trainer) is callback
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()
    depths = [float(sched.plan(step).depth) for step in range(4)]
    assert [s["gradgate/depth"] for s in seen if "loss" in s] == depths
    assert len(set(depths)) > 1


@hf_test
def test_hf_dropbp_on_gpt2_skipped_blocks_do_not_move(tmp_path: Path) -> None:
    model = tiny_gpt2(N)
    sched = gg.schedules.DropBP(N, rates=[0.5, 0.5, 0.5, 0.5], seed=1)
    callback = gg.integrations.transformers.GateCallback(sched)
    _, recorder = train_hf(model, callback, tmp_path, steps=4, accumulate=1)
    plans = [sched.plan(step) for step in range(4)]
    assert any(p.skip for p in plans) and any(len(p.skip) < N for p in plans)
    for record, plan in zip(recorder.steps, plans, strict=True):
        assert record["forwards"] == [plan_of_forward(plan)]
        assert record["moved"] == plan.learning(N)


@hf_test
def test_hf_freezeout_drops_the_optimizer_state(tmp_path: Path) -> None:
    model = tiny_llama(N)
    sched = gg.schedules.FreezeOut(N, stops=[1, 2, 3, 9])
    callback = gg.integrations.transformers.GateCallback(sched)
    trainer, recorder = train_hf(model, callback, tmp_path, steps=4, accumulate=1)
    assert [r["moved"] for r in recorder.steps] == [{0, 1, 2, 3}, {1, 2, 3}, {2, 3}, {3}]
    state = trainer.optimizer.optimizer.state
    layers = model.model.layers
    assert not any(p in state for i in range(3) for p in layers[i].parameters())
    assert all(p in state for p in layers[3].parameters())


@hf_test
@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param(gg.schedules.RandomDepth(N, seed=2), id="depth"),
        pytest.param(gg.schedules.DropBP(N, 0.5, seed=2), id="dropbp"),
        pytest.param(
            gg.schedules.LISA(N, k=1, every=1, seed=2, always=["model.embed_tokens"]),
            id="lisa",
        ),
    ],
)
def test_hf_non_reentrant_gradient_checkpointing(tmp_path: Path, schedule) -> None:
    model = tiny_llama(N)
    callback = gg.integrations.transformers.GateCallback(schedule)
    _, recorder = train_hf(
        model,
        callback,
        tmp_path,
        steps=3,
        accumulate=1,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    for record, step in zip(recorder.steps, range(3), strict=True):
        learning = schedule.plan(step).learning(N)
        assert record["moved"] == learning
        assert record["held"] == set(range(N)) - learning  # frozen for the whole step
    assert all(p.requires_grad for p in model.parameters())  # given back at the end


class Interrupt(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == 2:
            raise KeyboardInterrupt


def gradgate_hooks(model: nn.Module) -> list:
    hooks = []
    for module in model.modules():
        for name, value in vars(module).items():
            if name.endswith("hooks") and isinstance(value, dict):
                hooks += [h for h in value.values() if "gradgate" in repr(h)]
                hooks += [h for h in value.values() if "gradgate" in getattr(h, "__module__", "")]
    return hooks


@hf_test
@pytest.mark.parametrize("late", [False, True], ids=["in-Trainer", "add_callback+put_first"])
def test_hf_keyboard_interrupt_inside_train_leaves_no_trace(tmp_path: Path, late: bool) -> None:
    # transformers has no exception event: the callback wraps trainer.train to clean up.
    model = tiny_llama(N)
    schedule = gg.schedules.LISA(N, k=1, every=1, seed=2)
    callback = gg.integrations.transformers.GateCallback(schedule)
    args = trainer_args(
        tmp_path,
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    callbacks = [Interrupt()] if late else [callback, Interrupt()]
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=callbacks
    )
    if late:
        trainer.add_callback(callback)
        callback.put_first(trainer)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.state.global_step == 2
    assert callback.gate is None and gradgate_hooks(model) == []
    assert all(p.requires_grad for p in model.parameters())
    model.zero_grad()
    model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    assert all(p.grad is not None for p in model.model.layers.parameters())


@hf_test
def test_hf_callback_refuses_a_gate_on_a_model_the_trainer_does_not_train(tmp_path) -> None:
    other = tiny_llama(N)
    gate = gg.BackpropGate(other)
    callback = gg.integrations.transformers.GateCallback(gg.schedules.RandomDepth(N), gate)
    with pytest.raises(gg.InvalidOptionError, match=r"gate is on a LlamaForCausalLM that the T"):
        train_hf(tiny_llama(N), callback, tmp_path, steps=1, accumulate=1)
    assert gate.depth is None
    gate.remove()


# -- Lightning Trainer -------------------------------------------------------------------------
lightning = pytest.importorskip("lightning")


class Stack(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 4)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(N)])
        self.moved: list[set[int]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(self.embed(x)), y)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.before = [b[0].weight.detach().clone() for b in self.net]

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if hasattr(self, "before"):
            now = [b[0].weight for b in self.net]
            self.moved.append(
                {
                    i
                    for i, (a, b) in enumerate(zip(now, self.before, strict=True))
                    if not torch.equal(a, b)
                }
            )
            del self.before

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


def fit(module, callback, tmp_path: Path, *, steps: int, accumulate: int = 1, logger=False):
    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 4))
    trainer = lightning_trainer(
        tmp_path,
        max_steps=steps,
        logger=logger,
        accumulate_grad_batches=accumulate,
        log_every_n_steps=1,
        callbacks=[callback],
    )
    trainer.fit(module, DataLoader(data, batch_size=4))
    return trainer


lightning_warnings = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def lightning_test(function):
    for mark in lightning_warnings:
        function = mark(function)
    return function


@lightning_test
def test_lightning_gradual_unfreeze_with_accumulation_and_csv_logs(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    sched = gg.schedules.GradualUnfreeze(N, every=2, start=1)
    callback = gg.integrations.lightning.GateCallback(sched, model="net")
    module = Stack()
    embed_before = module.embed.weight.detach().clone()
    logger = CSVLogger(str(tmp_path), name="run", version=0)
    fit(module, callback, tmp_path, steps=6, accumulate=2, logger=logger)
    # twelve batches, six optimizer steps; depth 1, 1, 2, 2, 3, 3
    assert module.moved == [set(range(N - d, N)) for d in (1, 1, 2, 2, 3, 3)]
    assert torch.equal(module.embed.weight, embed_before)  # before the cut: never learns
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    logged = [(int(r["step"]), float(r["gradgate/depth"])) for r in rows if r["gradgate/depth"]]
    assert sorted(set(logged)) == [(s, float(sched.plan(s).depth)) for s in range(6)]
    assert callback.gate is None  # the gate it made is removed when fitting ends


@lightning_test
def test_lightning_lisa_on_a_given_gate_and_state_dict(tmp_path: Path) -> None:
    module = Stack()
    gate = gg.BackpropGate(module.net)
    sched = gg.schedules.LISA(N, k=1, every=1, seed=4)
    callback = gg.integrations.lightning.GateCallback(sched, gate)
    fit(module, callback, tmp_path, steps=4)
    assert module.moved == [sched.plan(s).learning(N) for s in range(4)]
    assert callback.gate is gate and gate.active  # a given gate stays
    state = callback.state_dict()
    other = gg.integrations.lightning.GateCallback(gg.schedules.LISA(N, k=1, every=1, seed=9))
    other.load_state_dict(state)
    assert [other.plan is None, other._driver.schedule.seed] == [True, 4]
    with pytest.raises(gg.InvalidOptionError, match="config is"):
        gg.integrations.lightning.GateCallback(gg.schedules.LISA(N, k=2)).load_state_dict(state)
    gate.remove()


def test_lightning_callback_rejects_model_with_gate() -> None:
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(N)])
    with gg.BackpropGate(net) as gate, pytest.raises(gg.InvalidOptionError, match="model='net'"):
        gg.integrations.lightning.GateCallback(gg.schedules.RandomDepth(N), gate, model="net")


class Checkpointed(nn.Module):
    """A block that checkpoints its own forward (non-reentrant), hooks outside, as HF does."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


class CheckpointedStack(Stack):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(*[Checkpointed() for _ in range(N)])

    def on_before_optimizer_step(self, optimizer) -> None:
        pass

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        pass


@lightning_test
def test_lightning_lisa_with_checkpointed_blocks_and_freeze_for_step(tmp_path: Path) -> None:
    module = CheckpointedStack()
    sched = gg.schedules.LISA(N, k=1, every=1, always=[0], seed=2)
    callback = gg.integrations.lightning.GateCallback(sched, model="net", freeze_for_step=True)
    before = [b.inner[0].weight.detach().clone() for b in module.net]
    fit(module, callback, tmp_path, steps=2)
    learned = set().union(*(sched.plan(s).learning(N) for s in range(2)))
    moved = {i for i, b in enumerate(module.net) if not torch.equal(b.inner[0].weight, before[i])}
    assert moved == learned and len(learned) < N
    assert all(p.requires_grad for p in module.parameters())
