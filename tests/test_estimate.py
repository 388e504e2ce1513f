"""``gg.estimate``: memory per depth, planned on fake tensors, checked against real runs.

Saved bytes are compared with ``gg.audit`` on the real model (model totals), gradient and
optimizer bytes with what a real ``backward`` and ``optimizer.step()`` allocate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from models import bert, cnn_with_batchnorm, gpt2, llama
from torch import nn

import gradgate as gg
from gradgate._plumbing.torch_internals import TORCH_RELEASE

GiB = 1024**3


def padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with an attention mask that hides the first token of row 0."""
    mask = torch.ones_like(batch["input_ids"])
    mask[0, 0] = 0
    return {**batch, "attention_mask": mask}


def audited_saved_bytes(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], depth: int
) -> int:
    with gg.backprop_depth(model, depth), gg.audit(model) as report:
        out = model(*args, **kwargs)
        tensor = out if isinstance(out, torch.Tensor) else out[0]
        tensor.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return int(report.totals["saved_bytes"])


TRANSFORMERS = {"gpt2": gpt2, "llama": llama, "bert": bert}


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_saved_bytes_equal_the_audit_at_every_depth_on_transformers(name: str) -> None:
    model, batch, _ = TRANSFORMERS[name]()
    batch = padded(batch)
    n = len(gg.blocks(model))
    plan = gg.estimate(model, **batch, depths=range(n + 1))
    assert [row.depth for row in plan.rows] == list(range(n + 1))
    for depth in range(n + 1):
        assert plan[depth].saved_bytes == audited_saved_bytes(model, (), batch, depth), depth
    assert plan[0].saved_bytes < plan[n].saved_bytes


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_without_a_mask_the_saved_bytes_are_exact(name: str) -> None:
    # Integer inputs stay real in the plan, so transformers sees that the batch has no
    # padding and skips the causal mask, as on real data (it used to be built and saved).
    if name == "llama" and TORCH_RELEASE < (
        2,
        8,
    ):  # measured on 2.6 and 2.7: 12 kB under the audit at depth 3
        pytest.skip("before torch 2.8 the fake unmasked Llama attention saves less than the real")
    model, batch, _ = TRANSFORMERS[name]()
    plan = gg.estimate(model, **batch, depths=[0, 3])
    for depth in [0, 3]:
        assert plan[depth].saved_bytes == audited_saved_bytes(model, (), batch, depth), depth


def test_with_a_cache_an_unpadded_llama_is_exact() -> None:
    # With a cache object transformers skips the packed-sequence check that needs values.
    model, batch, _ = llama()
    model.config.use_cache = True
    plan = gg.estimate(model, **batch, depths=[0, 2, 3])
    for row in plan.rows:
        assert row.saved_bytes == audited_saved_bytes(model, (), batch, row.depth), row.depth


def test_saved_bytes_equal_the_audit_on_a_cnn_in_train_mode() -> None:
    model, x, _ = cnn_with_batchnorm()
    plan = gg.estimate(model, x)
    assert [row.depth for row in plan.rows] == [0, 1, 2, 4]
    assert (plan[0].saved_bytes, plan[0].grad_bytes) == (0, 0)  # the head is block 3: no graph
    for row in plan.rows[1:]:
        assert row.saved_bytes == audited_saved_bytes(model, (x,), {}, row.depth), row.depth


def test_default_depths_double_up_to_all_blocks() -> None:
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(11)])
    plan = gg.estimate(net, torch.randn(2, 4))
    assert [row.depth for row in plan.rows] == [0, 1, 2, 4, 8, 11]


def real_step_bytes(
    model: nn.Module, batch: dict[str, torch.Tensor], depth: int, optimizer: str
) -> tuple[int, int]:
    """Gradient bytes after backward, optimizer-state bytes after one step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
        "adam": lambda: torch.optim.Adam(params, lr=1e-3),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3),
        "sgd_momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    }[optimizer]()
    with gg.backprop_depth(model, depth):
        model(**batch).logits.float().sum().backward()
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    opt.step()
    state = sum(
        t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    )
    model.zero_grad(set_to_none=True)
    return grads, state


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd", "sgd_momentum"])
def test_grad_and_optimizer_bytes_equal_a_real_step(optimizer: str) -> None:
    model, batch, _ = gpt2()
    plan = gg.estimate(model, **batch, depths=[0, 1, 3], optimizer=optimizer)
    for row in plan.rows:
        grads, state = real_step_bytes(model, batch, row.depth, optimizer)
        assert (row.grad_bytes, row.optimizer_bytes) == (grads, state), row
        assert row.grad_bytes > 0
    assert plan[0].param_bytes == sum(p.nbytes for p in model.parameters())


class TwoHeads(nn.Module):
    """A forward that returns two tensors, each from its own head (policy and value, say)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.policy = nn.Linear(4, 3)
        self.value = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.policy(x), self.value(x)


