"""What the two trainer callbacks log, read back from real logger backends: the same keys from
the HF Trainer and the Lightning Trainer (one metrics path), the learning parameter count, the
learning blocks (a block that rests is absent, never 0), Importance's scores and each learning
block's gradient norm; and the model summaries that count what learns under the plan."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Tokens, lightning_trainer, tiny_llama, trainer_args
from torch import nn
from torch.utils.data import DataLoader

import gradgate as gg

transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")
pytest.importorskip("tensorboard")

N, STEPS = 4, 5
BLOCKS = [f"model.layers.{i}" for i in range(N)]

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def schedule() -> gg.schedules.Importance:
    return gg.schedules.Importance(["model.layers.*"], budget=0.25, seed=1)


def learning_count(model: nn.Module, block: int) -> int:
    """Under a learning set of one block: it, and what runs after the last block."""
    after = [model.model.norm, model.lm_head, model.get_submodule(BLOCKS[block])]
    return sum(p.numel() for module in after for p in module.parameters())


def block_norms(model: nn.Module) -> dict[str, float]:
    """What the callbacks should log as gradient norms: blocks with gradients only."""
    found = {}
    for name in BLOCKS:
        grads = [p.grad for p in model.get_submodule(name).parameters() if p.grad is not None]
        if grads:
            found[name] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
    return found


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under ``folder``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in folder.rglob("events.out.tfevents.*")}
    reader = EventAccumulator(str(events), size_guidance={"scalars": 0})
    reader.Reload()
    return {
        tag: [(event.step, event.value) for event in reader.Scalars(tag)]
        for tag in reader.Tags()["scalars"]
    }


# -- the HF Trainer, TensorBoard ------------------------------------------------------------------
class NormRecorder(transformers.TrainerCallback):
    """After the gate callback, before each optimizer step: the blocks' gradient norms."""

    def __init__(self) -> None:
        self.norms: list[dict[str, float]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs) -> None:
        self.norms.append(block_norms(model))


def run_hf(tmp_path: Path, caplog: Any) -> tuple[Any, NormRecorder, Any]:
    model = tiny_llama(N)
    callback = gg.integrations.transformers.GateCallback(schedule(), grad_norms=True)
    recorder = NormRecorder()
    args = trainer_args(
        tmp_path,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to="tensorboard",  # event files under output_dir/runs
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[callback, recorder]
    )
    callback.put_first(trainer)  # the TensorBoard reporter sees the gate's numbers
    with caplog.at_level(logging.INFO, logger="transformers.trainer"):
        transformers.utils.logging.enable_propagation()
        try:
            trainer.train()
        finally:
            transformers.utils.logging.disable_propagation()
    return trainer, recorder, model


