"""LearnerMasters in the real trainers, unchanged: the HF Trainer (optimizers=(opt, scheduler),
a checkpoint and its resume) and Lightning (the closure path, an LR scheduler per step), each bit
for bit the same loop written by hand."""

from __future__ import annotations

import copy
import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from models import lightning_trainer, trainer_args
from test_masters import OPTS, N, Net, assert_same_params, batches, loss_of, make

import gradgate as gg

STEPS, K = 6, 2
DATA = batches(STEPS)


def decay(step: int) -> float:
    return 1 / (1 + step)


def hand_loop(model: torch.nn.Module, steps: int = STEPS) -> gg.optim.LearnerMasters:
    gate = gg.BackpropGate(model, "blocks.*")
    sched = gg.schedules.BAdam(N, K, order="random", seed=2)
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    for t, (x, y) in enumerate(DATA[:steps]):
        sched.apply(gate, t)
        loss_of(model, x, y).backward()
        opt.step()
        lr.step()
        opt.zero_grad()
        gg.optim.drop_finished(opt, gate, sched, t + 1)
    gate.remove()
    return opt


# -- Hugging Face Trainer ----------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


class Wrapped(Net):
    """The MLP stack with the Trainer's calling convention (keyword batch, a loss out)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"loss": (super().forward(x).float() - y).pow(2).mean()}


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return STEPS * 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = DATA[i // 8]
        return {"x": x[i % 8], "y": y[i % 8]}


class InOrder(transformers.Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def hf_train(tmp_path: Path, *, resume: str | None = None, save_steps: int | None = None):
    from gradgate.integrations.transformers import GateCallback

    torch.manual_seed(0)
    model = Wrapped().to(torch.bfloat16)
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    callback = GateCallback(gg.schedules.BAdam(N, K, order="random", seed=2), blocks="blocks.*")
    args = trainer_args(
        tmp_path,
        per_device_train_batch_size=8,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        max_grad_norm=0.0,
        seed=0,
    )
    trainer = InOrder(model, args, train_dataset=Rows(), optimizers=(opt, lr), callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume)
    return model, opt


hf = [
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@hf[0]
@hf[1]
@hf[2]
def test_hf_trainer_with_learner_masters_and_a_scheduler_is_the_hand_loop(tmp_path) -> None:
    model, opt = hf_train(tmp_path)
    reference = make()
    ref_opt = hand_loop(reference)
    assert_same_params(model, reference, "HF Trainer")
    assert opt.master_bytes() == ref_opt.master_bytes() > 0
    assert opt.param_groups[0]["lr"] == OPTS["lr"] * decay(STEPS)


@hf[0]
@hf[1]
@hf[2]
def test_hf_trainer_resumes_from_its_checkpoint_bit_for_bit(tmp_path) -> None:
    whole, _ = hf_train(tmp_path / "whole")
    hf_train(tmp_path / "saved", save_steps=3)
    resumed, _ = hf_train(tmp_path / "resumed", resume=str(tmp_path / "saved/checkpoint-3"))
    assert_same_params(whole, resumed, "resumed")
    saved = torch.load(tmp_path / "saved/checkpoint-3/optimizer.pt", weights_only=True)
    assert {e["master"].dtype for e in saved["state"].values()} == {torch.float32}


# -- Lightning ---------------------------------------------------------------------------------
lightning = pytest.importorskip("lightning")


class Module(lightning.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return loss_of(self.net, x[0], y[0])

    def configure_optimizers(self):
        opt = gg.optim.LearnerMasters(torch.optim.AdamW, self.net.parameters(), **OPTS)
        lr = torch.optim.lr_scheduler.LambdaLR(opt, decay)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": lr, "interval": "step"}}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_lightning_closure_path_is_the_hand_loop(tmp_path) -> None:
    from gradgate.integrations.lightning import GateCallback

    logging.getLogger("lightning").setLevel(logging.ERROR)
    net = make()
    start = copy.deepcopy(net)
    sched = gg.schedules.BAdam(N, K, order="random", seed=2)
    trainer = lightning_trainer(
        tmp_path, max_steps=STEPS, callbacks=[GateCallback(sched, model="net", blocks="blocks.*")]
    )
    trainer.fit(Module(net), torch.utils.data.DataLoader(DATA, batch_size=1))
    ref_opt = hand_loop(start)
    assert_same_params(net, start, "Lightning")
    opt = trainer.optimizers[0]
    assert isinstance(opt, gg.optim.LearnerMasters)
    assert opt.master_bytes() == ref_opt.master_bytes() > 0