def test_the_learners_of_every_output_count_not_only_the_first() -> None:
    """Gradient and optimizer bytes of a two-head model equal a real step's, where the loss
    sums both outputs: each head learns, at every depth."""
    model, x = TwoHeads(), torch.randn(5, 4)
    plan = gg.estimate(model, x, depths=[0, 1, 3], optimizer="adam")
    for row in plan.rows:
        with gg.backprop_depth(model, row.depth):
            policy, value = model(x)
            (policy.sum() + value.sum()).backward()
        grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        learners = sum(p.grad is not None for p in model.parameters())
        model.zero_grad(set_to_none=True)
        assert row.grad_bytes == grads, row
        assert row.optimizer_bytes == 2 * grads + 4 * learners, row
    assert plan[0].grad_bytes == (4 * 3 + 3 + 4 + 1) * 4  # both heads: 80 bytes, not 60 or 20


def test_a_meta_model_gives_the_same_rows_as_the_real_one() -> None:
    real, batch, _ = llama()
    with torch.device("meta"):
        meta, _, _ = llama()
    meta_batch = {k: v.to("meta") for k, v in batch.items()}
    # a meta model is planned for CUDA by default: ask for the CPU's rules to compare
    assert gg.estimate(meta, **meta_batch, device="cpu").rows == gg.estimate(real, **batch).rows
    assert all(p.is_meta for p in meta.parameters())


def test_the_model_is_left_untouched() -> None:
    model, batch, _ = gpt2()
    before = {n: (p.dtype, p.requires_grad, p.clone()) for n, p in model.named_parameters()}
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    gg.estimate(model, **batch, dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        dtype, requires_grad, value = before[name]
        assert (p.dtype, p.requires_grad, p.grad) == (dtype, requires_grad, None)
        assert torch.equal(p, value)
    assert hooks == sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_dtype_bf16_matches_a_bf16_model() -> None:
    model, batch, _ = gpt2()
    plan = gg.estimate(model, **padded(batch), dtype="bf16", depths=[1])
    real = model.to(torch.bfloat16)
    assert plan[1].param_bytes == sum(p.nbytes for p in real.parameters())
    assert plan[1].saved_bytes == audited_saved_bytes(real, (), padded(batch), 1)
    grads, state = real_step_bytes(real, batch, 1, "adamw")
    assert (plan[1].grad_bytes, plan[1].optimizer_bytes) == (grads, state)


def test_frozen_parameters_get_no_gradient_bytes() -> None:
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    net[2].weight.requires_grad_(False)
    plan = gg.estimate(net, torch.randn(2, 4), depths=[1], optimizer="sgd")
    assert plan[1].grad_bytes == net[2].bias.nbytes


def test_learning_sets_give_one_row_each() -> None:
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    plan = gg.estimate(net, torch.randn(3, 8), learn=[{1}, {1, 3}], optimizer="sgd_momentum")
    one, two = plan[{1}], plan[frozenset({1, 3})]
    assert (one.depth, one.learn) == (None, frozenset({1}))
    layer = sum(p.nbytes for p in net[1].parameters())
    assert (one.grad_bytes, one.optimizer_bytes) == (layer, layer)
    assert two.grad_bytes == 2 * layer
    assert plan.fits(10**9) == frozenset({1, 3})
    assert plan.fits(1) is None


def test_fits_picks_the_largest_depth_under_the_budget() -> None:
    model, batch, _ = gpt2()
    plan = gg.estimate(model, **batch, depths=range(4))
    peaks = [row.peak_bytes for row in plan.rows]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4
    assert plan.fits(peaks[2], headroom=0) == 2
    assert plan.fits(peaks[2] - 1, headroom=0) == 1
    assert plan.fits(f"{peaks[3]}B", headroom=0) == 3
    assert plan.fits("24GiB") == 3
    assert plan.fits(peaks[0] - 1, headroom=0) is None
    assert plan.fits("0.001 KiB") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * GiB),
        ("24 GB", 24 * 10**9),
        ("1.5MiB", 3 * 2**19),
        ("512", 512),
        ("2kb", 2000),
    ],
)
def test_budget_strings(text: str, expected: int) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    plan = gg.estimate(net, torch.randn(1, 2))
    peak = plan[2].peak_bytes
    assert plan.fits(text, headroom=0) == (2 if expected >= peak else None)
    from gradgate._memory.budget import parse_bytes

    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (2**20 - 1, "1.00 MiB"),  # not "1024.00 KiB"
        (2**20 - 6, "1023.99 KiB"),
        (3 * 2**29, "1.50 GiB"),
        (2**40 - 1, "1.00 TiB"),
        (2**50, "1024.00 TiB"),
    ],
)
def test_bytes_are_written_with_the_unit_their_rounded_value_needs(size: int, text: str) -> None:
    from gradgate._memory.memory_plan import format_bytes

    assert format_bytes(size) == text


