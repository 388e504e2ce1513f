"""Each fallback of gradgate._plumbing.torch_internals, forced on the installed torch: what a
torch without the private API gets is exact (gradients equal plain autograd), or a
TorchVersionError."""

from __future__ import annotations

import collections
import copy
import re
from typing import Any, NamedTuple

import models
import pytest
import torch
from torch import nn

import gradgate as gg
from gradgate._plumbing import torch_internals as internals
from gradgate._plumbing.autograd import StorageBytes, observe_saved
from gradgate._plumbing.torch_internals import planner, trees


def _plain_grads(model: nn.Module, loss_fn: Any, batch: Any) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss_fn(model, batch), list(params.values()), allow_unused=True)
    return {n: g for (n, _), g in zip(params.items(), grads, strict=True) if g is not None}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


# -- pytree ------------------------------------------------------------------------------------
class Pair(NamedTuple):
    a: Any
    b: Any


def test_pytree_fallback_rebuilds_every_container(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trees, "PYTREE", None)
    t = [torch.ones(1) * i for i in range(5)]
    value = (
        t[0],
        [t[1], {"x": t[2], "y": "text"}],
        Pair(t[3], None),
        collections.OrderedDict(z=t[4]),
    )
    leaves, spec = trees.tree_flatten(value)
    assert [leaf is v for leaf, v in zip(leaves, [*t[:3], "text", t[3], None, t[4]], strict=True)]
    doubled = trees.tree_unflatten(
        [x * 2 if isinstance(x, torch.Tensor) else x for x in leaves], spec
    )
    assert type(doubled[2]) is Pair and type(doubled[3]) is collections.OrderedDict
    assert doubled[1][1]["y"] == "text" and doubled[2].b is None
    torch.testing.assert_close(doubled[1][1]["x"], t[2] * 2)


def test_pytree_fallback_gate_and_capture_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trees, "PYTREE", None)
    model, batch, loss_fn = models.gpt2(layers=3)  # dict batch, ModelOutput outputs
    want = _plain_grads(model, loss_fn, batch)
    with gg.BackpropGate(model) as gate, gg.capture_grads(model, "transformer.h.2") as captured:
        gate.depth = None
        loss_fn(model, batch).backward()
        assert captured["transformer.h.2"] is not None
        _assert_equal(_grads(model), want)
        model.zero_grad(set_to_none=True)
        gate.depth = 1  # the last block and what follows it learn
        loss_fn(model, batch).backward()
    got = _grads(model)
    assert got and not any(name.startswith("transformer.h.0.") for name in got)
    _assert_equal(got, {name: want[name] for name in got})


@pytest.mark.parametrize("flag", [False, True], ids=["eager", "torch.export-style tracing"])
def test_compiling_flag_fallback_asks_torch(monkeypatch: pytest.MonkeyPatch, flag: bool) -> None:
    """Without torch.compiler's flag the wrappers call is_compiling(); either way a gated
    forward is exact (under the flag its hooks run the way kept out of graphs)."""
    monkeypatch.setattr(internals, "COMPILER", internals._AskTorch())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: flag)
    model, batch, loss_fn = models.gpt2(layers=3)
    want = _plain_grads(model, loss_fn, batch)
    with gg.backprop_depth(model, 1):
        loss_fn(model, batch).backward()
    got = _grads(model)
    assert got and not any(name.startswith("transformer.h.0.") for name in got)
    _assert_equal(got, {name: want[name] for name in got})


# -- saved tensor hooks ------------------------------------------------------------------------
def _saved_bytes(x: torch.Tensor) -> tuple[int, int]:
    outer, inner = StorageBytes(), StorageBytes()
    with observe_saved(outer.add), observe_saved(inner.add):
        y = (x @ x.T).sigmoid()
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, _sigmoid_matmul_grad(x))
    return outer.total, inner.total


