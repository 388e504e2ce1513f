"""Importance inside the real HF Trainer and Lightning Trainer: observe, logs, state, exactness."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from models import Tokens, lightning_trainer, tiny_llama, trainer_args
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradgate as gg

N = 4
CANDIDATES = ["model.layers.*.mlp.*_proj", "model.layers.*.self_attn.*_proj"]


def rms(tensors: list[torch.Tensor]) -> float:
    squares = sum(float(t.double().square().sum()) for t in tensors)
    return math.sqrt(squares / sum(t.numel() for t in tensors))


# -- Hugging Face Trainer ----------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


class Recorder(transformers.TrainerCallback):
    """After GateCallback: each step's plan, the gradients the optimizer sees, what moved."""

    def __init__(self, callback) -> None:
        self.callback = callback
        self.steps: list[dict] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
        self.before = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.steps.append({"plan": self.callback.plan})

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs) -> None:
        self.steps[-1]["grads"] = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        self.steps[-1]["scores"] = self.callback._driver.schedule.scores

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        self.steps[-1]["moved"] = {
            n for n, p in model.named_parameters() if not torch.equal(p, self.before[n])
        }


needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="the HF Trainer needs accelerate"
)
hf_warnings = [
    needs_accelerate,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:transformers.*"),
    pytest.mark.filterwarnings("ignore::UserWarning:accelerate.*"),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.*"),
]


def hf_test(function):
    for mark in hf_warnings:
        function = mark(function)
    return function


