"""gg.audit: the seeds' wgrad/dgrad numbers, FLOPs by hand, no waste, no trace."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import models
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import FlopCounterMode

import gradgate as gg
from gradgate._plumbing.errors import AuditNotReadyError, NoBackwardWarning
from gradgate._plumbing.torch_internals import knows_saved_tensors_hooks


def _counts(report: gg.AuditReport) -> tuple[int, int]:
    return report.totals["wgrad"], report.totals["dgrad"]


def _conv_audit(n: int, frozen: int = 0) -> gg.AuditReport:
    model, x, loss_fn = models.conv_stack(n)
    for param in model[:frozen].parameters():
        param.requires_grad_(False)
    with gg.audit(model) as report:
        loss_fn(model, x).backward()
    return report


# -- the seeds -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "frozen", "expected"),
    [(10, 0, (10, 9)), (10, 9, (1, 0)), (10, 8, (2, 1)), (3, 0, (3, 2))],
)
def test_seed_conv_stack_counts(n: int, frozen: int, expected: tuple[int, int]) -> None:
    assert _counts(_conv_audit(n, frozen)) == expected


def test_seed_middle_layer_frozen_keeps_both_dgrads() -> None:
    model, x, loss_fn = models.conv_stack(3)
    model[1].requires_grad_(False)
    with gg.audit(model) as report:
        loss_fn(model, x).backward()
    assert _counts(report) == (2, 2)
    assert (report.module("1").wgrad, report.module("1").dgrad) == (0, 1)
    assert (report.module("0").wgrad, report.module("0").dgrad) == (1, 0)


def test_seed_backprop_depth_two() -> None:
    model, x, loss_fn = models.conv_stack(10)
    with (
        pytest.warns(NoBackwardWarning, match="ended without a backward pass"),
        gg.audit(model) as report,
        gg.backprop_depth(model, 2),
    ):
        loss = loss_fn(model, x)
    loss.backward()
    assert _counts(report) == (0, 0)  # the backward ran after the audit closed
    with gg.audit(model) as report:
        with gg.backprop_depth(model, 2):
            loss = loss_fn(model, x)
        loss.backward()
    assert _counts(report) == (2, 1)
    assert [r.name for r in report.modules if r.wgrad] == ["", "8", "9"]


def test_backward_only_audit_gives_the_same_counts_without_saved_bytes() -> None:
    model, x, loss_fn = models.conv_stack(10)
    model[:8].requires_grad_(False)
    loss = loss_fn(model, x)
    with gg.audit(model) as report:
        loss.backward()
    full = _conv_audit(10, 8)
    assert _counts(report) == (2, 1)
    assert report.totals["backward_flops"] == full.totals["backward_flops"]
    assert report.totals["saved_bytes"] == 0 and not report.forward_seen
    assert full.forward_seen


def test_outside_model_work_is_separate() -> None:
    report = _conv_audit(3)
    assert report.outside.dgrad == 1  # the loss's mean backward
    assert report.totals == {
        "wgrad": 3,
        "dgrad": 2,
        # conv i (input h×h, out o=h-2): one direction costs 2·N·Cout·o²·Cin·9 = 2·2·3·o²·27
        # = 324·o²; o = 22, 20, 18. wgrad on all three, dgrad on the last two:
        "backward_flops": 324 * (22**2 + 20**2 + 18**2) + 324 * (20**2 + 18**2),
        # each conv saves its input for its wgrad (weights are not counted): 2·3·h²·4 bytes
        # for h = 24, 22, 20
        "saved_bytes": 24 * (24**2 + 22**2 + 20**2),
    }


# -- FLOPs checked by hand -----------------------------------------------------------------------
def _audit_call(model: nn.Module, *inputs: torch.Tensor) -> gg.AuditReport:
    with gg.audit(model) as report:
        out = model(*inputs)
        (out if isinstance(out, torch.Tensor) else out[0]).sum().backward()
    return report


def test_linear_flops() -> None:
    report = _audit_call(nn.Linear(4, 6), torch.randn(3, 4, requires_grad=True))
    # dgrad (3×6)@(6×4): 2·3·6·4 = 144; wgrad (6×3)@(3×4): 2·6·3·4 = 144
    assert report.totals["backward_flops"] == 288
    assert _counts(report) == (1, 1)


def test_conv_flops_and_masked_outputs() -> None:
    conv = nn.Conv2d(2, 4, 3)
    report = _audit_call(conv, torch.randn(1, 2, 5, 5, requires_grad=True))
    # out 1×4×3×3; one direction 2·N·Cout·Ho·Wo·Cin·k² = 2·1·4·9·2·9 = 1296; dgrad + wgrad
    assert report.totals["backward_flops"] == 2 * 1296
    conv.weight.requires_grad_(False)
    report = _audit_call(conv, torch.randn(1, 2, 5, 5, requires_grad=True))
    # one convolution_backward op, output mask (input, -, bias): only the dgrad costs FLOPs
    assert report.totals["backward_flops"] == 1296
    assert _counts(report) == (1, 1)  # the bias gradient is still a wgrad


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


def test_scaled_dot_product_attention_flops() -> None:
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    report = _audit_call(_Attention(), q, k, v)
    # backward = 5 batched matmuls of 2·b·h·s·s·d = 2·1·2·4·4·8 = 512 each
    assert report.totals["backward_flops"] == 5 * 512
    assert _counts(report) == (0, 1)  # one node computes dq, dk, dv: one dgrad


def test_embedding_and_layer_norm() -> None:
    embedding = nn.Embedding(10, 4)
    report = _audit_call(embedding, torch.tensor([[1, 2, 3], [4, 5, 6]]))
    # a scatter-add of rows: no multiply-accumulate, 0 FLOPs by FlopCounterMode's rules;
    # the indices need no gradient: one wgrad, no dgrad
    assert (report.totals["backward_flops"], *_counts(report)) == (0, 1, 0)
    norm = nn.LayerNorm(8)
    report = _audit_call(norm, torch.randn(3, 8, requires_grad=True))
    # weight and bias from one native_layer_norm_backward node: one wgrad, one dgrad, 0 FLOPs
    assert (report.totals["backward_flops"], *_counts(report)) == (0, 1, 1)


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lin(x).chunk(2, dim=-1)  # a multi-output node: one SplitBackward
        return a * b


def test_multi_output_op_counts_once() -> None:
    report = _audit_call(_Gated(), torch.randn(3, 4))
    # addmm: wgrad only, x needs no grad: (6×3)@(3×4) = 2·6·3·4 = 144 FLOPs
    # dgrads: the split (one node, two outputs) and the product
    assert report.totals["backward_flops"] == 144
    assert _counts(report) == (1, 2)
    assert (report.module("lin").wgrad, report.module("lin").dgrad) == (1, 0)


def test_flops_match_flop_counter_mode() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, batch, loss_fn = models.gpt2(layers=2)
    # the math attention backend runs matmuls that both count; FlopCounterMode counts CPU
    # flash attention as 0, the audit counts it with the attention formula
    with sdpa_kernel(SDPBackend.MATH):
        loss = loss_fn(model, batch)
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        with gg.audit(model) as report:
            loss_fn(model, batch).backward()
    whole = report.totals["backward_flops"] + report.outside.backward_flops
    assert whole == counter.get_total_flops() > 0


# -- no waste: a gated model costs what the hand-written ideal costs -----------------------------
@contextlib.contextmanager
def _ideal(model: nn.Module, first_learning: nn.Module) -> Any:
    """Prefix under torch.no_grad, written by hand: entered at the model, left at the cut."""
    stack = contextlib.ExitStack()
    hooks = [
        model.register_forward_pre_hook(lambda m, a: stack.enter_context(torch.no_grad())),
        first_learning.register_forward_pre_hook(lambda m, a: stack.close()),
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _long_skip_ideal(model: Any, x: torch.Tensor, depth: int) -> torch.Tensor:
    n = len(model.blocks)
    first = n - depth
    with torch.set_grad_enabled(first == 0):
        h = model.stem(x)
    saved = []
    for i, block in enumerate(model.blocks):
        with torch.set_grad_enabled(i >= first):
            if i >= n // 2:
                h = h + saved[n - 1 - i]
            h = block(h)
        saved.append(h)
    return model.head(h).pow(2).mean()


def _sequential_ideal(model: nn.Sequential, x: torch.Tensor, depth: int) -> torch.Tensor:
    cut = len(model) - depth
    with torch.no_grad():
        h = model[:cut](x)
    return model[cut:](h).pow(2).mean()  # type: ignore[no-any-return]


def _audit_loss(model: nn.Module, run: Any) -> gg.AuditReport:
    with gg.audit(model) as report:
        run().backward()
    return report


def _whole(report: gg.AuditReport) -> dict[str, int]:
    """Model plus outside: a hand-written forward that bypasses the root module's own
    forward leaves the root's own ops (a skip addition) unattributed to it."""
    outside = report.outside
    return {
        "wgrad": report.totals["wgrad"] + outside.wgrad,
        "dgrad": report.totals["dgrad"] + outside.dgrad,
        "backward_flops": report.totals["backward_flops"] + outside.backward_flops,
        "saved_bytes": report.totals["saved_bytes"] + outside.saved_bytes,
    }


