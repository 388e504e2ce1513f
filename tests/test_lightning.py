"""The real Lightning Trainer with a per-minibatch depth set in a hook."""

from __future__ import annotations

import pytest
import torch
from models import lightning_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradgate as gg

lightning = pytest.importorskip("lightning")

DEPTHS = [1, 2, 1, 2]  # the first two of four blocks never learn


class PartialBackprop(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)])
        self.gate = gg.BackpropGate(self.net)
        self.seen: list[list[bool]] = []

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        self.gate.depth = DEPTHS[batch_idx]

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_after_backward(self) -> None:
        self.seen.append([block[0].weight.grad is not None for block in self.net])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trainer_learns_only_in_the_chosen_blocks(tmp_path) -> None:
    module = PartialBackprop()
    before = [p.detach().clone() for p in module.net.parameters()]
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 4))
    trainer = lightning_trainer(tmp_path, max_steps=len(DEPTHS))
    trainer.fit(module, DataLoader(data, batch_size=4))
    assert module.seen == [[False, False, d == 2, True] for d in DEPTHS]
    after = list(module.net.parameters())
    assert all(torch.equal(a, b) for a, b in zip(after[:4], before[:4], strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(after[4:], before[4:], strict=True))
    module.gate.remove()
