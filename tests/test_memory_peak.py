"""``row.peak_bytes`` against the live bytes of real training steps, counted by following
storages (``tests/live_bytes.py``, not gradgate's accounting): every row within 5%, and in fact
to the byte on these models. The real loop is what the plan simulates: two steps (forward with
the loss, output dropped, backward, optimizer step, ``zero_grad(set_to_none=True)``), AdamW
with torch's CPU default (a for-loop), counted from before the first forward.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from live_bytes import LiveBytes
from models import bert, cnn_with_batchnorm, gpt2, llama
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradgate as gg
from gradgate._memory.estimate import StepPlanner
from gradgate._plumbing.torch_internals import TORCH_RELEASE

Optimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def adamw_loop(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def real_peak(
    model: nn.Module,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    depth: int | None = None,
    amp: torch.dtype | None = None,
    optimizer: Optimizer = adamw_loop,
    round_to: int = 1,
) -> tuple[int, str]:
    """The largest live bytes of two real steps at ``depth`` (None: no cut), and its phase."""
    kwargs = kwargs or {}
    gate = gg.BackpropGate(model, depth=depth)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    with warnings.catch_warnings():
        # a tied embedding before the cut and the head after it: how it trains, not its bytes
        warnings.simplefilter("ignore", gg.SharedParameterWarning)
        return _two_steps(model, args, kwargs, gate, opt, amp, round_to)


def _two_steps(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    gate: gg.BackpropGate,
    opt: torch.optim.Optimizer,
    amp: torch.dtype | None,
    round_to: int,
) -> tuple[int, str]:
    try:
        with LiveBytes(model, args, kwargs, round_to=round_to) as counter:
            for _ in range(2):
                counter.phase = "forward"
                with torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext():
                    out = model(*args, **kwargs)
                    loss = out.sum() if isinstance(out, torch.Tensor) else out.loss
                    loss = out.logits.sum() if loss is None else loss  # no labels
                del out
                counter.phase = "backward"
                loss.backward()
                del loss
                counter.phase = "step"
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        gate.remove()
    return counter.peak, counter.peak_phase


def assert_every_row_is_the_real_peak(
    plan: gg.MemoryPlan, model: nn.Module, args: tuple[Any, ...] = (), **kwargs: Any
) -> None:
    amp = {"bfloat16": torch.bfloat16, None: None}[plan.amp]
    for row in plan.rows:
        real, phase = real_peak(model, args, kwargs, depth=row.depth, amp=amp)
        assert abs(row.peak_bytes / real - 1) <= 0.05, (row, real)
        assert (row.peak_bytes, row.peak_phase) == (real, phase), (row, real, phase)


def lm_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**batch, "labels": batch["input_ids"]}


@pytest.mark.parametrize(("name", "depths"), [("gpt2_tied", [1, 3]), ("llama", [0, 1, 3])])
def test_every_depth_of_a_language_model_is_the_real_peak(name: str, depths: list[int]) -> None:
    model, batch, _ = gpt2(tied=True) if name == "gpt2_tied" else llama()
    plan = gg.estimate(model, **lm_batch(batch), depths=depths)
    assert_every_row_is_the_real_peak(plan, model, **lm_batch(batch))
    assert {row.peak_phase for row in plan.rows} <= {"forward", "backward", "step"}


def test_bert_with_padding_in_train_mode() -> None:
    model, batch, _ = bert()
    mask = torch.ones_like(batch["input_ids"])
    mask[0, :4] = 0
    inputs = {**batch, "attention_mask": mask, "labels": torch.tensor([0, 2])}
    plan = gg.estimate(model.train(), **inputs, depths=[1, 3])
    assert_every_row_is_the_real_peak(plan, model, **inputs)


def test_a_cnn_with_batchnorm() -> None:
    model, x, _ = cnn_with_batchnorm()
    plan = gg.estimate(model, x, depths=[1, 4])
    assert_every_row_is_the_real_peak(plan, model, (x,))


def test_the_loss_transients_are_other_bytes_at_a_backward_peak() -> None:
    """A 2k vocabulary: the float32 log-softmax of the loss and its gradients are the peak, at
    the start of backward (what the old plan left out: 'two float32 logits')."""
    model, _, _ = llama(layers=2)
    model.resize_token_embeddings(2048)
    ids = torch.randint(0, 2048, (4, 32))
    plan = gg.estimate(model, input_ids=ids, labels=ids, depths=[0])
    logits = ids.numel() * 2048 * 4
    row = plan[0]
    assert row.peak_phase == "backward" and row.other_bytes >= 2 * logits
    parts = row.param_bytes + row.grad_bytes + row.optimizer_bytes + row.saved_bytes
    assert row.peak_bytes > parts + logits
    assert_every_row_is_the_real_peak(plan, model, input_ids=ids, labels=ids)


def test_a_small_mlp_peaks_in_the_optimizer_step() -> None:
    net = nn.Sequential(*[nn.Linear(128, 128) for _ in range(3)])
    x = torch.randn(4, 128)
    plan = gg.estimate(net, x, depths=[3])
    assert plan[3].peak_phase == "step"
    weight = 128 * 128 * 4  # AdamW's for-loop: sqrt(exp_avg_sq), then divided, per parameter
    assert 2 * weight <= plan[3].other_bytes < 2 * weight + 1024
    assert_every_row_is_the_real_peak(plan, net, (x,))


def test_hf_gradient_checkpointing_recomputes_in_backward() -> None:
    model, batch, _ = gpt2(layers=4)
    model.train().gradient_checkpointing_enable({"use_reentrant": False})
    plan = gg.estimate(model, **lm_batch(batch), depths=[2, 4])
    assert_every_row_is_the_real_peak(plan, model, **lm_batch(batch))
    model.gradient_checkpointing_disable()
    plain = gg.estimate(model, **lm_batch(batch), depths=[4])
    assert plan[4].saved_bytes < plain[4].saved_bytes


def test_hf_reentrant_checkpointing_without_a_cut() -> None:
    model, batch, _ = gpt2(layers=2)
    model.train().gradient_checkpointing_enable({"use_reentrant": True})
    with StepPlanner(model, (), lm_batch(batch)) as planner:
        full = planner.row(None)
    assert full.peak_bytes == real_peak(model, kwargs=lm_batch(batch), depth=None)[0]


class CheckpointedStack(nn.Module):
    """Four MLP blocks run through ``torch.utils.checkpoint`` in train mode."""

    def __init__(self, *, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)
        )
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant) if self.training else block(x)
        return self.head(x)


def test_torch_utils_checkpoint_recomputes_in_backward() -> None:
    model, x = CheckpointedStack(reentrant=False), torch.randn(32, 64)
    plan = gg.estimate(model, x, depths=[1, 4])
    assert_every_row_is_the_real_peak(plan, model, (x,))
    reentrant = CheckpointedStack(reentrant=True)
    with StepPlanner(reentrant, (torch.randn(32, 64, requires_grad=True),), {}) as planner:
        full = planner.row(None)
    x = torch.randn(32, 64, requires_grad=True)
    assert full.peak_bytes == real_peak(reentrant, (x,), depth=None)[0]


def test_autocast_bf16_counts_the_weight_copies() -> None:
    model, batch, _ = llama()
    plan = gg.estimate(model, **lm_batch(batch), depths=[0, 3], amp="bf16")
    assert plan.amp == "bfloat16" and plan.dtype == "float32"
    assert_every_row_is_the_real_peak(plan, model, **lm_batch(batch))


class LoRA(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (hand-made; peft is not here)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.T) @ self.b.T


def test_lora_adapters_learn_alone() -> None:
    model, batch, _ = llama()
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
    plan = gg.estimate(model, **lm_batch(batch), depths=[3])
    adapters = sum(p.nbytes for n, p in model.named_parameters() if n.endswith((".a", ".b")))
    assert plan[3].grad_bytes == adapters
    assert_every_row_is_the_real_peak(plan, model, **lm_batch(batch))


def mixtral(dtype: torch.dtype) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=97,
        max_position_embeddings=32,
        use_cache=False,
    )
    return MixtralForCausalLM(config).to(dtype)


@pytest.mark.skipif(
    TORCH_RELEASE < (2, 11), reason="transformers reads grouped_mm's data pointers before 2.11"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_mixture_of_experts(dtype: torch.dtype) -> None:
    """transformers' grouped expert products: float32 too, which torch's meta kernel refuses."""
    model = mixtral(dtype)
    assert model.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    plan = gg.estimate(model, input_ids=ids, labels=ids, depths=[2])
    assert_every_row_is_the_real_peak(plan, model, input_ids=ids, labels=ids)


def test_cuda_rules_plan_foreach_temporaries_and_512_byte_blocks() -> None:
    """device="cuda": AdamW's foreach step (torch's CUDA default) and storages rounded up to
    512 bytes; the step counts stay in host memory. Checked with foreach on the CPU."""
    net = nn.Sequential(*[nn.Linear(96, 96) for _ in range(3)])
    x = torch.randn(4, 96)
    cuda, cpu = (gg.estimate(net, x, depths=[3], device=d)[3] for d in ("cuda", "cpu"))
    assert cuda.peak_phase == cpu.peak_phase == "step"
    learners = [p for p in net.parameters()]

    def foreach(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)

    real, _ = real_peak(net, (x,), depth=3, optimizer=foreach, round_to=512)
    assert cuda.peak_bytes == real - 512 * len(learners)  # minus the step counts
    assert cuda.other_bytes > cpu.other_bytes  # a learner-sized foreach temporary, at least


def test_prefix_replay_gives_the_same_rows_to_the_byte() -> None:
    model, batch, _ = llama()
    rows = []
    for replay in (True, False):
        with StepPlanner(model, (), lm_batch(batch), replay=replay) as planner:
            rows.append([planner.row(depth) for depth in (0, 1, 3)])
    assert rows[0] == rows[1]


def test_a_full_fine_tune_row_learns_the_embeddings() -> None:
    model, batch, _ = llama()
    with StepPlanner(model, (), lm_batch(batch)) as planner:
        full, top = planner.row(None), planner.row(3)
    embedding = model.model.embed_tokens.weight.nbytes
    assert (full.depth, full.learn, full.label) == (None, None, "full")
    assert full.grad_bytes == top.grad_bytes + embedding
    assert full.peak_bytes == real_peak(model, kwargs=lm_batch(batch), depth=None)[0]


def test_fp32_masters_of_a_bf16_llama_run_learner_masters() -> None:
    """masters="fp32" runs gg.optim.LearnerMasters in the simulated step: float32 masters and
    AdamW state for the learners only, and the masters' update temporaries."""
    model, batch, _ = llama()
    model = model.to(torch.bfloat16)
    plan = gg.estimate(model, **lm_batch(batch), depths=[1], masters="fp32")
    plain = gg.estimate(model, **lm_batch(batch), depths=[1])
    assert plan.masters == "fp32" and "fp32 masters" in plan.table().splitlines()[0]

    def masters(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return gg.optim.LearnerMasters(torch.optim.AdamW, params, lr=1e-3, foreach=False)

    for row in plan.rows:
        elements = row.grad_bytes // 2  # bf16 gradients: 2 bytes per learning element
        steps = plain[row.depth].optimizer_bytes - 2 * 2 * elements  # the step counts
        assert row.optimizer_bytes == 4 * elements * 3 + steps  # master, exp_avg, exp_avg_sq
        real, phase = real_peak(model, kwargs=lm_batch(batch), depth=row.depth, optimizer=masters)
        assert (row.peak_bytes, row.peak_phase) == (real, phase), row
