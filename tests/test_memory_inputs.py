"""``gg.estimate`` on inputs that used to crash or mislead: compiled models, masks without
padding, meta integer inputs, bad ``depths`` and options; ``fits`` with its headroom; and what
planning leaves behind (nothing)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from models import gpt2, llama
from test_estimate import ReadsValues
from test_memory_peak import real_peak
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import gradgate as gg
from gradgate._memory.budget import HEADROOM
from gradgate._plumbing.torch_internals import TORCH_RELEASE

COMPILED = """
import json, torch, gradgate as gg
torch.manual_seed(0)
net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
x = torch.randn(4, 16)
plain = gg.estimate(net, x).to_json()
wrapped = gg.estimate(torch.compile(net), x).to_json()
net.compile()
in_place = gg.estimate(net, x).to_json()
print(json.dumps([plain == wrapped, plain == in_place]))
"""


@pytest.mark.slow
def test_a_compiled_model_plans_the_module_it_wraps() -> None:
    """It used to kill the interpreter: Inductor ran compiled kernels on fake tensors."""
    env = {**os.environ, "PYTHONPATH": str(Path(gg.__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COMPILED)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [True, True]


def audited_saved_bytes(model: nn.Module, batch: dict[str, torch.Tensor], depth: int) -> int:
    with gg.backprop_depth(model, depth), gg.audit(model) as report:
        model(**batch).logits.sum().backward()
    model.zero_grad(set_to_none=True)
    return int(report.totals["saved_bytes"])


def test_an_unpadded_mask_is_planned_as_a_real_run_skips_it() -> None:
    """Transformers skips an all-ones mask (and builds none without one) by looking at the
    values: integer inputs stay real, so the plan sees them too (it was 6-7% high)."""
    model, batch, _ = llama()
    ones = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    with_ones = gg.estimate(model, **ones, depths=[3])
    without = gg.estimate(model, **batch, depths=[3])
    assert with_ones[3].saved_bytes == audited_saved_bytes(model, ones, 3)
    assert without[3].saved_bytes == audited_saved_bytes(model, batch, 3)
    assert with_ones[3].saved_bytes == without[3].saved_bytes
    assert with_ones[3].peak_bytes == real_peak(model, kwargs=ones, depth=3)[0]


def test_meta_integer_inputs_are_an_unpadded_batch() -> None:
    real, batch, _ = llama()
    with torch.device("meta"):
        meta, _, _ = llama()
    ids = batch["input_ids"]
    meta_inputs = {"input_ids": ids.to("meta"), "attention_mask": ids.to("meta")}
    planned = gg.estimate(meta, **meta_inputs, depths=[3], device="cpu")
    ones = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    assert planned.rows == gg.estimate(real, **ones, depths=[3]).rows
    assert all(p.is_meta for p in meta.parameters())


def test_a_meta_model_is_planned_for_cuda_and_a_cpu_model_for_the_cpu() -> None:
    net = nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 40))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 40))
    x = torch.randn(3, 40)
    assert (gg.estimate(net, x).device, gg.estimate(meta, x).device) == ("cpu", "cuda")
    rows = [gg.estimate(m, x, device="cuda")[2] for m in (net, meta)]
    assert rows[0] == rows[1] and rows[0].peak_bytes % 512 == 0


@pytest.mark.parametrize(
    ("depths", "message"),
    [
        (3, r"depths=3\) is not a list of depths.*depths=\[3\]"),
        ("2", r"depths='2'\) is not a list of depths.*depths=\[0, 1, 2\]"),
        ([], r"depths=\[\]\) plans no row.*depths=\[0, 1, 2\]"),
    ],
)
def test_depths_must_be_a_list_with_a_row(depths: object, message: str) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(gg.InvalidDepthError, match=message):
        gg.estimate(net, torch.randn(1, 2), depths=depths)  # type: ignore[arg-type]
    plan = gg.estimate(net, torch.randn(1, 2), depths=[], learn=[{1}])
    assert [row.label for row in plan.rows] == ["learn {1}"]


def test_bad_amp_masters_and_device_name_the_fix() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    x = torch.randn(1, 2)
    with pytest.raises(gg.InvalidOptionError, match=r"amp='fp8'.*'bf16' or 'fp16'"):
        gg.estimate(net, x, amp="fp8")
    with pytest.raises(gg.InvalidOptionError, match=r"masters='fp16'.*None or 'fp32'"):
        gg.estimate(net, x, masters="fp16")
    with pytest.raises(
        gg.InvalidOptionError, match=r"planned parameters are float32.*dtype='bf16'"
    ):
        gg.estimate(net, x, masters="fp32")
    with pytest.raises(gg.InvalidOptionError, match=r"device='tpu'.*'cuda' or 'cpu'"):
        gg.estimate(net, x, device="tpu")


def test_fits_adds_the_default_headroom_and_never_promises_more() -> None:
    net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)])
    cpu = gg.estimate(net, torch.randn(8, 256), depths=range(4))
    cuda = gg.estimate(net, torch.randn(8, 256), depths=range(4), device="cuda")
    assert HEADROOM == {"cuda": (512 * 2**20, 0.05), "cpu": (0, 0.05)}
    for plan in (cpu, cuda):
        peaks = [row.peak_bytes for row in plan.rows]
        assert peaks == sorted(peaks) and len(set(peaks)) == 4
        assert plan.fits(peaks[2], headroom=0) == 2
        assert plan.fits(peaks[2], headroom=1) == 1
        assert plan.fits(peaks[2] + plan.headroom_for(plan[2])) == 2
        assert plan.fits(peaks[2] + plan.headroom_for(plan[2]) - 1) == 1
        for budget in range(0, peaks[3] + 2**30, 2**24):
            best = plan.fits(budget)
            assert best is None or plan[best].peak_bytes + plan.headroom_for(plan[best]) <= budget
    assert cuda.headroom_for(cuda[0]) == 512 * 2**20 + cuda[0].peak_bytes // 20
    assert cpu.fits("512MiB") == 3 and cuda.fits("512MiB") is None
    assert cpu.fits(cpu[3].peak_bytes, headroom="1 KiB") == 2


def test_planning_leaves_nothing_behind_even_when_it_fails() -> None:
    model, batch, _ = gpt2()
    flags = [p.requires_grad for p in model.parameters()]
    for run in (
        lambda: gg.estimate(model, **batch, depths=[1]),
        lambda: gg.estimate(ReadsValues(), torch.randn(1, 2)),
    ):
        with contextlib.suppress(gg.EstimateError):
            run()
        assert _get_current_dispatch_mode() is None
        assert gc.isenabled() and gc.get_freeze_count() == 0
        assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(gg.EstimateError, match="ReadsValues"):
        gg.estimate(ReadsValues(), torch.randn(1, 2))


def test_a_program_that_froze_objects_keeps_them_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    net, x = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), torch.randn(1, 2)
    gg.estimate(net, x)
    assert calls == ["freeze", "unfreeze"]  # the twin is left out of the collector's scans
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 7)  # the program froze objects
    gg.estimate(net, x)
    assert calls == ["freeze", "unfreeze"]


@pytest.mark.skipif(
    TORCH_RELEASE < (2, 8), reason="before torch 2.8 fake unmasked attention saves otherwise"
)
def test_without_torch_s_mode_switch_integers_stay_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback where torch cannot run an op below its modes: every tensor stays fake, and
    transformers builds the causal mask a real unpadded run skips (a little high, never low)."""
    from gradgate._plumbing.torch_internals import planner

    model, batch, _ = llama()
    exact = gg.estimate(model, **batch, depths=[3])[3]
    monkeypatch.setattr(planner, "DISABLE_MODES", None)
    fallback = gg.estimate(model, **batch, depths=[3])[3]
    mask = 2 * 12 * 12 * 4  # (batch, 1, seq, seq) float32, saved by each learning layer
    assert fallback.saved_bytes == exact.saved_bytes + 3 * mask
    assert fallback.peak_bytes > exact.peak_bytes