def _assert_same_cost(gated: gg.AuditReport, ideal: gg.AuditReport) -> None:
    assert _whole(gated) == _whole(ideal)
    assert gated.totals["backward_flops"] > 0


@pytest.mark.parametrize(("name", "depth"), [("gpt2", 1), ("gpt2", 2), ("llama", 1), ("bert", 2)])
def test_gated_transformer_costs_what_the_ideal_costs(name: str, depth: int) -> None:
    model, batch, loss_fn = models.REAL_MODELS[name]()
    names = gg.blocks(model)
    first = dict(model.named_modules())[names[len(names) - depth]]

    def gated() -> torch.Tensor:
        with gg.backprop_depth(model, depth):
            return loss_fn(model, batch)  # type: ignore[no-any-return]

    def ideal() -> torch.Tensor:
        with _ideal(model, first):
            return loss_fn(model, batch)  # type: ignore[no-any-return]

    gated_report, ideal_report = _audit_loss(model, gated), _audit_loss(model, ideal)
    assert gated_report.totals == ideal_report.totals
    _assert_same_cost(gated_report, ideal_report)
    full = _audit_loss(model, lambda: loss_fn(model, batch))
    assert full.totals["backward_flops"] > gated_report.totals["backward_flops"]
    assert full.totals["saved_bytes"] > gated_report.totals["saved_bytes"]


