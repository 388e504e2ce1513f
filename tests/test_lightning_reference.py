"""The Lightning Trainer with GateCallback: every optimizer step's update against a reference.

A LightningModule wraps a tiny residual MLP stack (an embedding, four ``x + tanh(W x)`` blocks,
a head) and trains it with plain SGD (no momentum, no weight decay, no clipping) under
``accumulate_grad_batches=2`` and LISA (one drawn block per step, the embedding always). For
each optimizer step the test recomputes the gradient by hand with plain autograd on a copy of
the module as it was before the step, the mean of the two micro-batches' gradients (Lightning
divides each micro-batch's loss by 2), keeping only the learners' (the drawn block, the
embedding, the head); learners must move by ``-lr * grad``, the other blocks not at all.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from models import lightning_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradgate as gg

lightning = pytest.importorskip("lightning")

N = 4
LR = 0.3
STEPS = 4
ACCUMULATE = 2

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.f(x))


class ResidualStack(lightning.LightningModule):
    """``training_step`` calls ``self(x)``: the callback gates the module itself."""

    def __init__(self, lr: float = LR) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 8)
        self.blocks = nn.ModuleList(Residual(8) for _ in range(N))
        self.head = nn.Linear(8, 2)
        self.lr = lr
        self.records: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.records.append(
            {
                "global_step": self.trainer.global_step,
                "before": {n: p.detach().clone() for n, p in self.named_parameters()},
                "batch": (x.clone(), y.clone()),
            }
        )
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def reference_grads(module, before, batches, plan) -> dict[str, torch.Tensor]:
    """Plain autograd on a copy: learners are the plan's blocks, its named modules, the head."""
    ref = copy.deepcopy(module)  # taken after fitting: the callback removed its gate
    with torch.no_grad():
        for name, param in ref.named_parameters():
            param.copy_(before[name])
    learners = ["head."] + [f"blocks.{i}." for i in plan.learning(N)]
    learners += [f"{name}." for name in plan.learn if isinstance(name, str)]
    params = {n: p for n, p in ref.named_parameters() if any(n.startswith(s) for s in learners)}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for x, y in batches:
        loss = nn.functional.mse_loss(ref(x), y) / len(batches)
        for name, grad in zip(
            params, torch.autograd.grad(loss, list(params.values())), strict=True
        ):
            total[name] += grad
    return total


def fit_and_check(tmp_path: Path, *, lr_in_reference: float = LR) -> None:
    sched = gg.schedules.LISA(N, k=1, every=1, always=["embed"], seed=2)
    callback = gg.integrations.lightning.GateCallback(sched, blocks="blocks.*")
    module = ResidualStack()
    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 2))
    trainer = lightning_trainer(
        tmp_path, max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, callbacks=[callback]
    )
    trainer.fit(module, DataLoader(data, batch_size=4, shuffle=False))
    assert callback.gate is None  # removed at fit end: the deepcopy below is ungated
    records = module.records
    assert [r["global_step"] for r in records] == [s for s in range(STEPS) for _ in "ab"]
    final = {n: p.detach().clone() for n, p in module.named_parameters()}
    drawn = [sched.plan(s).learning(N) for s in range(STEPS)]
    assert len(set(drawn)) > 1 and all(len(d) == 1 for d in drawn), drawn
    for step in range(STEPS):
        first, second = records[ACCUMULATE * step : ACCUMULATE * (step + 1)]
        for name, value in first["before"].items():  # no update between the micro-batches
            assert torch.equal(second["before"][name], value), (step, name)
        before = first["before"]
        after = records[ACCUMULATE * (step + 1)]["before"] if step + 1 < STEPS else final
        expected = reference_grads(
            module, before, [first["batch"], second["batch"]], sched.plan(step)
        )
        assert {n.split(".")[0] for n in expected} == {"embed", "head", "blocks"}
        for name, value in after.items():
            if name in expected:
                want = before[name] - lr_in_reference * expected[name]
                assert not torch.equal(want, before[name]), (step, name)
                torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(value, before[name]), f"step {step}: {name} moved"


def test_lightning_lisa_update_equals_reference(tmp_path: Path) -> None:
    fit_and_check(tmp_path)


def test_lightning_reference_check_fails_on_a_wrong_learning_rate(tmp_path: Path) -> None:
    with pytest.raises(AssertionError):
        fit_and_check(tmp_path, lr_in_reference=LR * 1.01)