@pytest.mark.parametrize(
    ("keyword", "option"),
    [("mastres", "masters"), ("depth", "depths"), ("optimiser", "optimizer"), ("Dtype", "dtype"),
     ("torch_dtype", "dtype"), ("learning", "learn"), ("block", "blocks"), ("devices", "device")],
)  # fmt: skip
def test_a_misspelt_option_is_refused_with_the_option_it_resembles(
    keyword: str, option: str
) -> None:
    """A transformers model takes any keyword (**kwargs) and drops what it does not know:
    masters="fp32" misspelt planned no masters (213,804 optimizer bytes instead of 641,324)."""
    model, batch, _ = llama()
    model = model.to(torch.bfloat16)
    ids = batch["input_ids"]
    with pytest.raises(gg.InvalidOptionError) as error:
        gg.estimate(model, ids, labels=ids, depths=[1], **{keyword: "fp32"})
    message = str(error.value)
    assert f"{keyword}=" in message and f"did you mean {option}=" in message, message
    assert "forward" in message  # the rule: what the model's forward names goes to it


class TakesADepth(nn.Module):
    """A forward that names a keyword close to an option: it is the model's, and goes to it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor, depth: int = 2, **kwargs: object) -> torch.Tensor:
        return self.layers[:depth](x)


def test_example_keywords_the_forward_names_go_to_the_model() -> None:
    model, x = TakesADepth(), torch.randn(3, 4)
    one = gg.estimate(model, x, depth=1, depths=[2])
    two = gg.estimate(model, x, depths=[2])
    assert one[2].grad_bytes < two[2].grad_bytes  # depth=1 ran one layer: it reached forward
    with pytest.raises(gg.InvalidOptionError, match=r"mastres=.*did you mean masters="):
        gg.estimate(model, x, mastres="fp32")  # **kwargs does not name it
    llama_model, batch, _ = llama()
    ids = batch["input_ids"]
    mask, positions = torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids)
    plan = gg.estimate(llama_model, input_ids=ids, labels=ids, attention_mask=mask,
                       position_ids=positions, use_cache=False, depths=[1])  # fmt: skip
    assert plan[1].peak_bytes > 0


@pytest.mark.parametrize("model", ["llama", "mlp"])
def test_no_example_batch_asks_for_one(model: str) -> None:
    net = llama()[0] if model == "llama" else nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(gg.EstimateError, match=r"give an example batch") as error:
        gg.estimate(net)
    assert type(net).__name__ in str(error.value)
    assert isinstance(error.value.__cause__, (TypeError, ValueError))