def train_hf(tmp_path: Path, sched, *, steps: int, resume=None, save_strategy="no", **options):
    callback = gg.integrations.transformers.GateCallback(sched)
    recorder = Recorder(callback)
    args = trainer_args(
        tmp_path,
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        weight_decay=0.1,
        logging_steps=1,
        dataloader_num_workers=0,
        seed=0,
        save_strategy=save_strategy,
        **options,
    )
    trainer = transformers.Trainer(
        model=tiny_llama(4), args=args, train_dataset=Tokens(), callbacks=[callback, recorder]
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, recorder


@hf_test
def test_hf_importance_observes_accumulated_grads_learns_the_draw_and_logs(tmp_path) -> None:
    sched = gg.schedules.Importance(CANDIDATES, budget=0.2, seed=1)
    trainer, recorder = train_hf(tmp_path, sched, steps=3)
    for step, record in enumerate(recorder.steps):
        drawn = set(record["plan"].learn)
        weights = {f"{n}.weight" for n in drawn}
        head = {"model.norm.weight", "lm_head.weight"}
        assert set(record["grads"]) == weights | head, step
        assert record["moved"] == weights | head, step  # the rest bit-identical (AdamW, decay)
        observed = {n for n, s in record["scores"].items() if s is not None}
        assert observed >= drawn, step
    first = recorder.steps[0]  # its scores: read after GateCallback observed, in the same event
    for name in first["plan"].learn:
        assert first["scores"][name] == pytest.approx(rms([first["grads"][f"{name}.weight"]]))
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    last = logged[-1]
    assert last["gradgate/learning_modules"] == len(recorder.steps[-1]["plan"].learn)
    picks = {k[len("gradgate/picks/") :]: v for k, v in last.items() if "/picks/" in k}
    assert picks == {n: float(c) for n, c in sched.picks.items()} and sum(picks.values()) > 0
    scores = {k[len("gradgate/score/") :]: v for k, v in last.items() if "/score/" in k}
    assert scores and all(scores[n] == pytest.approx(sched.scores[n]) for n in scores)
    assert 0 < last["gradgate/budget_used"] <= 0.2


@hf_test
def test_hf_checkpoints_keep_the_importance_state_and_resume_continues_it(tmp_path) -> None:
    options = {"save_strategy": "steps", "save_steps": 2}
    whole = gg.schedules.Importance(CANDIDATES, budget=0.2, seed=1, every=3)
    _, full = train_hf(tmp_path / "a", whole, steps=4, **options)
    saved = json.loads((tmp_path / "a" / "checkpoint-2" / "gradgate_schedule.json").read_text())
    assert saved["schedule"] == "Importance" and saved["next_step"] == 2
    assert saved["window"] == 0 and sum(saved["picks"].values()) > 0
    resumed = gg.schedules.Importance(CANDIDATES, budget=0.2, seed=1, every=3)
    _, tail = train_hf(
        tmp_path / "a", resumed, steps=4, resume=str(tmp_path / "a" / "checkpoint-2"), **options
    )
    assert [r["plan"] for r in tail.steps] == [r["plan"] for r in full.steps[2:]]
    assert resumed.picks == whole.picks
    assert resumed.scores == pytest.approx(whole.scores)


# -- Lightning Trainer -------------------------------------------------------------------------
lightning = pytest.importorskip("lightning")


class Pairs(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            *[nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)) for _ in range(N)]
        )
        self.steps: list[dict] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.before = {n: p.detach().clone() for n, p in self.net.named_parameters()}
        grads = {n: p.grad.clone() for n, p in self.net.named_parameters() if p.grad is not None}
        self.steps.append({"grads": grads})

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if hasattr(self, "before"):
            moved = {
                n for n, p in self.net.named_parameters() if not torch.equal(p, self.before[n])
            }
            self.steps[-1]["moved"] = moved
            del self.before

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_lightning_importance_observes_learns_the_draw_logs_and_checkpoints(tmp_path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    sched = gg.schedules.Importance(["*.0", "*.2"], budget=0.25, seed=3)
    callback = gg.integrations.lightning.GateCallback(sched, model="net")
    module = Pairs()
    seen_plans = []

    class Plans(lightning.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen_plans.append(callback.plan)

    trainer = lightning_trainer(
        tmp_path,
        max_steps=4,
        logger=CSVLogger(str(tmp_path), name="run", version=0),
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        callbacks=[callback, Plans()],
    )
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 4))
    trainer.fit(module, DataLoader(data, batch_size=4))
    plans = seen_plans[::2]  # two batches per optimizer step
    assert len(module.steps) == len(plans) == 4
    for plan, record in zip(plans, module.steps, strict=True):
        learning = {f"{n}.{p}" for n in plan.learn for p in ("weight", "bias")}
        assert set(record["grads"]) == learning
        assert record["moved"] == learning
    assert sched.picks == {n: sum(n in p.learn for p in plans) for n in sched.candidates}
    observed = {n for n, s in sched.scores.items() if s is not None}
    assert observed == {n for p in plans for n in p.learn}
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert {r["gradgate/learning_modules"] for r in rows if r["gradgate/learning_modules"]} == {
        "2.0"
    }
    assert any(r.get("gradgate/picks/0.0") for r in rows)
    state = callback.state_dict()["schedule"]
    assert state["picks"] == sched.picks and state["scores"] == sched.scores


def test_hf_on_save_writes_the_state_or_warns_when_it_is_not_json(tmp_path) -> None:
    from types import SimpleNamespace

    class Odd(gg.schedules.RandomDepth):
        def _config(self):
            return {"n": self.n, "blocks": {1, 2}}  # a set: not JSON

    (tmp_path / "checkpoint-2").mkdir()
    args = SimpleNamespace(output_dir=str(tmp_path))
    state = SimpleNamespace(global_step=2, is_world_process_zero=True)
    good = gg.integrations.transformers.GateCallback(gg.schedules.RandomDepth(N, seed=3))
    good.on_save(args, state, None)
    saved = json.loads((tmp_path / "checkpoint-2" / "gradgate_schedule.json").read_text())
    assert saved["schedule"] == "RandomDepth" and saved["seed"] == 3
    odd = gg.integrations.transformers.GateCallback(Odd(N))
    with pytest.warns(gg.GradgateWarning, match=r"keeps no schedule state: .* is not JSON"):
        odd.on_save(args, SimpleNamespace(global_step=2, is_world_process_zero=True), None)
    resumed = gg.integrations.transformers.GateCallback(gg.schedules.RandomDepth(N))
    resumed._resume = True  # train(resume_from_checkpoint=True): the last checkpoint
    resumed._load_schedule(args)
    assert resumed._driver.schedule.seed == 3