@pytest.mark.parametrize("depth", [1, 3])
def test_gated_cnn_costs_what_the_ideal_costs(depth: int) -> None:
    model, x, loss_fn = models.cnn_with_batchnorm()

    def gated() -> torch.Tensor:
        with gg.backprop_depth(model, depth):
            return loss_fn(model, x)  # type: ignore[no-any-return]

    ideal = _audit_loss(model, lambda: _sequential_ideal(model, x, depth))
    _assert_same_cost(_audit_loss(model, gated), ideal)


@pytest.mark.parametrize("depth", [2, 4])
def test_gated_long_skip_costs_what_the_ideal_costs(depth: int) -> None:
    model, x, loss_fn = models.long_skip()

    def gated() -> torch.Tensor:
        with gg.backprop_depth(model, depth):
            return loss_fn(model, x)  # type: ignore[no-any-return]

    ideal = _audit_loss(model, lambda: _long_skip_ideal(model, x, depth))
    _assert_same_cost(_audit_loss(model, gated), ideal)


# -- wasted work ---------------------------------------------------------------------------------
def test_late_freeze_is_reported_as_wasted() -> None:
    model, x, loss_fn = models.conv_stack(3)
    loss = loss_fn(model, x)
    model[0].requires_grad_(False)  # the seed 000 misconception: after the forward
    with gg.audit(model) as report:
        loss.backward()
    assert _counts(report) == (3, 2)  # autograd still computes it
    assert {(w.parameter, w.reason) for w in report.wasted} == {
        ("0.weight", "late_freeze"),
        ("0.bias", "late_freeze"),
    }
    # conv 0: out 22×22; wgrad 2·N·Cout·22²·Cin·9 = 2·2·3·484·27; the bias costs 0
    assert report.wasted_flops == 2 * 2 * 3 * 22**2 * 27
    assert model[0].weight.grad is None
    assert "0.weight: 156,816 FLOPs, requires_grad was turned off" in report.table()


def test_correct_freeze_reports_no_waste() -> None:
    model, x, loss_fn = models.conv_stack(3)
    model[0].requires_grad_(False)
    with gg.audit(model) as report:
        loss_fn(model, x).backward()
    assert report.wasted == [] and report.wasted_flops == 0
    assert _counts(report) == (2, 1)


def test_parameters_no_optimizer_holds_are_wasted() -> None:
    model, x, loss_fn = models.conv_stack(3)
    optimizer = torch.optim.SGD(model[1:].parameters(), lr=0.1)
    with gg.audit(model, optimizer=optimizer) as report:
        loss_fn(model, x).backward()
    assert {(w.parameter, w.reason) for w in report.wasted} == {
        ("0.weight", "not_in_optimizer"),
        ("0.bias", "not_in_optimizer"),
    }
    assert report.wasted_flops == 2 * 2 * 3 * 22**2 * 27