# -- the Lightning Trainer, CSV and TensorBoard ---------------------------------------------------
class LitLlama(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_llama(N)
        self.norms: list[dict[str, float]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(**batch).loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.norms.append(block_norms(self.net))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=5e-5)


def run_lightning(tmp_path: Path, caplog: Any, **options: Any) -> tuple[Any, LitLlama]:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    module = LitLlama()
    callback = gg.integrations.lightning.GateCallback(schedule(), model="net", grad_norms=True)
    loggers = [
        CSVLogger(str(tmp_path), name="csv", version=0),
        TensorBoardLogger(str(tmp_path), name="tb", version=0),
    ]
    summaries = options.pop("callbacks", [])
    trainer = lightning_trainer(
        tmp_path, max_steps=STEPS, logger=loggers, log_every_n_steps=1,
        callbacks=[callback, *summaries], enable_model_summary=bool(summaries), **options,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.callbacks.model_summary"):
        trainer.fit(module, DataLoader(Tokens(), batch_size=4))
    return callback, module


def check_step(logged: dict[str, float], norms: dict[str, float], model: nn.Module) -> int:
    """One logging step's numbers: the block that learned, its count and gradient norm."""
    learning = [b for b in BLOCKS if f"gradgate/learns/{b}" in logged]
    assert len(learning) == 1, logged  # Importance drew one block: the others are absent
    (block,) = learning
    position = BLOCKS.index(block)
    assert logged[f"gradgate/learns/{block}"] == sum(
        p.numel() for p in model.get_submodule(block).parameters()
    )
    assert logged["gradgate/learning_parameters"] == learning_count(model, position)
    assert logged["gradgate/learning_modules"] == 1.0  # Importance says modules
    assert set(norms) == {block}  # only the drawn block got gradients
    grad_norms = {k: v for k, v in logged.items() if k.startswith("gradgate/grad_norm/")}
    assert grad_norms.keys() == {f"gradgate/grad_norm/{block}"}
    assert grad_norms[f"gradgate/grad_norm/{block}"] == pytest.approx(norms[block], rel=1e-5)
    assert all(f"gradgate/picks/{b}" in logged for b in BLOCKS)
    return position


def gate_keys(logged: dict[str, Any]) -> set[str]:
    return {key for key in logged if key.startswith("gradgate/")}


@pytest.mark.slow
def test_both_callbacks_log_the_same_keys_through_real_loggers(tmp_path: Path, caplog) -> None:
    trainer, recorder, model = run_hf(tmp_path / "hf", caplog)
    hf_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(hf_logs) == STEPS
    drawn = [check_step(h, n, model) for h, n in zip(hf_logs, recorder.norms, strict=True)]
    assert len(set(drawn)) > 1  # the draw moved: blocks rested at some steps
    tb = {k.removeprefix("train/"): v for k, v in scalars(tmp_path / "hf").items()}  # HF's prefix
    for position, block in enumerate(BLOCKS):  # absent where it rested, never 0
        events = tb.get(f"gradgate/learns/{block}", [])
        assert len(events) == drawn.count(position)
        assert all(value > 0 for _, value in events)
    assert [v for _, v in tb["gradgate/learning_parameters"]] == [
        h["gradgate/learning_parameters"] for h in hf_logs
    ]
    assert any(key.startswith("gradgate/score/") for key in tb)  # Importance's scores
    records = {id(r): r for r in caplog.records}.values()  # pytest may hold one twice
    said = [r.getMessage() for r in records if "gradgate plan" in r.getMessage()]
    assert said == [
        f"  Number of parameters learning under the gradgate plan = "
        f"{learning_count(model, drawn[0]):,} (the trainable count above reads requires_grad "
        "and ignores the gate)"
    ]

    callback, module = run_lightning(tmp_path / "lit", caplog)
    with open(tmp_path / "lit" / "csv" / "version_0" / "metrics.csv") as file:
        rows = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(file)]
    rows = [r for r in rows if "gradgate/learning_parameters" in r]
    assert len(rows) == STEPS
    lit_drawn = [check_step(r, n, module.net) for r, n in zip(rows, module.norms, strict=True)]
    assert len(set(lit_drawn)) > 1
    lit_tb = scalars(tmp_path / "lit" / "tb")
    for position, block in enumerate(BLOCKS):
        assert len(lit_tb.get(f"gradgate/learns/{block}", [])) == lit_drawn.count(position)
    # one metrics path: the same keys from both trainers, over the run
    hf_keys = set().union(*map(gate_keys, hf_logs))
    lit_keys = set().union(*map(gate_keys, rows))
    assert hf_keys == lit_keys
    assert hf_keys >= {f"gradgate/grad_norm/{b}" for b in set(map(BLOCKS.__getitem__, drawn))}
    assert callback.gate is None


@pytest.mark.slow
def test_lightning_model_summaries_count_what_learns_under_the_plan(
    tmp_path: Path, caplog, capsys
) -> None:
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
    from lightning.pytorch.utilities.model_summary.model_summary import (
        get_human_readable_count as shown,
    )

    plain = ModelSummary(max_depth=2)
    _, module = run_lightning(tmp_path, caplog, callbacks=[plain])
    (table,) = [r.getMessage() for r in caplog.records if "Trainable params" in r.getMessage()]
    gate = gg.BackpropGate(module.net)
    first = min(schedule().apply(gate, 0).learn)  # the plan of the first step
    gate.remove()
    expected = learning_count(module.net, first)
    total = sum(p.numel() for p in module.parameters())
    lines = table.splitlines()
    assert next(x for x in lines if "Trainable params" in x).split()[:2] == shown(expected).split()
    assert (
        next(x for x in lines if "Non-trainable" in x).split()[:2]
        == shown(total - expected).split()
    )
    header = next(x for x in lines if "Name" in x)
    assert header.index("Params") < header.index("Learns")
    rows = [[cell.strip() for cell in row.split("|")] for row in lines if row.count("|") > 4]
    learns = {row[1]: row[header.split("|").index(" Learns ")] for row in rows[1:]}
    assert learns["net"] == shown(expected)
    assert learns["net.model"] == shown(
        expected - sum(p.numel() for p in module.net.lm_head.parameters())
    )
    assert learns["net.lm_head"] == shown(module.net.lm_head.weight.numel())
    assert "summarize" not in vars(plain)  # the trainer's own again

    rich = RichModelSummary()
    run_lightning(tmp_path / "rich", caplog, callbacks=[rich])
    printed = capsys.readouterr().out
    assert f"Trainable params: {shown(expected)}" in " ".join(printed.split())
    assert "summarize" not in vars(rich)
