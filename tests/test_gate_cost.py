"""What keeps the gate cheap stays exact: hooks only while a plan needs them, put back in their
place; per-plan caches follow every plan change (timings live in benchmarks, not here)."""

from __future__ import annotations

import copy
import gc
import sys
from typing import Any

import models
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradgate as gg
from gradgate._bench.cost.bytecode import count
from gradgate._cut import cut as _cut_module
from gradgate._cut import frames as _frames
from gradgate._cut import plans as _plan_tables
from gradgate._cut import stale_grads as _stale_grads
from gradgate._plumbing import torch_internals as internals
from gradgate._plumbing.hooks import GateHook, HookedForward, TracedHookedForward


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x).tanh()


def _mlp(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Residual() for _ in range(n)])


def _gate_hooks(module: nn.Module) -> int:
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return sum(isinstance(hook, GateHook) for hook in hooks)


def _wrapped(module: nn.Module) -> bool:
    """Whether the gate runs its hooks from the module's forward (no module hook)."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, HookedForward) and forward.runs


def test_the_gate_hooks_run_from_the_blocks_forward_on_every_torch() -> None:
    """Before torch 2.8, where dynamo cannot skip the wrappers' frames, a traced wrapper calls
    the hooks through their GateHook (untraced), so plain forwards keep the wrappers (and the
    fused kernels that any module hook turns off)."""
    model = _mlp()
    gate = gg.BackpropGate(model, depth=2)
    model(torch.randn(2, 3))
    assert [_gate_hooks(block) for block in model] == [0] * 4
    assert all(_wrapped(block) for block in model)
    traced = [isinstance(block.forward, TracedHookedForward) for block in model]
    assert traced == [not internals.SKIPS_FRAMES] * 4
    gate.remove()


def test_blocks_take_torchs_fast_path_with_a_plan_and_module_hooks_only_beside_others() -> None:
    model = _mlp()
    x = torch.randn(2, 3)
    gate = gg.BackpropGate(model, depth=2)
    assert [_gate_hooks(block) for block in model] == [0, 0, 0, 0]
    assert all(_wrapped(block) for block in model)
    handle = model[1].register_forward_pre_hook(lambda m, a: None)
    model(x)  # the next forward finds the user's hook: the gate's hooks go around it
    assert [_gate_hooks(block) for block in model] == [0, 2, 0, 0]
    assert [_wrapped(block) for block in model] == [True, False, True, True]
    handle.remove()
    model(x)
    assert [_gate_hooks(block) for block in model] == [0, 0, 0, 0]
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        model(x)  # a global hook (FlopCounterMode's) runs outside forward: the gate stays inside
        assert [_gate_hooks(block) for block in model] == [0, 0, 0, 0]
        assert all(_wrapped(block) for block in model)
    finally:
        handle.remove()
    model(x)
    assert not any(_gate_hooks(block) for block in model)
    gate.depth = None
    model(x)  # no plan: the wrappers only call through
    assert not any(_wrapped(block) or _gate_hooks(block) for block in model)
    gate.skip = {1}
    assert all(_wrapped(block) for block in model)
    gate.remove()
    assert all("forward" not in block.__dict__ and not _gate_hooks(block) for block in model)


def test_a_user_pre_hook_on_a_cut_off_block_runs_after_the_gate_turned_grad_off() -> None:
    """Beside other hooks the gate's are module hooks: a user's pre-hook on a block before the
    cut sees grad off (the gate's pre-hook ran first), as when the gate had been hooked all along
    (the cut opens after each block of the learner's stack for checkpoint(), and closes again)."""
    model = _mlp()
    seen: list[bool] = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append(torch.is_grad_enabled()))
    gate = gg.BackpropGate(model, depth=1)
    model(torch.randn(2, 3)).sum().backward()
    assert seen == [False]
    assert [p.grad is not None for p in model.parameters()] == [False] * 6 + [True] * 2
    gate.remove()


def test_a_hook_prepended_while_the_gates_were_off_runs_before_them() -> None:
    model = _mlp(2)
    block = model[1]
    first = block.register_forward_pre_hook(lambda m, a: None)
    gate = gg.BackpropGate(model, depth=1)
    assert [type(h).__name__ for h in block._forward_pre_hooks.values()] == [
        "GateHook",
        "function",
    ]
    model(torch.randn(2, 3))
    gate.depth = None
    model(torch.randn(2, 3))  # no plan: hooks off
    model(torch.randn(2, 3))
    early = block.register_forward_pre_hook(lambda m, a: None, prepend=True)
    gate.depth = 1
    keys = list(block._forward_pre_hooks)
    assert keys.index(early.id) == 0 and keys.index(first.id) == 2
    assert isinstance(block._forward_pre_hooks[keys[1]], GateHook)
    gate.remove()


def test_hooks_come_back_in_their_place_among_other_hooks() -> None:
    model = _mlp(2)
    x = torch.randn(2, 3)
    block = model[1]
    before_pre = block.register_forward_pre_hook(lambda m, a: None)
    gate = gg.BackpropGate(model)
    after_pre = block.register_forward_pre_hook(lambda m, a: None)
    after_post = block.register_forward_hook(lambda m, a, o: None)

    def order() -> list[str]:
        names = {before_pre.id: "user-before", after_pre.id: "user-after"}
        names[after_post.id] = "user-after"
        return [
            names.get(key, type(hook).__name__)
            for hooks in (block._forward_pre_hooks, block._forward_hooks)
            for key, hook in hooks.items()
        ]

    first = order()
    assert first == ["GateHook", "user-before", "user-after", "GateHook", "user-after"]
    model(x)
    model(x)
    assert order() == ["user-before", "user-after", "user-after"]
    gate.depth = 1
    assert order() == first
    gate.remove()
    assert order() == ["user-before", "user-after", "user-after"]


def test_a_block_called_outside_the_gated_call_warns_after_hooks_were_off() -> None:
    model = _mlp()
    x = torch.randn(2, 3)
    gate = gg.BackpropGate(model)
    model(x)
    model(x)
    gate.depth = 1
    with pytest.warns(gg.BlockCallWarning, match="ran outside a call of the gated"):
        model[3](x)
    gate.remove()


def _plain_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(model(x).pow(2).sum(), list(params.values()))
    return dict(zip(params, grads, strict=True))


Plan = int | str | frozenset[int] | None
PLANS = st.one_of(
    st.none(), st.integers(1, 4), st.just("skip"), st.frozensets(st.integers(0, 3), min_size=1)
)


@settings(max_examples=60, deadline=None)
@given(plans=st.lists(PLANS, max_size=8), user_hook=st.booleans())
def test_any_sequence_of_plans_is_exact_at_every_step(plans: list[Plan], user_hook: bool) -> None:
    """Hooks going off and on between steps (None, depths, learning sets, DropBP), from the
    blocks' forwards or as module hooks beside a user's, never change a gradient."""
    model = _mlp()
    reference = copy.deepcopy(model)
    want = _plain_grads(reference, x := torch.randn(2, 3))
    gate = gg.BackpropGate(model)
    if user_hook:
        model[2].register_forward_hook(lambda m, a, o: None)
    for plan in [*plans, None]:
        gate.skip = {1} if plan == "skip" else None
        if isinstance(plan, frozenset):
            gate.learn = plan
        else:
            gate.depth = None if plan == "skip" else plan
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        if plan is None:
            assert got.keys() == want.keys()
        elif plan != "skip":
            learners = plan if isinstance(plan, frozenset) else range(4 - plan, 4)
            assert {name.split(".")[0] for name in got} == {str(i) for i in learners}
        for name in got if plan != "skip" else ():
            torch.testing.assert_close(got[name], want[name], msg=name)
    gate.remove()
    assert all(p.requires_grad for p in model.parameters())


LEARN_SETS = st.frozensets(st.integers(0, 3) | st.sampled_from([f"{i}.linear" for i in range(4)]))


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.none() | st.integers(0, 4) | LEARN_SETS, st.booleans()), min_size=1, max_size=8
    )
)
def test_momentum_moves_only_the_blocks_that_learned_in_any_sequence_of_steps(
    steps: list[tuple[int | frozenset[int | str] | None, bool]],
) -> None:
    """Stale gradients are dropped whatever came before: plans of every kind (named modules
    inside blocks too), grads zeroed to None or to zero, blocks found clean at one step and
    learning at the next."""
    model = nn.Sequential(*_mlp(), nn.Linear(3, 1))
    gate = gg.BackpropGate(model, blocks=[str(i) for i in range(4)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    x = torch.randn(2, 3)
    for plan, set_to_none in steps:
        if isinstance(plan, frozenset):
            gate.learn = plan
            learners = {int(str(item)[0]) for item in plan}
        else:
            gate.depth = plan
            learners = set(range(0 if plan is None else 4 - plan, 4))
        before = [model[i].linear.weight.detach().clone() for i in range(4)]
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        for i in range(4):
            assert torch.equal(model[i].linear.weight, before[i]) == (i not in learners), (plan, i)
    gate.remove()


def test_a_forward_with_no_backward_keeps_little_for_the_next() -> None:
    """Forwards whose backward never comes (an evaluation with grad on) do not pile up what
    they learned; the next step's frozen blocks still come back."""
    model, batch, loss_fn = models.gpt2(layers=3)
    with gg.BackpropGate(model) as gate:
        gate.learn = {0, 2}  # block 1 runs after the cut and is frozen for its call
        for _ in range(40):
            loss_fn(model, batch)
        assert len(gate._held._learners) <= 17
        loss_fn(model, batch).backward()
        assert all(p.requires_grad for p in model.parameters())
        assert all(p.grad is None for p in model.transformer.h[1].parameters())
        assert all(p.grad is not None for p in model.transformer.h[2].parameters())


class Probe(nn.Module):
    """Records, at each call, how many gated forwards are open in this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.open.append(len(_frames.open_frames()))
        return x


def test_with_no_plan_and_the_hooks_off_a_forward_opens_no_frame() -> None:
    probe = Probe()
    model = nn.Sequential(*_mlp(), probe)
    gate = gg.BackpropGate(model, blocks=[str(i) for i in range(4)])
    x = torch.randn(2, 3)
    model(x)  # the first forward learns the stacks' run order; the next takes the hooks off
    model(x)
    model(x).sum().backward()
    assert model[0].linear.weight.grad is not None  # everything learned
    model.zero_grad(set_to_none=True)
    gate.depth = 1
    model(x).sum().backward()
    assert probe.open == [1, 0, 0, 1]
    assert [model[i].linear.weight.grad is None for i in range(4)] == [True] * 3 + [False]
    gate.remove()


def test_blocks_run_in_order_before_the_cut_call_no_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _mlp(5)
    gate = gg.BackpropGate(model, depth=1)
    hooked: list[int] = []
    enter_block = gate._enter_block

    def spy(position: int, *args: object) -> None:
        hooked.append(position)
        enter_block(position, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(gate, "_enter_block", spy)
    x = torch.randn(2, 3)
    grads = _plain_grads(copy.deepcopy(model), x)
    model(x).pow(2).sum().backward()
    # the last block learns (it opens the cut and has its output checked): only it takes the
    # hooks' way; the first one starts its stack on the way
    assert hooked == [4]
    assert torch.equal(model[4].linear.weight.grad, grads["4.linear.weight"])
    assert all(model[i].linear.weight.grad is None for i in range(4))
    hooked.clear()
    with pytest.warns(gg.BlockCallWarning, match="outside a call of the gated"):
        model[3](x)  # outside the gated call: its hooks decide
    assert hooked == [3]
    hooked.clear()
    gate.depth = 3
    model(x).pow(2).sum().backward()
    # a plan's first forward is the missing-gradient guard's: every learner takes its hooks
    assert hooked == [2, 3, 4]
    hooked.clear()
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    # then learners after the first one, in order, take the same way (the first opens the cut)
    assert hooked == [2]
    for i in range(2, 5):
        assert torch.equal(model[i].linear.weight.grad, grads[f"{i}.linear.weight"])
    assert all(model[i].linear.weight.grad is None for i in range(2))
    gate.remove()


@pytest.mark.parametrize("depth", [0, 2])
def test_blocks_before_the_cut_open_and_close_it_with_no_call_of_the_cuts_methods(
    monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """Each block before the cut closes the cut that the one before it opened for now, and opens
    it for now after itself: at every block of every forward, so the lane does it itself."""
    model = nn.Sequential(_mlp(6), nn.Linear(3, 3))
    x = torch.randn(2, 3)
    grads = _plain_grads(copy.deepcopy(model), x)
    gate = gg.BackpropGate(model, depth=depth, blocks="0.*")
    model(x).pow(2).sum().backward()  # the plan's first forward: every learner's hooks run
    model.zero_grad(set_to_none=True)
    calls: list[str] = []
    for name in ("_open", "_close_again", "_open_after"):
        method = getattr(gate, name)

        def spy(
            *args: object, _name: str = name, _method: object = method, **kwargs: object
        ) -> None:
            calls.append(_name)
            _method(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(gate, name, spy)
    model(x).pow(2).sum().backward()
    # a learning block's hooks make the opening for now one for good
    assert calls == ([] if depth == 0 else ["_open"])
    for i in range(6):
        grad = model[0][i].linear.weight.grad
        assert grad is None if i < 6 - depth else torch.equal(grad, grads[f"0.{i}.linear.weight"])
    assert torch.equal(model[1].weight.grad, grads["1.weight"])
    gate.remove()


def _gate_bytecodes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytecode instructions run in gradgate's own code during one forward (deterministic for a
    Python version, unlike its time on a shared machine)."""
    instructions, _ = count(lambda: model(x))
    return sum(instructions.values())


class _Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = nn.Linear(3, 3), _mlp(4), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_an_embedding_and_a_head_run_with_no_call_of_their_hook(
    monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """Under a depth an outside module's hook only takes note that it ran (it opens the cut only
    after a stack LayerDrop skipped, and freezes only for a learning set)."""
    model = _Embedded()
    x = torch.randn(2, 3)
    reference = copy.deepcopy(model)
    reference(x).pow(2).sum().backward()
    calls: list[int] = []
    enter_outside = _cut_module._Cut._enter_outside

    def spy(self: object, index: int, *args: object) -> None:
        calls.append(index)
        enter_outside(self, index, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_cut_module._Cut, "_enter_outside", spy)  # before the gate binds it
    gate = gg.BackpropGate(model, depth=depth, blocks="blocks.*")
    model(x)  # the first forward learns what runs after the stack
    calls.clear()
    model(x).pow(2).sum().backward()
    assert calls == []
    for name, param in model.named_parameters():
        expected = dict(reference.named_parameters())[name].grad
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        learns = name.startswith("head") or (block is not None and block >= 4 - depth)
        assert torch.equal(param.grad, expected) if learns else param.grad is None
    gate.remove()


@pytest.mark.skipif(
    not internals.SKIPS_FRAMES, reason="before torch 2.8 the traced wrapper adds a frame per block"
)
@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="bytecode counted on CPython 3.11")
@pytest.mark.parametrize("depth", [0, 1])
def test_a_block_before_the_cut_costs_the_gate_few_bytecodes(depth: int) -> None:
    """The lane runs at every block of every forward: what one more block before the cut adds to
    a forward, in gradgate's bytecode (172 at depth 0 and 196 at depth 1 before this budget)."""
    assert _per_block_bytecodes(depth) <= 140


def _per_block_bytecodes(depth: int) -> float:
    x = torch.randn(2, 3)
    counts = []
    for n in (4, 12):
        model = nn.Sequential(_mlp(n), nn.Linear(3, 3))
        gate = gg.BackpropGate(model, depth=depth, blocks="0.*")
        model(x)
        counts.append(_gate_bytecodes(model, x))
        gate.remove()
    return (counts[1] - counts[0]) / 8


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="bytecode counted on CPython 3.11")
def test_freezing_the_code_between_the_blocks_does_not_walk_them_at_every_forward() -> None:
    """At depth 1 the code up to the learner is frozen (see test_cut: the gap): what one more
    block costs stays about what it costs at depth 0 (17 bytecodes more before, 5 now: the lane
    asks whether the gap is frozen yet)."""
    assert _per_block_bytecodes(1) - _per_block_bytecodes(0) <= 6


class _UsesInTheGap(nn.Module):
    """Blocks with a parameter and a module used between them, assigned after the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = _mlp(4)
        self.scale = nn.Parameter(torch.ones(3))
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                x = x * self.scale
                if hasattr(self, "shift"):
                    x = self.shift(x)
        return self.head(x)


def test_a_parameter_or_module_assigned_after_the_gate_is_frozen_between_the_blocks() -> None:
    """What the code between the blocks may use is walked once, and again after a module is
    assigned there (torch's registration hook, taken off with the gate)."""
    from torch.nn.modules import module as torch_module

    registered = len(torch_module._global_module_registration_hooks)
    model = _UsesInTheGap()
    x = torch.randn(2, 3)
    gate = gg.BackpropGate(model, depth=1, blocks="blocks.*")
    model(x).sum().backward()
    assert model.scale.grad is None
    model.zero_grad(set_to_none=True)
    model.scale = nn.Parameter(torch.full((3,), 2.0))
    model.shift = nn.Linear(3, 3)
    out = model(x)
    out.sum().backward()
    assert model.scale.grad is None and model.shift.weight.grad is None
    assert model.blocks[3].linear.weight.grad is not None
    assert model.scale.requires_grad and model.shift.weight.requires_grad  # given back
    gate.remove()
    assert len(torch_module._global_module_registration_hooks) == registered
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    with torch.no_grad():
        h = x
        for block in reference.blocks[:3]:
            h = block(h)
            if block is reference.blocks[1]:
                h = reference.shift(h * reference.scale)
    expected = torch.autograd.grad(
        reference.head(reference.blocks[3](h)).sum(), reference.blocks[3].linear.weight
    )[0]
    assert torch.allclose(model.blocks[3].linear.weight.grad, expected)


@pytest.mark.parametrize("depth", [0, 1])
def test_blocks_before_the_cut_leave_autocasts_cache_alone(
    monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """The cache goes off once for the forward and on at the learner, not at each block that
    opens the cut for now (that would be two more calls per block)."""
    model = nn.Sequential(_mlp(6), nn.Linear(3, 3))
    x = torch.randn(2, 3)
    grads = _plain_grads(copy.deepcopy(model), x)
    calls: list[bool] = []
    set_cache = torch.set_autocast_cache_enabled
    monkeypatch.setattr(torch, "set_autocast_cache_enabled", calls.append)
    with gg.backprop_depth(model, depth, blocks="0.*"):
        model(x).pow(2).sum().backward()
    set_cache(True)
    assert calls == ([False, True] if depth == 0 else [False, True, True])
    for i in range(6):
        grad = model[0][i].linear.weight.grad
        assert grad is None if i < 6 - depth else torch.equal(grad, grads[f"0.{i}.linear.weight"])
    assert torch.equal(model[1].weight.grad, grads["1.weight"])


def test_a_forward_where_no_block_learns_and_none_is_held_registers_no_hook() -> None:
    """Nothing to wait for in its backward: no block learns, no parameter is held frozen."""
    model = nn.Sequential(*_mlp(), nn.Linear(3, 1))
    gate = gg.BackpropGate(model, blocks=[str(i) for i in range(4)])
    x = torch.randn(2, 3)
    registered = []
    for depth in (0, 0, 2, 2, 0):
        gate.depth = depth
        model.zero_grad(set_to_none=True)
        before = internals.hooks_registered()
        out = model(x)
        registered.append(internals.hooks_registered() != before)
        out.sum().backward()
        learned = [param.grad is not None for param in model.parameters()]
        assert learned == [False] * 2 * (4 - depth) + [True] * 2 * (depth + 1)
    # a plan's first forward has the missing-gradient guard's hooks (depth 0's, once)
    assert registered == [True, False, True, True, False]
    gate.remove()


class PairBlock(nn.Module):
    """A block that returns a tuple, as transformers' layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x + self.linear(x).tanh(), None


class PairStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([PairBlock() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            x, _ = block(x)
        return {"out": x}


def test_a_gated_step_leaves_nothing_for_the_cycle_collector() -> None:
    """Garbage in reference cycles waits for the collector, whose full passes over a training
    process's heap take tens of milliseconds: a gated step makes none (a plain step makes none)."""
    torch.manual_seed(0)
    model = PairStack()
    x = torch.randn(2, 3)
    gate = gg.BackpropGate(model)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for depth in (2, 2, None, 1, 4):
            gate.depth = depth
            gc.collect()
            model(x)["out"].sum().backward()
            assert gc.collect() == 0, depth
    finally:
        if enabled:
            gc.enable()
    gate.remove()


def test_the_plan_tables_are_made_once_per_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Setting the depth at every step (as loops do) reuses the tables of a plan seen before."""
    made: list[int | None] = []

    def first_opener(learn: object, skip: object, n: int) -> int:
        made.append(None if learn is None else len(learn))  # type: ignore[arg-type]
        return _plan_tables.first_opener(learn, skip, n)  # type: ignore[arg-type]

    monkeypatch.setattr(_cut_module, "first_opener", first_opener)
    model = nn.Sequential(*_mlp(), nn.Linear(3, 1))
    gate = gg.BackpropGate(model, blocks=[str(i) for i in range(4)])
    x = torch.randn(2, 3)
    for depth in (1, 1, 1, 2, 2, 1, 2):
        gate.depth = depth
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        learned = [model[i].linear.weight.grad is not None for i in range(4)]
        assert learned == [i >= 4 - depth for i in range(4)]
    assert made == [1, 2]
    gate.skip = {3}  # another plan: its own tables
    model(x).sum().backward()
    assert made == [1, 2, 2]
    gate.remove()


def test_setting_the_plan_it_has_redoes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loops set the depth at every step, mostly to the one it has."""
    model = _mlp(4)
    gate = gg.BackpropGate(model, depth=2)
    x = torch.randn(2, 3)
    grads = _plain_grads(copy.deepcopy(model), x)
    model(x)
    calls: list[str] = []
    monkeypatch.setattr(gate, "_hooks_for_plan", lambda **kw: calls.append("hooks"))
    tables = gate._first, gate._after
    for _ in range(3):
        gate.depth = 2
    assert calls == [] and (gate._first, gate._after) == tables
    gate.learn = {2, 3}  # the same blocks, as a learning set: another plan
    assert calls == ["hooks"] and gate._first is None
    gate.learn = {2, 3}
    assert calls == ["hooks"]
    monkeypatch.undo()
    model(x).pow(2).sum().backward()
    for i in range(4):
        grad = model[i].linear.weight.grad
        assert grad is None if i < 2 else torch.equal(grad, grads[f"{i}.linear.weight"])
    gate.remove()
    with pytest.raises(gg.GradgateError, match="was removed"):
        gate.depth = 2


def test_an_optimizer_step_walks_the_blocks_once_per_set_of_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A depth that alternates between steps (random depths, LISA's intervals) finds the
    parameters to drop stale gradients from without walking the blocks again."""
    walks: list[int] = []
    walk = _stale_grads.CutGrads._walk

    def counted(self: _stale_grads.CutGrads) -> _stale_grads._Stale:
        walks.append(len(self._plans))
        return walk(self)

    monkeypatch.setattr(_stale_grads.CutGrads, "_walk", counted)
    model = nn.Sequential(*_mlp(), nn.Linear(3, 1))
    gate = gg.BackpropGate(model, blocks=[str(i) for i in range(4)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 3)
    for depth in (1, 2, 1, 2, 1, 2):
        gate.depth = depth
        optimizer.zero_grad(set_to_none=False)  # zero grads left on every parameter
        before = [model[i].linear.weight.detach().clone() for i in range(4)]
        model(x).sum().backward()
        optimizer.step()
        for i in range(4):  # momentum moves no block that did not learn in this step
            assert torch.equal(model[i].linear.weight, before[i]) == (i < 4 - depth), (depth, i)
    assert walks == [1, 1]
    gate.remove()


def test_an_optimizer_step_reads_the_gradients_only_of_blocks_that_may_have_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found with no gradient once, a block that has not learned since cannot have one: a step
    reads the .grad of each cut-off parameter only after its block learned."""
    reads: list[int] = []
    monkeypatch.setattr(_stale_grads, "_GRAD", lambda param: reads.append(1) or param.grad)
    model = nn.Sequential(*_mlp(), nn.Linear(3, 1))
    gate = gg.BackpropGate(model, blocks=[str(i) for i in range(4)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 3)
    per_step = []
    for depth, set_to_none in [(1, True), (1, True), (2, True), (2, False), (1, False), (1, True)]:
        gate.depth = depth
        before = [model[i].linear.weight.detach().clone() for i in range(4)]
        model(x).sum().backward()
        reads.clear()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        per_step.append(len(reads))
        for i in range(4):  # momentum moves no block that did not learn in this step
            assert torch.equal(model[i].linear.weight, before[i]) == (i < 4 - depth), (depth, i)
    # 3 blocks of 2 parameters at first; then block 2 after it learned: the 5th step drops the
    # zero .grad set_to_none=False left on it, the 6th finds it clean
    assert per_step == [6, 0, 0, 0, 2, 2]
    gate.remove()


class _ChangesPlanMidway(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.head = _mlp(4), nn.Linear(3, 3)
        self.midway: Any = None  # called after block `after`
        self.after = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == self.after and self.midway is not None:
                self.midway()
        return self.head(x)


@pytest.mark.parametrize("change", ["depth", "skip"])
def test_a_plan_set_during_a_forward_applies_to_the_blocks_that_run_after_it(change: str) -> None:
    """The lane reads the tables of the plan its forward started with, until the plan
    changes: then the blocks after the change follow the new plan."""
    model = _ChangesPlanMidway()
    x = torch.randn(2, 3)
    gate = gg.BackpropGate(model, depth=1 if change == "depth" else 2, blocks="blocks.*")
    model(x)  # the plan's tables made, the lane taking the blocks
    if change == "depth":
        model.midway = lambda: setattr(gate, "depth", 3)
    else:  # after the first learner, which had its output checked: block 3 takes the lane
        model.midway, model.after = lambda: setattr(gate, "skip", {3}), 2
    model(x).sum().backward()
    grads = [model.blocks[i].linear.weight.grad for i in range(4)]
    if change == "depth":  # blocks 1-3 learn; block 0 ran before the cut
        reference = copy.deepcopy(model)
        with torch.no_grad():
            h = reference.blocks[0](x)
        out = reference.head(reference.blocks[3](reference.blocks[2](reference.blocks[1](h))))
        expected = torch.autograd.grad(
            out.sum(), [reference.blocks[i].linear.weight for i in (1, 2, 3)]
        )
        assert grads[0] is None
        for got, want in zip(grads[1:], expected, strict=True):
            assert torch.allclose(got, want)
    else:  # block 3 skipped: no gradient of its own; block 2 still learns
        assert grads[:2] == [None, None] and grads[3] is None
        assert grads[2] is not None
    gate.remove()


def _step_bytecodes(n: int, depths: list[int | None]) -> int:
    """Gradgate's bytecode in one training step (forward, backward, optimizer step, zero_grad)
    at ``depths[-1]``, after two rounds of steps at each of ``depths``, and one at each of the
    others."""
    torch.manual_seed(0)
    model = nn.Sequential(_mlp(n), nn.Linear(3, 3))
    gate = gg.BackpropGate(model, blocks="0.*")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 3)

    def step(depth: int | None) -> None:
        gate.depth = depth
        model(x).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for depth in [*depths, *depths, *depths[:-1]]:
        step(depth)
    instructions, _ = count(lambda: step(depths[-1]))
    gate.remove()
    return sum(instructions.values())


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="bytecode counted on CPython 3.11")
@pytest.mark.parametrize(("before", "depth"), [(None, 0), (0, None), (2, 0)])
def test_a_step_after_a_step_at_another_depth_costs_little_more_per_block(
    before: int | None, depth: int | None
) -> None:
    """Depths that change at every step (random depths, a bench that interleaves them): what one
    more block adds to a step after a step at another depth, beyond what it adds at a depth set
    once. Before this budget: 245 bytecodes coming back from no cut (the hooks put back, the
    cut-off blocks' gradients looked for block by block), 35 going to it, 9 from depth 2 to 0;
    now 6, 6 and 0."""
    per_block = [
        (_step_bytecodes(12, depths) - _step_bytecodes(4, depths)) / 8
        for depths in ([before, depth], [depth])
    ]
    assert per_block[0] - per_block[1] <= 6, per_block


def test_the_bytecode_count_follows_the_bench_from_depth_to_depth(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--cycle`` counts each step after a step at the depth before it: the step at None takes
    the hooks off, which a step after a step at None does not do."""
    from gradgate._bench.cost import bytecode

    rows = {}
    for cycle in (False, True):
        argv = ["bytecode", "--models", "conv_stack", "--depths", "0,all", "--top", "20"]
        monkeypatch.setattr(sys, "argv", argv + ["--cycle"] * cycle)
        bytecode.main()
        rows[cycle] = capsys.readouterr().out.splitlines()[-1]
    assert rows[False].split()[:2] == rows[True].split()[:2] == ["conv_stack", "None"]
    assert "suspend" in rows[True] and "suspend" not in rows[False]


def test_a_forward_that_returns_a_dict_finds_its_tensors_without_the_pytree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The root's exit looks for the output's tensors at every forward: HF models return a
    ``ModelOutput`` (a dict), which torch's pytree would walk in some 180 bytecodes."""
    from gradgate._plumbing import autograd as _autograd

    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = _mlp()

        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            return {"out": self.blocks(x), "extra": (None, "text")}

    model = Named()
    gate = gg.BackpropGate(model, blocks="blocks.*", depth=1)
    walked = []
    monkeypatch.setattr(_autograd, "tree_leaves", lambda value: walked.append(value) or [value])
    model(torch.ones(2, 3))["out"].sum().backward()
    assert walked == []
    assert [p.grad is not None for p in model.parameters()] == [False] * 6 + [True] * 2
    gate.remove()


def test_the_bytecode_count_takes_only_the_packages_own_files(tmp_path: Any) -> None:
    """A clone named ``gradgate`` with its ``.venv`` inside (what README's commands make) holds
    torch under a path that contains "gradgate": only the package's own folder counts."""
    from pathlib import Path

    from gradgate._bench.cost import bytecode

    package = Path(gg.__file__).parent

    def ours(path: Path) -> bool:
        return bytecode._ours(compile("pass", str(path), "exec"))

    clone = tmp_path / "gradgate"
    torch_in_venv = clone / ".venv/lib/python3.11/site-packages/torch/nn/modules/module.py"
    assert not ours(torch_in_venv)
    assert not ours(clone / "tests" / "test_gate_cost.py")
    assert not ours(package.parent / "gradgate_extra" / "x.py")
    assert not ours(package / "_bench" / "run.py")
    assert ours(package / "_cut" / "cut.py")
    assert ours(package / "_observe" / "audit" / "recorder.py")