# -- no trace -------------------------------------------------------------------------------------
def _hook_state(model: nn.Module) -> list[tuple[int, ...]]:
    return [
        (
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            len(m._forward_hooks_always_called),
            len(m._backward_hooks),
        )
        for m in model.modules()
    ]


def test_hooks_removed_also_when_the_body_raises() -> None:
    model, x, loss_fn = models.conv_stack(3)
    before = _hook_state(model)
    with pytest.raises(ValueError, match="boom"), gg.audit(model):
        loss = loss_fn(model, x)
        raise ValueError("boom")
    assert _hook_state(model) == before
    assert _get_current_dispatch_mode() is None
    assert loss.grad_fn is not None
    loss.backward()  # the node hooks are gone too: a plain backward still works
    with gg.audit(model) as report:
        loss_fn(model, x).backward()
    assert _hook_state(model) == before and _counts(report) == (3, 2)


def test_report_lookup_error_names_the_module() -> None:
    report = _conv_audit(3)
    with pytest.raises(KeyError, match="no module 'nope' in this audit"):
        report.module("nope")


# -- FLOP formulas: gradgate's own where torch's fails ------------------------------------------
def _failing_formula(*args: Any, **kwargs: Any) -> int:
    raise AssertionError("sdpa_backward_flop_count: batch/heads mismatch among tensors")


def test_a_failing_torch_formula_falls_back_to_the_attention_formula(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.utils import flop_counter

    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    expected = _audit_call(_Attention(), q, k, v).totals["backward_flops"]
    assert expected == 5 * 512
    aten = torch.ops.aten
    for op in (
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention_backward,
    ):
        monkeypatch.setitem(flop_counter.flop_registry, op, _failing_formula)
    report = _audit_call(_Attention(), q, k, v)
    assert report.totals["backward_flops"] == expected
    assert "not counted" not in report.table()


def test_an_op_no_formula_can_count_is_named_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import flop_counter

    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.mm, _failing_formula)
    report = _audit_call(nn.Linear(4, 6, bias=False), torch.randn(3, 4, requires_grad=True))
    assert _counts(report) == (1, 1)
    assert report.totals["backward_flops"] == 0
    assert "backward FLOPs not counted for aten.mm" in report.table()
    assert gg.AuditReport.from_json(report.to_json()).table() == report.table()


def test_grouped_query_attention_llama_is_audited_like_flop_counter_mode() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, batch, loss_fn = models.llama(layers=1)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    with gg.audit(model) as report:
        loss_fn(model, batch).backward()
    assert report.totals["backward_flops"] > 0 and report.totals["wgrad"] > 0
    with sdpa_kernel(SDPBackend.MATH):
        loss = loss_fn(model, batch)
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        with gg.audit(model) as report:
            loss_fn(model, batch).backward()
    whole = report.totals["backward_flops"] + report.outside.backward_flops
    assert whole == counter.get_total_flops() > 0


# -- the kernel view through gg.audit ----------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_kernels_without_cuda_fail_at_the_call_before_any_hook() -> None:
    model, _, _ = models.conv_stack(3)
    before = _hook_state(model)
    with pytest.raises(gg.NoCudaError, match=r"kernels=True\) needs a CUDA device"):
        gg.audit(model, kernels=True)
    assert _hook_state(model) == before and _get_current_dispatch_mode() is None


def test_kernels_are_only_there_when_asked_for() -> None:
    report = _conv_audit(3)
    with pytest.raises(AuditNotReadyError, match=r"only with gg.audit\(model, kernels=True\)"):
        report.kernels  # noqa: B018


@pytest.mark.skipif(not torch.cuda.is_available(), reason="kernel names need a CUDA device")
def test_kernel_view_matches_the_node_counts_on_gpu() -> None:
    model, x, loss_fn = models.conv_stack(10)
    model, x = model.cuda(), x.cuda()
    loss_fn(model, x).backward()  # warm up cuDNN's algorithm choice
    model.zero_grad(set_to_none=True)
    with gg.audit(model, kernels=True) as report:
        loss_fn(model, x).backward()
    print(report.kernels.table())
    counts = report.kernels.counts
    assert (counts["wgrad"], counts["dgrad"]) == _counts(report) == (10, 9)
    assert counts["forward"] >= 10
    assert "Instances" in str(report.kernels)


