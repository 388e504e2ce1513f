"""LearnerMasters + BAdam over FSDP2 in the real trainers, 2 gloo ranks: the HF Trainer through
accelerate's FSDP2 plugin (``fsdp_config={"version": 2}``), and Lightning's
``ModelParallelStrategy``; each bit for bit the reference of tests/test_masters_fsdp.py (one
process averaging the ranks' gradients), the HF Trainer also resumed from its checkpoint.

accelerate turns FSDP on only for accelerators: ``AcceleratorState`` sets
``DistributedType.FSDP`` inside ``elif self.distributed_type in [MULTI_GPU, MULTI_MLU, ...,
MULTI_NEURON]``, a list without ``MULTI_CPU`` (accelerate/state.py), so on the CPU a Trainer
with an FSDP config silently runs DDP. ``on_the_cpu`` sets the state as it is on GPUs, after the
Accelerator is built; everything else is the Trainer's and accelerate's own FSDP2 code.
Lightning's ModelParallelStrategy runs on the CPU as it is.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from models import lightning_trainer, trainer_args
from test_distributed import needs_fsdp2_on_cpu
from test_masters import OPTS, N, batches, loss_of, make
from test_masters_fsdp import assert_same_as, local_numel, part, run, spawn
from test_masters_trainers import STEPS, Rows, Wrapped, decay
from torch import nn
from torch.distributed.tensor import DTensor

import gradgate as gg

transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")
pytestmark = [
    pytest.mark.slow,  # spawned processes running two trainers: seconds
    needs_fsdp2_on_cpu,
]
WORLD, K = 2, 2


def badam() -> gg.schedules.BAdam:
    return gg.schedules.BAdam(N, K, order="random", seed=2)


def reference() -> nn.Module:
    """One process: each rank's half-batch in turn, gradients averaged, the trainers' LR decay."""
    model = make()
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    run(model, badam(), world=WORLD, rank=None, steps=range(STEPS), opt=opt, scheduler=lr)
    return model


# -- Hugging Face Trainer ----------------------------------------------------------------------
class MastersTrainer(transformers.Trainer):
    """The recipe's Trainer: under FSDP it may not be handed an optimizer (``optimizers=`` is
    refused), so it makes LearnerMasters itself; a resume loads the full optimizer state that
    the checkpoint holds into it (each rank keeps its shards). Batches in order, for the test."""

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            params = (model or self.model).parameters()
            self.optimizer = gg.optim.LearnerMasters(torch.optim.AdamW, params, **OPTS)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.lr_scheduler is None:
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer or self.optimizer, decay
            )
        return self.lr_scheduler

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        saved = torch.load(Path(checkpoint, "optimizer.bin"), weights_only=True)
        self.optimizer.load_state_dict(saved)  # names -> whole tensors: each rank cuts its shard
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint, "scheduler.pt")))

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        on_the_cpu(self)

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.data.SequentialSampler(self.train_dataset)


def on_the_cpu(trainer: transformers.Trainer) -> None:
    """FSDP as accelerate sets it up on GPUs (see the module's docstring)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def hf_train(out: Path, *, save_steps: int | None = None, resume: str | None = None) -> Any:
    from gradgate.integrations.transformers import GateCallback

    torch.manual_seed(0)
    model = Wrapped().to(torch.bfloat16)  # bf16=False below: accelerate would upcast it
    args = trainer_args(
        out,
        per_device_train_batch_size=8 // WORLD,
        max_steps=STEPS,
        max_grad_norm=0.0,
        seed=0,
        fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Block"]},
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
    )
    callback = GateCallback(badam(), blocks="blocks.*")
    trainer = MastersTrainer(model, args, train_dataset=Rows(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def hf_trainer_with_accelerates_fsdp2_is_exact(
    rank: int, world: int, record: dict[str, Any]
) -> None:
    out = Path(os.environ["GRADGATE_TEST_OUT"])
    trainer = hf_train(out / "whole")
    model, opt = trainer.model, trainer.optimizer.optimizer
    assert isinstance(opt, gg.optim.LearnerMasters)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert_same_as(model, reference(), "HF Trainer, FSDP2")
    learners = [n for n, p in model.named_parameters() if p in opt.state]
    assert opt.master_bytes() == 12 * local_numel(model, learners) + 4 * len(learners)

    hf_train(out / "saved", save_steps=3)  # the full optimizer state (FULL_STATE_DICT)
    resumed = hf_train(out / "resumed", resume=str(out / "saved/checkpoint-3"))
    assert_same_as(resumed.model, reference(), "HF Trainer, FSDP2, resumed at step 3")


# -- Lightning ---------------------------------------------------------------------------------
class Module(lightning.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return loss_of(self.net, x[0], y[0])

    def configure_optimizers(self) -> Any:
        opt = gg.optim.LearnerMasters(torch.optim.AdamW, self.net.parameters(), **OPTS)
        lr = torch.optim.lr_scheduler.LambdaLR(opt, decay)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": lr, "interval": "step"}}


def lightning_fit(rank: int, world: int, steps: int, ckpt: str | None = None) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from gradgate.integrations.lightning import GateCallback

    logging.getLogger("lightning").setLevel(logging.ERROR)
    net = make()
    data = [(part(x, rank, world), part(y, rank, world)) for x, y in batches(STEPS)]
    trainer = lightning_trainer(
        Path(os.environ["GRADGATE_TEST_OUT"]) / "lightning",
        max_steps=steps,
        devices=world,
        # its "auto" sizes are one data-parallel rank per node and tensor parallelism inside
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        use_distributed_sampler=False,  # each rank's half-batches are given as they are
        callbacks=[GateCallback(badam(), model="net", blocks="blocks.*")],
    )
    trainer.fit(Module(net), torch.utils.data.DataLoader(data, batch_size=1), ckpt_path=ckpt)
    return trainer


def lightning_model_parallel_strategy_is_exact(
    rank: int, world: int, record: dict[str, Any]
) -> None:
    trainer = lightning_fit(rank, world, STEPS)
    assert isinstance(trainer.optimizers[0], gg.optim.LearnerMasters)
    assert_same_as(trainer.lightning_module.net, reference(), "Lightning, ModelParallelStrategy")


def lightning_distributed_checkpoint_cannot_lose_the_masters(
    rank: int, world: int, record: dict[str, Any]
) -> None:
    """Its default checkpoint is torch.distributed.checkpoint's sharded one, read into a fresh
    optimizer's state_dict: LearnerMasters' masters and moments would not be read (the resumed
    run went on without them); the load raises instead."""
    path = str(Path(os.environ["GRADGATE_TEST_OUT"]) / "lightning" / "step-3")
    lightning_fit(rank, world, 3).save_checkpoint(path)
    with pytest.raises(gg.GradgateError, match="held fp32 masters and moments for 6 param"):
        lightning_fit(rank, world, STEPS, ckpt=path)


SCENARIOS = [
    hf_trainer_with_accelerates_fsdp2_is_exact,
    lightning_model_parallel_strategy_is_exact,
    lightning_distributed_checkpoint_cannot_lose_the_masters,
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("trainers")
    os.environ["GRADGATE_TEST_OUT"] = str(out)  # the spawned ranks inherit it
    try:
        return spawn(__name__, WORLD, out)
    finally:
        del os.environ["GRADGATE_TEST_OUT"]


@pytest.mark.parametrize("scenario", [s.__name__ for s in SCENARIOS])
def test_scenario(results: list[dict[str, Any]], scenario: str) -> None:
    for rank, result in enumerate(results):
        outcome = result[scenario]["outcome"]
        assert outcome == "ok", f"rank {rank}:\n{outcome}"
