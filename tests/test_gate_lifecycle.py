"""The gate leaves no trace: Ctrl-C, SystemExit, threads, copies, pickling, warnings as errors."""

from __future__ import annotations

import copy
import io
import pickle
import threading
import warnings

import pytest
import torch
from models import gpt2
from torch import nn

import gradgate as gg
from gradgate._plumbing import torch_internals as internals


class Interrupt(nn.Module):
    """A block that raises ``exc`` when armed (a user pressing Ctrl-C mid-forward)."""

    def __init__(self, exc: type[BaseException]) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.exc: type[BaseException] | None = None
        self.raises = exc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exc is not None:
            raise self.exc()
        return self.fc(x)


def _model(exc: type[BaseException] = KeyboardInterrupt) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), Interrupt(exc), nn.Linear(3, 3), nn.Linear(3, 1))


def _no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def _learners(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.grad is not None]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupt_in_a_gated_context_leaves_no_trace(exc: type[BaseException]) -> None:
    model = _model(exc)
    model[1].exc = exc
    with pytest.raises(exc), gg.backprop_depth(model, 1):
        model(torch.randn(2, 3))
    assert torch.is_grad_enabled()
    assert all(p.requires_grad for p in model.parameters())
    assert _no_hooks(model)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_interrupt_in_a_compiled_block_leaves_no_compiler_behind() -> None:
    """Under torch.compile(model) the gate compiles each block with the model's compiler; a
    Ctrl-C inside a block must leave neither that compiler nor the gate's state set."""
    model = _model()
    ref = copy.deepcopy(model)
    with gg.BackpropGate(model, ["1", "2"], depth=1) as gate:
        compiled = torch.compile(model, backend="eager")
        compiled(torch.randn(2, 3)).sum().backward()
        model[1].exc = KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            compiled(torch.randn(2, 3))
        assert torch._C._dynamo.eval_frame.get_eval_frame_callback() is None
        assert torch.is_grad_enabled()
        model[1].exc = None
        model.zero_grad(set_to_none=True)
        gate.depth = 2
        x = torch.randn(2, 3)
        compiled(x).sum().backward()
    with gg.BackpropGate(ref, ["1", "2"], depth=2):
        ref(x).sum().backward()
    for (name, want), got in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert (want.grad is None) == (got.grad is None), name
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupt_with_a_long_lived_gate_does_not_poison_the_thread(
    exc: type[BaseException],
) -> None:
    model = _model(exc)
    gate = gg.BackpropGate(model, depth=1)
    model[1].exc = exc
    with pytest.raises(exc):
        model(torch.randn(2, 3))
    model[1].exc = None
    assert torch.is_grad_enabled()  # at once, not only at the next gated forward
    assert all(p.requires_grad for p in model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    assert _learners(model) == ["3.weight", "3.bias"]
    other = _model()
    with gg.backprop_depth(other, 2):
        other(torch.randn(2, 3)).sum().backward()
    assert _learners(other) == ["2.weight", "2.bias", "3.weight", "3.bias"]
    plain = nn.Linear(3, 1)
    assert plain(torch.randn(2, 3)).requires_grad
    gate.remove()
    assert _no_hooks(model) and torch.is_grad_enabled()


def test_interrupt_in_a_block_frozen_for_its_call_restores_requires_grad() -> None:
    class Twice(nn.Module):  # the first block runs again after the cut: frozen for that call
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Interrupt(KeyboardInterrupt), nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.b(self.a(x))
            self.a.exc = self.a.raises if self.a.exc is None and self.armed else None
            return self.a(x)

    model = Twice()
    model.armed = True
    with pytest.raises(KeyboardInterrupt), gg.backprop_depth(model, 1, ["a", "b"]):
        model(torch.randn(2, 3))
    assert all(p.requires_grad for p in model.parameters())
    assert torch.is_grad_enabled() and _no_hooks(model)


def test_two_threads_forwarding_one_gated_model_each_get_their_graph() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    barrier = threading.Barrier(2, timeout=10)
    model[1].register_forward_pre_hook(lambda m, a: (barrier.wait(), None)[1])  # both inside
    x = {name: torch.randn(3, 4) for name in ("a", "b")}
    expected = {}
    for name, batch in x.items():
        ref = copy.deepcopy(model)
        ref[1]._forward_pre_hooks.clear()
        out = ref(batch).sum()
        expected[name] = torch.autograd.grad(out, [ref[2].weight, ref[3].weight])
    gate = gg.BackpropGate(model, depth=2)
    results: dict[str, object] = {}

    def work(name: str) -> None:
        try:
            out = model(x[name]).sum()
            params = [model[2].weight, model[3].weight]
            results[name] = (torch.autograd.grad(out, params), torch.is_grad_enabled())
        except BaseException as error:  # reported to the main thread
            results[name] = error

    threads = [threading.Thread(target=work, args=(n,)) for n in x]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gate.remove()
    for name in x:
        grads, grad_mode = results[name]  # type: ignore[misc]
        assert grad_mode
        for got, want in zip(grads, expected[name], strict=True):
            torch.testing.assert_close(got, want)


def test_two_threads_in_one_model_with_a_prefix_mode_is_an_error_and_leaves_the_modes() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)) for _ in range(4)])
    model.train()
    inside, leave = threading.Event(), threading.Event()

    def wait_once(module: nn.Module, args: object) -> None:
        if not inside.is_set():
            inside.set()
            leave.wait(10)

    model[1].register_forward_pre_hook(wait_once)
    gate = gg.BackpropGate(model, depth=2, prefix_mode="eval")
    first: dict[str, object] = {}

    def work() -> None:
        try:
            model(torch.randn(3, 4)).sum().backward()
            first["done"] = True
        except BaseException as error:  # reported to the main thread
            first["done"] = error

    thread = threading.Thread(target=work)
    thread.start()
    assert inside.wait(10)  # the first thread is before its cut: its prefix is in eval
    with pytest.raises(gg.BlockCallError, match=r"prefix_mode='eval' sets module\.training"):
        model(torch.randn(3, 4))
    leave.set()
    thread.join()
    assert first["done"] is True
    assert all(m.training for m in model.modules())
    assert model[3][0].weight.grad is not None and model[0][0].weight.grad is None
    gate.remove()
    assert all(m.training for m in model.modules()) and torch.is_grad_enabled()


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_of_a_gated_model_is_a_plain_model(how: str) -> None:
    model = _model()
    gate = gg.BackpropGate(model, depth=1)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    twin(torch.randn(2, 3)).sum().backward()
    assert len(_learners(twin)) == len(list(twin.parameters()))  # full backprop: no gate
    assert _no_hooks(twin)  # the copied hooks removed themselves
    model(torch.randn(2, 3)).sum().backward()
    assert _learners(model) == ["3.weight", "3.bias"]  # the original keeps its gate
    gate.remove()
    assert _no_hooks(model)