# -- nested audits, reading too early, reuse, bad options ----------------------------------------
def test_nested_audits_both_count_saved_bytes() -> None:
    alone = _conv_audit(3)
    model, x, loss_fn = models.conv_stack(3)
    with gg.audit(model) as outer, gg.audit(model) as inner:
        loss_fn(model, x).backward()
    assert alone.totals["saved_bytes"] == 24 * (24**2 + 22**2 + 20**2)
    assert inner.totals == outer.totals == alone.totals


def test_audit_inside_user_saved_tensor_hooks_keeps_them_working() -> None:
    model, x, loss_fn = models.conv_stack(3)
    packed: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(1)
        return tensor.detach()

    if not knows_saved_tensors_hooks():  # torch 2.6: it cannot chain to them, and says so
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
            pytest.raises(gg.TorchVersionError, match=r"needs torch 2\.7 or newer"),
        ):
            gg.audit(model).__enter__()
        return
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        gg.audit(model) as report,
    ):
        loss_fn(model, x).backward()
    assert len(packed) > 0 and report.totals == _conv_audit(3).totals


def test_backward_after_the_block_is_said_in_the_table() -> None:
    model, x, loss_fn = models.conv_stack(3)
    with (
        pytest.warns(NoBackwardWarning, match=r"Call loss.backward\(\) inside"),
        gg.audit(model) as report,
    ):
        loss = loss_fn(model, x)
    loss.backward()
    table = report.table()
    assert "no backward ran inside this audit" in table
    assert "wasted gradients: none" not in table
    assert report.backward_seen is False and _counts(report) == (0, 0)
    assert report.totals["saved_bytes"] == 24 * (24**2 + 22**2 + 20**2)  # the forward counted
    assert "no backward ran inside this audit" in report._repr_html_()


def test_reading_a_report_before_it_ran_says_how_to_use_it() -> None:
    model, x, loss_fn = models.conv_stack(3)
    pending = gg.audit(model)
    assert isinstance(pending, gg.AuditReport)
    with pytest.raises(AuditNotReadyError, match=r"has not run: gg.audit\(model\) only prepares"):
        pending.table()
    with pytest.raises(AuditNotReadyError, match="has not run"):
        pending.totals  # noqa: B018
    assert "not run yet" in repr(pending) and "not run yet" in pending._repr_html_()
    with pending as report:
        with pytest.raises(AuditNotReadyError, match="still recording"):
            report.totals  # noqa: B018
        loss_fn(model, x).backward()
    assert _counts(report) == (3, 2)
    with pytest.raises(AuditNotReadyError, match="records once"), report:
        pass


def test_audit_is_typed_as_returning_the_public_report() -> None:
    import typing

    assert typing.get_type_hints(gg.audit)["return"] is gg.AuditReport


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer": "sgd"}, "gg.audit(optimizer=...) got str 'sgd'; expected a torch.optim"),
        ({"kernels": "yes"}, "gg.audit(kernels=...) got 'yes'; expected True or False"),
        ({"kernels": 1}, "gg.audit(kernels=...) got 1; expected True or False"),
    ],
)
def test_bad_options_fail_at_the_call_before_any_hook(kwargs: dict[str, Any], message: str) -> None:
    model, _, _ = models.conv_stack(3)
    before = _hook_state(model)
    with pytest.raises(gg.InvalidOptionError, match=re.escape(message)):
        gg.audit(model, **kwargs)
    assert _hook_state(model) == before and _get_current_dispatch_mode() is None


def test_a_model_that_is_not_a_module_is_refused() -> None:
    with pytest.raises(gg.InvalidOptionError, match=r"got function .*expected a torch.nn.Module"):
        gg.audit(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused attention kernels need CUDA")
def test_grouped_query_attention_llama_on_gpu() -> None:
    model, batch, loss_fn = models.llama(layers=1)
    model, batch = model.cuda(), {key: value.cuda() for key, value in batch.items()}
    with gg.audit(model) as plain:
        loss_fn(model, batch).backward()
    with gg.audit(model) as report, torch.autocast("cuda", dtype=torch.bfloat16):
        loss_fn(model, batch).backward()  # bf16: the fused (flash / efficient) kernels
    for audited in (plain, report):
        assert audited.totals["backward_flops"] > 0 and "not counted" not in audited.table()
    # autocast changes the graph (casts, fused attention), not which parameters learn
    assert report.totals["wgrad"] == plain.totals["wgrad"] == 12  # 7 linears, 2 norms, ...