def _sigmoid_matmul_grad(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad((x @ x.T).sigmoid().sum(), x)
    return grad


def test_nested_observers_both_count_without_the_outer_hooks_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    with_api = _saved_bytes(x)
    monkeypatch.setattr(internals, "TOP_SAVED_HOOKS", None)
    assert _saved_bytes(x) == with_api and with_api[0] == with_api[1] > 0


def test_nested_audits_count_the_same_saved_bytes_without_the_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(internals, "TOP_SAVED_HOOKS", None)
    model, x, loss_fn = models.conv_stack(3)
    want = _plain_grads(model, loss_fn, x)
    with gg.audit(model) as alone:
        loss_fn(model, x).backward()
    model.zero_grad(set_to_none=True)
    with gg.audit(model) as outer, gg.audit(model) as inner:
        loss_fn(model, x).backward()
    assert outer.totals["saved_bytes"] == inner.totals["saved_bytes"] == alone.totals["saved_bytes"]
    assert alone.totals["saved_bytes"] > 0
    _assert_equal(_grads(model), want)


def test_audit_inside_hooks_of_ones_own_is_a_torch_version_error_without_the_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where torch cannot name the hooks outside, an audit's hooks would replace them (an
    offloading hook silently off): it says which torch it needs instead."""
    monkeypatch.setattr(internals, "TOP_SAVED_HOOKS", None)
    model, x, loss_fn = models.conv_stack(3)
    packed: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(1)
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with pytest.raises(gg.TorchVersionError, match=r"needs torch 2\.7 or newer"):
            gg.audit(model).__enter__()
        loss_fn(model, x).backward()  # the hooks outside still work
    assert len(packed) > 1
    assert all(len(m._forward_hooks) + len(m._forward_pre_hooks) == 0 for m in model.modules())


# -- autograd node numbers and the running node ------------------------------------------------
def test_sequence_number_fallback_counts_like_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    real = internals.next_sequence_nr()
    monkeypatch.setattr(internals, "SEQUENCE_NR", None)
    fallback = internals.next_sequence_nr()  # makes one throwaway node: number real
    assert fallback == real + 1


def _figures(report: Any) -> list[tuple[str, int, int, int, int]]:
    rows = [*report.modules, report.outside]
    return [(r.name, r.wgrad, r.dgrad, r.backward_flops, r.saved_bytes) for r in rows]


def test_audit_tags_the_same_modules_without_the_sequence_getter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, x, loss_fn = models.conv_stack(3)
    with gg.audit(model) as with_api:
        loss_fn(model, x).backward()
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(internals, "SEQUENCE_NR", None)
    with gg.audit(model) as fallback:
        loss_fn(model, x).backward()
    assert _figures(fallback) == _figures(with_api) and len(_figures(with_api)) > 3


def test_a_node_without_a_sequence_number_is_a_torch_version_error() -> None:
    with pytest.raises(
        gg.TorchVersionError, match=rf"Node._sequence_nr.*torch {re.escape(torch.__version__)}"
    ):
        internals.sequence_nr(object())


@pytest.mark.parametrize("missing", ["DISPATCH_MODE", "CURRENT_NODE"])
def test_audit_without_the_op_observer_is_a_torch_version_error(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    monkeypatch.setattr(internals, missing, None)
    model = models.conv_stack(3)[0]
    hooks_before = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    with pytest.raises(gg.TorchVersionError, match=r"audit.*needs torch 2\.6 or newer: it uses"):
        gg.audit(model)
    assert [
        len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()
    ] == hooks_before


def test_checkpointed_gate_is_exact_when_torch_cannot_name_the_running_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cut's "block ran outside the gated call" warning is skipped where torch cannot say
    whether backward is recomputing the block; the gradients stay exact."""
    monkeypatch.setattr(internals, "CURRENT_NODE", None)
    assert internals.maybe_in_backward() and internals.current_autograd_node() is None
    model, x, loss_fn = models.conv_stack(4)
    want = _plain_grads(model, loss_fn, x)
    with gg.BackpropGate(model) as gate:
        gate.depth = None
        loss_fn(model, x).backward()
    _assert_equal(_grads(model), want)


# -- dynamo ------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x).tanh()


def _compiled_gate_matches_eager(depths: list[int | None]) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(3, 8), *[_Block(8) for _ in range(4)], nn.Linear(8, 2))
    model = copy.deepcopy(eager)
    blocks = [str(i) for i in range(1, 5)]
    x = torch.randn(4, 3)
    with gg.BackpropGate(eager, blocks) as eager_gate, gg.BackpropGate(model, blocks) as gate:
        compiled = torch.compile(model, backend="eager")
        for depth in depths:
            eager_gate.depth = gate.depth = depth
            for net, run in ((eager, eager), (model, compiled)):
                net.zero_grad(set_to_none=True)
                run(x).pow(2).mean().backward()
            _assert_equal(_grads(model), _grads(eager))


def test_compile_without_dynamo_frame_control_runs_blocks_eagerly_and_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch._dynamo.reset()
    monkeypatch.setattr(internals, "EVAL_FRAME", None)
    monkeypatch.setattr(internals, "eval_frame_callback", internals._callback_unknown)
    monkeypatch.setattr(internals, "set_eval_frame", None)
    assert not internals.can_set_eval_frame()
    _compiled_gate_matches_eager([None, 0, 2, 4, 1])
    torch._dynamo.reset()


def test_compile_without_hook_guards_runs_blocks_eagerly_and_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch._dynamo.reset()
    monkeypatch.setattr(internals, "HOOK_GUARDS_FLAG", "no_such_option")
    assert not internals.guards_hooks()
    _compiled_gate_matches_eager([None, 0, 2, 4, 1])
    with pytest.raises(gg.TorchVersionError, match=r"compile_blocks.*skip_nnmodule_hook_guards"):
        gg.compile_blocks(nn.Sequential(*[_Block(4) for _ in range(3)]), backend="eager")
    torch._dynamo.reset()