def test_table_json_and_html() -> None:
    model, batch, _ = gpt2()
    plan = gg.estimate(model, **batch, depths=[0, 3])
    table = plan.table()
    assert "GPT2LMHeadModel" in table and "adamw" in table and "planned for cpu" in table
    lines = table.splitlines()
    header = lines[2].split()
    assert header == ["depth", "params", "grads", "optimizer", "saved", "other", "peak", "phase"]
    assert lines[5].split()[:3] == ["3", "(all", "blocks)"]
    assert lines[-1].startswith("all blocks: what runs before the first block")
    assert len(lines) == 3 + 1 + 2 + 1
    data = json.loads(plan.to_json())
    assert data["model"] == "GPT2LMHeadModel" and data["optimizer"] == "adamw"
    assert (data["amp"], data["masters"], data["device"]) == (None, None, "cpu")
    assert data["rows"][1] == {
        "depth": 3,
        "learn": None,
        "param_bytes": plan[3].param_bytes,
        "grad_bytes": plan[3].grad_bytes,
        "optimizer_bytes": plan[3].optimizer_bytes,
        "saved_bytes": plan[3].saved_bytes,
        "other_bytes": plan[3].other_bytes,
        "peak_bytes": plan[3].peak_bytes,
        "peak_phase": plan[3].peak_phase,
    }
    assert plan[3].peak_phase in ("forward", "backward", "step") and plan[3].other_bytes > 0
    html = plan._repr_html_()
    assert html.startswith("<table") and html.count("<tr>") == 3 and "peak" in html
    assert "<td>" + plan[3].peak_phase + "</td>" in html


def test_bad_input_names_the_value_and_the_fix() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    x = torch.randn(1, 2)
    with pytest.raises(gg.InvalidOptionError, match=r"optimizer='lion'.*'adamw'"):
        gg.estimate(net, x, optimizer="lion")
    with pytest.raises(gg.InvalidDepthError, match=r"depth 5 is out of range.*0\.\.2"):
        gg.estimate(net, x, depths=[1, 5])
    with pytest.raises(gg.InvalidDepthError, match=r"depths=\[None\].*learn="):
        gg.estimate(net, x, depths=[None])
    with pytest.raises(gg.InvalidOptionError, match=r"dtype='fp12'.*'bf16'"):
        gg.estimate(net, x, dtype="fp12")
    with pytest.raises(gg.UnknownModuleError, match=r"torch.nn.Module"):
        gg.estimate("net", x)  # type: ignore[arg-type]
    plan = gg.estimate(net, x)
    with pytest.raises(gg.InvalidOptionError, match=r"'24 gigs'.*'24GiB'"):
        plan.fits("24 gigs")
    with pytest.raises(gg.InvalidOptionError, match=r"-1"):
        plan.fits(-1)
    with pytest.raises(gg.InvalidDepthError, match=r"no row for depth 1.*\[0, 2\]"):
        gg.estimate(net, x, depths=[0, 2])[1]


