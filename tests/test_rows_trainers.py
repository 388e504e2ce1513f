"""``gg.learn_rows`` in the real HF Trainer and the real Lightning Trainer, with and without a
``GateCallback``: the rows learn, no other row moves, and a checkpoint is the plain model's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from models import Tokens, lightning_trainer, tiny_llama, trainer_args
from torch.utils.data import DataLoader

import gradgate as gg

transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")

N = 2
ROWS = [60, 3, 41]  # token ids of Tokens() (vocabulary 64): new tokens to learn


def moved_rows(weight: torch.Tensor, start: torch.Tensor) -> list[int]:
    return [i for i in range(weight.shape[0]) if not torch.equal(weight[i], start[i])]


hf = [
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:transformers.*"),
    pytest.mark.filterwarnings("ignore::UserWarning:accelerate.*"),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.*"),
]


def hf_test(function):
    for mark in hf:
        function = mark(function)
    return function


@hf_test
@pytest.mark.parametrize("callback", [False, True])
def test_hf_trainer_learns_the_rows_only_and_saves_the_plain_model(
    tmp_path: Path, callback: bool
) -> None:
    model = tiny_llama(N)
    gg.freeze(model, "**")
    start = model.model.embed_tokens.weight.detach().clone()
    handle = gg.learn_rows(model, "model.embed_tokens", rows=ROWS)
    callbacks = []
    if callback:  # LISA's default learning set always holds the embedding (and the head)
        callbacks = [gg.integrations.transformers.GateCallback(gg.schedules.LISA(N, k=1))]
    args = trainer_args(
        tmp_path,
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        weight_decay=0.1,
        save_strategy="steps",
        save_steps=3,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=callbacks
    )
    trainer.train()
    optimizer = trainer.optimizer
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert [p is handle.parameter for p in held] == [True]  # the trainer's AdamW sees the rows
    weight = model.model.embed_tokens.weight
    assert moved_rows(weight, start) == sorted(ROWS)
    assert torch.equal(weight[ROWS], handle.parameter.detach())
    saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "checkpoint-3")
    assert torch.equal(saved.model.embed_tokens.weight, weight)
    assert set(saved.state_dict()) == set(model.state_dict())
    handle.remove()


class LanguageModel(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama(N)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("callback", [False, True])
def test_lightning_learns_the_rows_only(tmp_path: Path, callback: bool) -> None:
    module = LanguageModel()
    start = module.model.model.embed_tokens.weight.detach().clone()
    handle = gg.learn_rows(module.model, "model.embed_tokens", rows=ROWS)
    callbacks = []
    if callback:  # the embedding in every step's learning set, one block drawn
        sched = gg.schedules.LISA(N, k=1)
        callbacks = [gg.integrations.lightning.GateCallback(sched, model="model")]
    trainer = lightning_trainer(
        tmp_path, max_steps=3, accumulate_grad_batches=2, callbacks=callbacks
    )
    trainer.fit(module, DataLoader(Tokens(), batch_size=4))
    weight = module.model.model.embed_tokens.weight
    assert moved_rows(weight, start) == sorted(ROWS)
    assert torch.equal(weight[ROWS], handle.parameter.detach())
    state = module.state_dict()
    assert "model.model.embed_tokens.weight_rows" not in state
    assert torch.equal(state["model.model.embed_tokens.weight"], weight)
    handle.remove()
