"""The shared autograd plumbing: node walk, leaves, saved tensors, storages, saved-tensor
observer (no reference cycle, outer hooks kept), and the one module tagger."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import gc
import io
import pickle
import weakref
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from measure import forward_and_backward
from torch import nn

import gradgate as gg
from gradgate._plumbing.autograd import (
    StorageBytes,
    leaf_variable,
    observe_saved,
    saved_tensors,
    storage_key,
    tensors_in,
    walk,
)
from gradgate._plumbing.tagging import ModuleTagger
from gradgate._plumbing.torch_internals import knows_saved_tensors_hooks
from gradgate._plumbing.torch_internals.trees import PYTREE_DEREGISTER


def test_walk_visits_each_node_once_depth_first() -> None:
    w = torch.ones(3, requires_grad=True)
    y = w * 2
    loss = (y + y.exp()).sum()  # y is used twice: its node is reached twice
    names = [node.name() for node in walk([loss.grad_fn])]
    assert names == [
        "SumBackward0",
        "AddBackward0",
        "MulBackward0",
        "torch::autograd::AccumulateGrad",
        "ExpBackward0",
    ]
    leaves = [leaf_variable(node) for node in walk([loss.grad_fn])]
    assert [leaf is w for leaf in leaves if leaf is not None] == [True]


def test_walk_enter_prunes_a_node_and_everything_only_behind_it() -> None:
    w = torch.ones(3, requires_grad=True)
    loss = (w.exp() * 2).sum()
    names = [n.name() for n in walk([loss.grad_fn], enter=lambda n: n.name() != "MulBackward0")]
    assert names == ["SumBackward0"]


def test_saved_tensors_are_read_until_backward_frees_them() -> None:
    x = torch.randn(4, requires_grad=True)
    y = x.sigmoid()
    assert [t.shape for t in saved_tensors(y.grad_fn)] == [torch.Size([4])]
    y.sum().backward()
    assert saved_tensors(y.grad_fn) == []


def test_storage_bytes_counts_each_live_storage_once() -> None:
    x = torch.ones(8)
    counter = StorageBytes(exclude=[storage_key(torch.zeros(0))])
    assert counter.add(x) == 32 and counter.add(x[2:]) == 0 and counter.add(x.view(2, 4)) == 0
    assert counter.add(torch.ones(2, dtype=torch.float64)) == 16
    assert counter.total == 48


def _sigmoid_output_is_freed(run: object) -> bool:
    """Run a sigmoid inside ``run`` (a context manager factory), no backward, drop it."""
    x = torch.randn(16, requires_grad=True)
    with run():  # type: ignore[operator]
        y = x.sigmoid()  # autograd saves the output itself
    ref = weakref.ref(y)
    del y
    gc.collect()
    return ref() is None


def test_observer_makes_no_reference_cycle_with_a_saved_output() -> None:
    assert _sigmoid_output_is_freed(lambda: observe_saved(lambda t: None))


def test_audit_frees_a_saved_output_without_backward() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), nn.Tanh())
    x = torch.randn(2, 4)
    with pytest.warns(gg.GradgateWarning, match="without a backward"), gg.audit(model):
        out = model(x)
        inner = out.grad_fn.next_functions[0][0]  # the sigmoid's node (saves its output)
        assert inner.name() == "SigmoidBackward0"
        del inner
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None


def test_observer_keeps_hooks_installed_outside_it() -> None:
    packed: list[tuple[int, ...]] = []
    unpacked: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(t.shape))
        return t.detach()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(tuple(t.shape))
        return t

    seen: list[tuple[int, ...]] = []
    x = torch.randn(3, requires_grad=True)
    if not knows_saved_tensors_hooks():  # torch 2.6: it cannot chain to them, and says so
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, unpack),
            pytest.raises(gg.TorchVersionError, match=r"needs torch 2\.7 or newer"),
            observe_saved(seen.append),
        ):
            pass
        return
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, unpack),
        observe_saved(lambda t: seen.append(tuple(t.shape))),
    ):
        y = x.exp()
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert seen == packed == unpacked == [(3,)]
    torch.testing.assert_close(grad, x.exp())


def test_observed_graph_gives_plain_autograd_gradients_also_twice_differentiated() -> None:
    x = torch.randn(5, requires_grad=True)

    def second_derivative() -> torch.Tensor:
        y = torch.tanh(x.sigmoid())
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), x)
        return h

    reference = second_derivative()
    with observe_saved(lambda t: None):
        observed = second_derivative()
    torch.testing.assert_close(observed, reference)


def test_measure_helper_still_counts_saved_bytes() -> None:
    lin = nn.Linear(4, 4)
    saved, flops = forward_and_backward(lambda: lin(torch.randn(2, 4)).sigmoid().sum())
    # addmm saves only its input for the wgrad (2·4 floats: 32 B; the input needs no
    # gradient, so the weight is not saved) and sigmoid its output (2·4 floats: 32 B)
    assert saved == 32 + 32
    assert flops == 2 * 2 * 4 * 4  # wgrad only: the input needs no gradient


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x) * 2  # created by the root's own code
        return self.head(h)


def test_tagger_names_the_innermost_module_and_removes_its_hooks() -> None:
    net = _Net()
    with ModuleTagger(net) as tagger:
        out = net(torch.randn(2, 3))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())
    by_node = tagger.labels
    assert by_node[out.grad_fn] == "head"
    mul = out.grad_fn.next_functions[1][0]
    assert mul.name() == "MulBackward0" and by_node[mul] == ""
    relu = mul.next_functions[0][0]
    assert by_node[relu] == "body.1" and by_node[relu.next_functions[0][0]] == "body.0"


def test_audit_and_graph_name_the_same_module_for_each_node() -> None:
    net = _Net()
    x = torch.randn(2, 3)
    with gg.audit(net) as report, gg.graph.recording(net) as rec:
        loss = net(x).sum()
        g = rec.graph(loss, collapse=False)
        loss.backward()
    ops = {node.label.split("\n")[0]: node.module for node in g.nodes if node.kind == "op"}
    assert ops["MulBackward0"] == "" and ops["ReluBackward0"] == "body.1"
    assert ops["AddmmBackward0"] in ("head", "body.0")
    # the audit attributes the same nodes to the same modules: one dgrad each
    assert report.module("body.1").dgrad == 1 and report.module("head").dgrad == 1
    assert report.module("body.0").wgrad == 1 and report.module("body.0").dgrad == 0


def test_a_copy_made_during_an_audit_carries_no_gradgate_hooks() -> None:
    net = _Net()
    x = torch.randn(2, 3)
    with gg.audit(net) as report, gg.graph.recording(net):
        twin = copy.deepcopy(net)
        saved = pickle.dumps(net)
        net(x).sum().backward()
    assert report.module("head").wgrad == 1
    for copied in (twin, pickle.loads(saved)):
        torch.testing.assert_close(copied(x), net(x))
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in copied.modules())


class _Containers(nn.Module):
    """Blocks in a ModuleList, a head in a ModuleDict, parameters in a ParameterList and a
    ParameterDict: containers that hold modules but never run themselves."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(2, 3)
        self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
        self.heads = nn.ModuleDict({"out": nn.Linear(3, 1)})
        self.scales = nn.ParameterList([nn.Parameter(torch.full((3,), 1.5))])
        self.shifts = nn.ParameterDict({"b": nn.Parameter(torch.full((3,), 0.25))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.heads["out"](x * self.scales[0] + self.shifts["b"])


def _copy(model: nn.Module, how: str) -> nn.Module:
    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


HOOK_DICTS = sorted(k for k in vars(nn.Module()) if "forward" in k and "hooks" in k)


def _observe(net: nn.Module, what: str) -> contextlib.AbstractContextManager[object]:
    stack = contextlib.ExitStack()
    if what == "audit":
        stack.enter_context(gg.audit(net))
        stack.enter_context(gg.graph.recording(net))
    else:  # every module, containers included, matched by capture and transforms
        stack.enter_context(gg.capture_grads(net, "**", inputs=True))
        stack.enter_context(gg.scale_grad(net, "blocks", 0.5, on="both"))
        stack.enter_context(gg.grad_transform(net, "heads", torch.neg, on="input"))
    return stack


@pytest.mark.parametrize("what", ["audit", "capture+transform"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_of_a_model_with_containers_keeps_no_hook(how, what) -> None:
    net, plain = _Containers(), _Containers()
    x = torch.randn(4, 2)
    with _observe(net, what):
        twin = _copy(net, how)
    out = twin(x).sum()
    out.backward()
    left = {(name, d): len(getattr(m, d)) for name, m in twin.named_modules() for d in HOOK_DICTS}
    assert {key: n for key, n in left.items() if n} == {}
    plain(x).sum().backward()
    assert out.item() == pytest.approx(plain(x).sum().item())
    grads = {name: p.grad for name, p in twin.named_parameters()}
    assert sorted(grads) == sorted(n for n, _ in plain.named_parameters())
    for name, param in plain.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=0)


_Pair = collections.namedtuple("_Pair", "first second")


def _nested(tensors: list[torch.Tensor]) -> st.SearchStrategy[Any]:
    plain = st.one_of(
        st.sampled_from(tensors), st.none(), st.integers(), st.text(max_size=3), st.just(1.5)
    )
    return st.recursive(
        plain,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.lists(inner, max_size=3).map(tuple),
            st.dictionaries(st.text(max_size=2), inner, max_size=3),
            st.dictionaries(st.text(max_size=2), inner, max_size=3).map(collections.OrderedDict),
            st.tuples(inner, inner).map(lambda pair: _Pair(*pair)),
        ),
        max_leaves=12,
    )


_TENSORS = [torch.ones(1), torch.zeros(2), nn.Parameter(torch.ones(3))]


@settings(max_examples=200, deadline=None)
@given(_nested(_TENSORS))
def test_tensors_in_finds_what_the_pytree_finds_in_the_same_order(value: Any) -> None:
    def by_the_pytree(value: Any) -> list[torch.Tensor]:  # what tensors_in must agree with
        found = []
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif isinstance(leaf, Mapping):
                found.extend(by_the_pytree(list(leaf.values())))
        return found

    assert [id(t) for t in tensors_in(value)] == [id(t) for t in by_the_pytree(value)]


def test_tensors_in_opens_a_model_output_and_a_registered_dataclass() -> None:
    from transformers.modeling_outputs import CausalLMOutput

    logits, loss = torch.ones(2), torch.zeros(1)
    assert tensors_in([CausalLMOutput(loss=loss, logits=logits), "x"]) == [loss, logits]

    @dataclasses.dataclass
    class Registered:  # a class of its own: torch 2.6 cannot take a registration back
        weight: torch.Tensor

    assert tensors_in({"a": Registered(logits)}) == []  # unknown to the pytree: not opened
    torch.export.register_dataclass(Registered, serialized_type_name=f"{__name__}.Registered")
    try:
        assert tensors_in({"a": Registered(logits)}) == [logits]
    finally:
        if PYTREE_DEREGISTER is not None:
            PYTREE_DEREGISTER(Registered)