LLAMA_70B = """
import json, resource, sys, time
import torch, gradgate as gg
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672,
                     num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                     max_position_embeddings=8192, use_cache=False)
with torch.device("meta"):
    model = LlamaForCausalLM(config)
ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
start = time.perf_counter()
plan = gg.estimate(model, input_ids=ids, labels=ids, dtype=torch.bfloat16)
seconds = time.perf_counter() - start
print(plan.table())
print(json.dumps({"seconds": seconds, "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "fits_80GiB": plan.fits("80GiB"), "rows": json.loads(plan.to_json())["rows"]}))
"""


@pytest.mark.slow
def test_a_70b_llama_is_planned_in_a_minute_in_2_gib() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(gg.__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LLAMA_70B)],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["seconds"] < 60
    assert result["rss_kib"] < 2 * 1024 * 1024
    full = result["rows"][-1]
    assert full["depth"] == 80
    assert full["param_bytes"] == 2 * 70_553_706_496  # Llama-3-70B's parameter count, bf16
    assert full["optimizer_bytes"] == 2 * full["grad_bytes"] + 4 * (80 * 9 + 2)
    # the whole step: AdamW's foreach temporary (the meta model is planned for CUDA) on top
    parts = full["param_bytes"] + full["grad_bytes"] + full["optimizer_bytes"]
    assert full["peak_phase"] == "step" and full["peak_bytes"] >= parts + full["grad_bytes"]


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x if x.sum() > 0 else -x)


class ValueShaped(ReadsValues):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x[x > 0].reshape(-1, 2))


@pytest.mark.parametrize("model", [ReadsValues(), ValueShaped()], ids=["item", "nonzero"])
def test_a_forward_that_reads_values_is_explained(model: nn.Module) -> None:
    with pytest.raises(gg.EstimateError, match=r"ReadsValues|ValueShaped") as error:
        gg.estimate(model, torch.randn(1, 2))
    assert "fake tensors" in str(error.value) and "gg.audit" in str(error.value)
    assert "its forward needs tensor values" in str(error.value)
    assert isinstance(error.value.__cause__, RuntimeError)


class _ScaledBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2 if grad.sum().item() > 0 else grad


class ReadsValuesInBackward(ReadsValues):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaledBackward.apply(self.layers(x))


class ReadsValuesInStep(torch.optim.Optimizer):
    """A step that reads a tensor value: the planner cannot run it on fake tensors."""

    def __init__(self, params: Any, lr: float = 1e-3, foreach: bool = False) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / max(1.0, p.grad.norm().item()))


def test_a_backward_that_reads_values_names_the_backward() -> None:
    with pytest.raises(gg.EstimateError, match="ReadsValuesInBackward") as error:
        gg.estimate(ReadsValuesInBackward(), torch.randn(1, 2))
    message = str(error.value)
    assert "its backward needs tensor values" in message and "forward needs" not in message
    assert "gg.audit" in message


def test_an_optimizer_step_that_reads_values_names_the_step_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradgate._memory import options

    monkeypatch.setitem(options._OPTIMIZERS, "reads", options.PlannedOptimizer(ReadsValuesInStep))
    with pytest.raises(gg.EstimateError) as error:
        gg.estimate(
            nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), torch.ones(1, 2), optimizer="reads"
        )
    message = str(error.value)
    assert "optimizer step" in message and "forward" not in message, message
    assert "ReadsValuesInStep.step() reads tensor values" in message
    assert "'adamw'" in message and "'sgd'" in message  # the planner's own
    assert "gradgate/_memory/options.py" in message  # where the rules are written
    assert "FakeTensorMode" in (options.__doc__ or "") and ".item()" in (options.__doc__ or "")


def test_every_planner_optimizer_is_documented() -> None:
    """Each name of the planner's optimizers (an alias of an earlier one aside) is in
    gg.estimate's docstring and in the CLI's options on docs/depth-fits.md."""
    from gradgate._memory.options import OPTIMIZERS, planned_optimizer

    page = (Path(__file__).parents[1] / "docs" / "depth-fits.md").read_text()
    cli_options = page.split("`--optimizer` (")[1].split(")")[0]
    seen: list[object] = []
    for name in OPTIMIZERS:
        entry = planned_optimizer(name)
        if entry in seen:
            continue  # "momentum": "sgd_momentum" again
        seen.append(entry)
        assert f'``"{name}"``' in (gg.estimate.__doc__ or ""), name
        assert f"`{name}`" in cli_options, name
