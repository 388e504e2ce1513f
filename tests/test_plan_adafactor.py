"""``gg.estimate(..., optimizer="adafactor")``: torch's Adafactor planned to the byte against a
real CPU step. Its step reads values (``.item()`` of its step count and of two norms) only as
Python scalars that size no tensor; the planner reads them as 1 inside the simulated step.

Adafactor keeps a row and a column factor for a parameter of two or more dimensions, the whole
second moment for a vector, and a float32 step count for each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import llama
from test_memory_peak import lm_batch, real_peak
from test_plan_command import LLAMA2, cells, meta_llama, plan, rows
from torch import nn

import gradgate as gg


def adafactor_loop(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=1e-3, foreach=False)  # torch's CPU default


def real_state_bytes(model: nn.Module, args: tuple, kwargs: dict, depth: int) -> int:
    """The bytes of Adafactor's state after one real step at ``depth``."""
    with gg.backprop_depth(model, depth):
        out = model(*args, **kwargs)
        loss = out.sum() if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
    optimizer = adafactor_loop([p for p in model.parameters() if p.grad is not None])
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return sum(t.nbytes for state in optimizer.state.values() for t in state.values())


def factored(model: nn.Module, depth: int) -> int:
    """Adafactor's state, by its rule, for the learners at ``depth`` of a Sequential."""
    total = 0
    for layer in list(model)[len(model) - depth :]:
        for p in layer.parameters():
            rows_and_cols = p.shape[0] + p.shape[1] if p.dim() == 2 else p.numel()
            total += 4 * rows_and_cols + 4  # float32 factors (or the vector's), the step
    return total


def test_an_mlp_is_planned_to_the_byte() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), *[nn.Linear(64, 64) for _ in range(3)])
    x = torch.randn(4, 16)
    plan = gg.estimate(net, x, depths=[1, 3], optimizer="adafactor")
    assert plan.optimizer == "adafactor"
    for row in plan.rows:
        assert row.depth is not None
        assert (
            row.optimizer_bytes
            == factored(net, row.depth)
            == real_state_bytes(net, (x,), {}, row.depth)
        ), row
        real, phase = real_peak(net, (x,), depth=row.depth, optimizer=adafactor_loop)
        assert (row.peak_bytes, row.peak_phase) == (real, phase), (row, real, phase)


def test_a_llama_is_planned_to_the_byte() -> None:
    model, batch, _ = llama()
    batch = lm_batch(batch)
    plan = gg.estimate(model, **batch, depths=[1, 3], optimizer="adafactor")
    adamw = gg.estimate(model, **batch, depths=[1, 3])
    for row in plan.rows:
        assert row.depth is not None
        assert row.optimizer_bytes == real_state_bytes(model, (), batch, row.depth), row
        assert row.optimizer_bytes < adamw[row.depth].optimizer_bytes / 10  # factored
        real, phase = real_peak(model, kwargs=batch, depth=row.depth, optimizer=adafactor_loop)
        assert (row.peak_bytes, row.peak_phase) == (real, phase), (row, real, phase)


def test_the_cli_plans_adafactor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command's rows are gg.estimate's, with Adafactor's foreach step (CUDA's rules)."""
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    reference = gg.estimate(meta_llama(tmp_path, LLAMA2), input_ids=ids, labels=ids,
                            dtype="bf16", depths=[1, 2], device="cuda",
                            optimizer="adafactor")  # fmt: skip
    status, out, err = plan(tmp_path, capsys, LLAMA2, "--seq", "16", "--depths", "1,2",
                            "--optimizer", "adafactor")  # fmt: skip
    assert (status, err) == (0, ""), err
    assert "optimizer adafactor" in out
    assert rows(out)["1"] == cells(reference[1])
    assert rows(out)["2 (all blocks)"] == cells(reference[2])
    adamw = gg.estimate(meta_llama(tmp_path, LLAMA2), input_ids=ids, labels=ids, dtype="bf16",
                        depths=[2], device="cuda")  # fmt: skip
    assert 0 < reference[2].optimizer_bytes < adamw[2].optimizer_bytes / 10


def test_a_torch_without_adafactor_is_refused_with_its_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(torch.optim, "Adafactor")
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(
        gg.TorchVersionError, match=r"optimizer=.adafactor.\) needs torch 2\.5 or newer"
    ) as error:
        gg.estimate(net, torch.ones(1, 2), optimizer="adafactor")
    assert torch.__version__ in str(error.value) and "Adafactor" in str(error.value)


def test_unknown_optimizers_are_refused_naming_adafactor() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(gg.InvalidOptionError, match=r"'adafactor'"):
        gg.estimate(net, torch.ones(1, 2), optimizer="lion")