def test_the_gated_forward_keeps_its_signature() -> None:
    """Trainers and generate() read ``inspect.signature(model.forward)`` (HF drops the data-set
    columns the forward does not name)."""
    import inspect

    from models import tiny_gpt2

    from gradgate._plumbing.hooks import CompiledForward

    model = tiny_gpt2(2)
    before = inspect.signature(model.forward)
    block = inspect.signature(model.transformer.h[0].forward)
    with gg.BackpropGate(model, "transformer.h.*"):
        ids = torch.zeros(1, 4, dtype=torch.long)
        torch.compile(model, backend="eager")(ids, labels=ids, use_cache=False).loss.backward()
        assert "forward" in vars(model)
        # each block compiled by a forward of its own where dynamo can skip the gate's frames
        compiled = isinstance(vars(model.transformer.h[0]).get("forward"), CompiledForward)
        assert compiled == internals.SKIPS_FRAMES
        assert inspect.signature(model.forward) == before
        assert inspect.signature(model.transformer.h[0].forward) == block


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_copy_of_a_model_gated_under_torch_compile_is_a_plain_model() -> None:
    model = _model()
    with gg.BackpropGate(model, ["1", "2"], depth=1):
        torch.compile(model, backend="eager")(torch.randn(2, 3)).sum().backward()
        twin = copy.deepcopy(model)
    forwards = [vars(module).get("forward") for module in twin.modules()]
    assert not any(type(forward).__module__.startswith("gradgate") for forward in forwards)
    twin(torch.randn(2, 3)).sum().backward()
    assert len(_learners(twin)) == len(list(twin.parameters()))


def test_warnings_as_errors_leave_no_half_applied_cut() -> None:
    model, batch, loss_fn = gpt2(tied=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gate = gg.backprop_depth(model, 1)  # nothing is warned while hooks go on
        with pytest.raises(gg.SharedParameterWarning), gate:
            loss_fn(model, batch)
    assert torch.is_grad_enabled() and _no_hooks(model)
    assert all(p.requires_grad for p in model.parameters())


def test_a_removed_gate_refuses_a_new_plan() -> None:
    model = _model()
    gate = gg.BackpropGate(model, depth=1)
    gate.remove()
    for field, value in [("depth", 2), ("learn", {1}), ("skip", {1})]:
        with pytest.raises(gg.GradgateError, match="was removed; its plan cannot change"):
            setattr(gate, field, value)
    assert "removed" in repr(gate)


def test_a_pickled_gated_model_names_only_what_every_release_names() -> None:
    """A pickle of a gated, frozen model refers to gradgate by ``gradgate._hooks`` alone (what
    copies of hooks and wrapped forwards become), the path every release wrote: moving the
    package's modules changes no pickle, and a model pickled by an earlier release loads."""
    import pickletools

    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    gate = gg.BackpropGate(model, depth=1)
    handle = gg.freeze(model, "0")
    model(torch.ones(1, 2)).sum().backward()
    data = pickle.dumps(model)
    strings = [arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    named = {s for s in strings if s.startswith("gradgate")}
    assert named == {"gradgate._hooks"}
    assert {"_plain_forward", "_detached"} & set(strings)
    twin = pickle.loads(data)
    assert twin(torch.ones(1, 2)).shape == (1, 2)
    handle.undo()
    gate.remove()


def _tensor_hooks(model: nn.Module) -> dict[str, tuple[int, int]]:
    found = {}
    for name, p in model.named_parameters():
        post = getattr(p, "_post_accumulate_grad_hooks", None)
        found[name] = (len(p._backward_hooks or {}), len(post or {}))
    return found


def test_a_plan_change_that_no_backward_reaches_leaves_no_tensor_hook_after_remove() -> None:
    """The watch on the last block's parameter that a plan change sets (for a backward of a
    forward run under the old plan) comes off with the gate, and is never set twice."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(block), nn.Linear(3, 1)).eval()
    before = _tensor_hooks(model)
    gate = gg.BackpropGate(model, "1.*")
    for depth in (None, 0, None, 0, None, 0):
        gate.depth = depth
        model(torch.randn(2, 3)).sum().backward()
    assert max(_tensor_hooks(model)["1.0.0.weight"]) <= 1
    gate.remove()
    assert _tensor_hooks(model) == before
