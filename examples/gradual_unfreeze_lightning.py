"""Gradual unfreezing (ULMFiT style) with the Lightning Trainer and gradgate's GateCallback.

The last block learns first; one more block joins every 2 optimizer steps. The callback sets
the plan before each step's first batch (the same plan for the accumulated batches of one
step) and logs it to the trainer's loggers: here a CSV logger.
"""

import csv
import logging
import tempfile
import warnings
from pathlib import Path

import lightning
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradgate as gg
from gradgate.integrations.lightning import GateCallback

BLOCKS = 4


class Regressor(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(
            *[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(BLOCKS)]
        )
        self.head = nn.Linear(8, 1)
        self.moved: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.before = [block[0].weight.detach().clone() for block in self.backbone]

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        now = [block[0].weight for block in self.backbone]
        self.moved.append(
            [
                i
                for i, (a, b) in enumerate(zip(now, self.before, strict=True))
                if not torch.equal(a, b)
            ]
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")  # e.g. "few dataloader workers"
    schedule = gg.schedules.GradualUnfreeze(BLOCKS, every=2, start=1)
    callback = GateCallback(schedule, model="backbone")
    module = Regressor()
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    with tempfile.TemporaryDirectory() as folder:
        trainer = lightning.Trainer(
            max_steps=8,
            accumulate_grad_batches=2,
            accelerator="cpu",
            callbacks=[callback],
            logger=CSVLogger(folder, name="run", version=0),
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=folder,
        )
        trainer.fit(module, DataLoader(data, batch_size=4))
        with open(Path(folder) / "run" / "version_0" / "metrics.csv") as file:
            rows = [r for r in csv.DictReader(file) if r["gradgate/depth"]]
    logged = sorted({(int(r["step"]), int(float(r["gradgate/depth"]))) for r in rows})
    depths = [d for _, d in logged]
    print(f"depth logged per optimizer step: {depths}")
    print(f"matches the schedule: {depths == [schedule.plan(s).depth for s in range(8)]}")
    print(f"blocks that moved per step: {module.moved}")
    expected = [list(range(BLOCKS - schedule.plan(s).depth, BLOCKS)) for s in range(8)]
    print(f"blocks outside the suffix bit-identical: {module.moved == expected}")


if __name__ == "__main__":
    main()