def test_compile_without_frame_skipping_runs_the_gated_forward_eagerly_and_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.6 cannot be told to skip the gate's frames (its dynamo crashed tracing them):
    the gated forward runs eagerly under torch.compile, a graph break, blocks uncompiled."""
    torch._dynamo.reset()
    monkeypatch.setattr(internals, "SKIPS_FRAMES", False)
    _compiled_gate_matches_eager([None, 0, 2, 4, 1, 3])
    torch._dynamo.reset()


def test_blocks_compiled_after_the_gate_without_frame_skipping_are_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where dynamo cannot be told to skip the gate's frames (torch 2.6, 2.7), it traces the
    wrapper around a block's forward when the block is compiled after the gate."""
    torch._dynamo.reset()
    monkeypatch.setattr(internals, "SKIPS_FRAMES", False)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(3, 8), *[_Block(8) for _ in range(4)], nn.Linear(8, 2))
    model = copy.deepcopy(eager)
    blocks = [str(i) for i in range(1, 5)]
    x = torch.randn(4, 3)
    with (
        gg.BackpropGate(eager, blocks) as eager_gate,
        gg.BackpropGate(model, blocks) as gate,
        gg.compile_blocks(model, blocks, backend="eager"),
    ):
        for depth in [None, 0, 2, 4, 1]:
            eager_gate.depth = gate.depth = depth
            for net in (eager, model):
                net.zero_grad(set_to_none=True)
                net(x).pow(2).mean().backward()
            _assert_equal(_grads(model), _grads(eager))
            assert len(_grads(model)) == 2 * (6 if depth is None else depth + 1)  # weight, bias
    torch._dynamo.reset()


def test_traceable_without_dynamo_helpers_is_the_function_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    assert internals.traceable(layer.forward) != layer.forward  # torch.nn: a skipped frame
    monkeypatch.setattr(internals, "DYNAMO", "no_such_module")
    assert internals.traceable(layer.forward) == layer.forward


def test_skip_frames_without_the_code_strategy_api_does_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def never_registered() -> None: ...

    monkeypatch.setattr(internals, "EVAL_FRAME", None)
    internals.skip_frames(never_registered)  # nothing to call, no error


# -- the autograd engine's end-of-backward callback ----------------------------------------------
def test_frozen_blocks_released_at_the_next_forward_without_the_engine_callback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Blocks frozen for their call stay frozen through checkpoint recomputation; without the
    engine's callback they are released at the next forward instead of at backward's end."""
    from test_mixed import _enable_non_reentrant_checkpointing

    monkeypatch.setattr(internals, "ENGINE", None)
    model, batch, loss_fn = models.llama(layers=4)
    want = _plain_grads(copy.deepcopy(model), loss_fn, batch)
    _enable_non_reentrant_checkpointing(model)
    model.train()
    with gg.BackpropGate(model) as gate:
        gate.learn = {1, "model.embed_tokens"}
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            got = _grads(model)
            layers = {n.split(".")[2] for n in got if n.startswith("model.layers.")}
            assert layers == {"1"} and "model.embed_tokens.weight" in got
            _assert_equal(got, {name: want[name] for name in got})
    assert all(p.requires_grad for p in model.parameters())


def test_estimate_without_fake_tensors_is_a_torch_version_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    gg.estimate(model, torch.randn(2, 4))  # this torch has them
    monkeypatch.setattr(planner, "FAKE_TENSOR", "torch._no_fake_tensors_here")
    with pytest.raises(
        gg.TorchVersionError, match=r"gg\.estimate needs torch 2\.6.*FakeTensorMode"
    ):
        gg.estimate(model, torch.randn(2, 4))


def test_estimate_uses_the_pytree_fallback_with_the_same_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    expected = gg.estimate(model, torch.randn(2, 4)).to_json()
    monkeypatch.setattr(trees, "PYTREE", None)
    assert gg.estimate(model, torch.randn(2, 4)).to_json() == expected


# -- grad mode ---------------------------------------------------------------------------------
def test_gate_is_exact_with_torch_set_grad_enabled_as_the_grad_mode_setter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without torch._C's setter the gate switches grad mode with torch.set_grad_enabled."""
    calls: list[bool] = []

    def public(mode: bool) -> None:
        calls.append(mode)
        torch.set_grad_enabled(mode)

    monkeypatch.setattr(internals, "set_grad_mode", public)
    model, batch, loss_fn = models.gpt2(layers=3)
    want = _plain_grads(model, loss_fn, batch)
    with gg.BackpropGate(model, depth=1):
        loss_fn(model, batch).backward()
    got = _grads(model)
    assert calls and set(calls) == {True, False}
    assert {n.split(".")[2] for n in got if n.startswith("transformer.h.")} == {"2"}
    _assert_equal(got, {name: want[name] for name in got})


@pytest.mark.parametrize("read_world", [True, False], ids=["world", "is_initialized"])
def test_distributed_running_follows_a_process_group_started_later(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, read_world: bool
) -> None:
    from gradgate._cut import block_calls as _block_calls

    if not read_world:
        monkeypatch.setattr(_block_calls, "_WORLD", None)
    dist = torch.distributed
    assert not dist.is_initialized() and not _block_calls.distributed_running()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert _block_calls.distributed_running()
    finally:
        dist.destroy_process_group()
    assert not _block_calls.distributed_running()
