"""No optimizer step moves a parameter outside the blocks that a gate kept from learning.

After ``zero_grad(set_to_none=False)`` a parameter that learned in an earlier step holds an
all-zero ``.grad``. An embedding before the cut gets no gradient under a plan, yet momentum and
weight decay would move it with that zero: the stale-gradient guard drops it, as it does for the
blocks the plan cut off. Each test steps a gated model with ``zero_grad(set_to_none=False)``
against plain autograd on a copy that computes the plan's learners' gradients by hand and
steps with ``zero_grad(set_to_none=True)``: only what got a gradient moves.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import gpt2, llama
from torch import nn

import gradgate as gg

Plan = tuple[str, Any]  # ("none", None), ("depth", k), ("learn", {positions and names})

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def set_plan(gate: gg.BackpropGate, plan: Plan) -> None:
    kind, value = plan
    if kind == "learn":
        gate.learn = value
    else:
        gate.depth = value


def learners(model: nn.Module, plan: Plan) -> list[nn.Parameter]:
    """The parameters that learn under ``plan``, written out: the learning blocks, what runs
    after the last block (final norm, head: tied weights included), and named modules."""
    kind, value = plan
    blocks = [model.get_submodule(name) for name in gg.blocks(model)]
    if kind == "none":
        return list(model.parameters())
    positions = range(len(blocks) - value, len(blocks)) if kind == "depth" else value
    modules = [blocks[p] for p in positions if isinstance(p, int)]
    modules += [model.get_submodule(n) for n in (value if kind == "learn" else ()) if n in NAMES]
    modules += [model.lm_head, model.get_submodule(FINAL_NORM[type(model).__name__])]
    return list({id(p): p for m in modules for p in m.parameters()}.values())


NAMES = {"transformer.wpe", "model.embed_tokens"}
FINAL_NORM = {"GPT2LMHeadModel": "transformer.ln_f", "LlamaForCausalLM": "model.norm"}
EMBEDDINGS = {  # before the blocks: no gradient under a cut
    "GPT2LMHeadModel": ["transformer.wpe.weight", "transformer.wte.weight"],
    "LlamaForCausalLM": ["model.embed_tokens.weight"],
}


def reference_step(
    ref: nn.Module, batch: Any, loss_fn: Any, plan: Plan, *, embedding: str | None = None
) -> None:
    """Plain autograd on the ungated copy, gradients only for the plan's learners. A tied
    embedding's use before the cut gives it nothing (its output detached, by hand)."""
    hook = None
    if embedding is not None and plan[0] != "none":
        hook = ref.get_submodule(embedding).register_forward_hook(lambda m, a, out: out.detach())
    try:
        wanted = learners(ref, plan)
        grads = torch.autograd.grad(loss_fn(ref, batch), wanted)
    finally:
        if hook is not None:
            hook.remove()
    for param, grad in zip(wanted, grads, strict=True):
        param.grad = grad if param.grad is None else param.grad + grad


def assert_same(ours: nn.Module, ref: nn.Module, where: object) -> None:
    for (name, mine), theirs in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, msg=lambda m, n=name: f"{where} {n}: {m}")


def embeddings(model: nn.Module) -> dict[str, torch.Tensor]:
    names = EMBEDDINGS[type(model).__name__]
    return {n: model.get_parameter(n).detach().clone() for n in names}


# a full step, then plans that leave the embeddings out, a full step again, and more
PLANS: list[Plan] = [("none", None), ("depth", 1), ("depth", 1), ("learn", {1}), ("none", None)]
PLANS += [("learn", {1}), ("depth", 0)]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("factory", [gpt2, llama], ids=["gpt2", "llama"])
def test_embeddings_before_the_cut_do_not_drift_under_zero_grad_keeping_zeros(
    factory: Any, optimizer: str
) -> None:
    """Full steps and steps under a depth or a learning set: after a full step the embeddings
    (GPT-2's wpe and wte, Llama's embed_tokens) get no gradient, so they keep still, as in plain
    autograd stepping only what got a gradient."""
    ours, batch, loss_fn = factory()
    ref = copy.deepcopy(ours)
    opt, ref_opt = (OPTIMIZERS[optimizer](list(m.parameters())) for m in (ours, ref))
    gate = gg.BackpropGate(ours)
    for t, plan in enumerate(PLANS):
        set_plan(gate, plan)
        still = embeddings(ours)
        loss_fn(ours, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        reference_step(ref, batch, loss_fn, plan)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert_same(ours, ref, f"step {t}")
        for name, now in embeddings(ours).items():
            assert torch.equal(now, still[name]) == (plan[0] != "none"), (t, name)
            assert (ours.get_parameter(name).grad is None) == (plan[0] != "none"), (t, name)
    gate.remove()


@pytest.mark.parametrize(
    ("factory", "optimizer"), [(gpt2, "adamw"), (llama, "sgd")], ids=["gpt2", "llama"]
)
def test_an_embedding_named_in_the_learning_set_learns_as_plain_torch(
    factory: Any, optimizer: str
) -> None:
    """Named, the embedding learns at every step (its zeros kept, as plain torch keeps them);
    the other embeddings before the cut keep still."""
    ours, batch, loss_fn = factory()
    ref = copy.deepcopy(ours)
    name = next(n for n in NAMES if n in dict(ours.named_modules()))
    opt, ref_opt = (OPTIMIZERS[optimizer](list(m.parameters())) for m in (ours, ref))
    gate = gg.BackpropGate(ours)
    for t, plan in enumerate([("none", None), ("learn", {2, name}), ("learn", {2, name})]):
        set_plan(gate, plan)
        before = ours.get_parameter(f"{name}.weight").detach().clone()
        loss_fn(ours, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        reference_step(ref, batch, loss_fn, plan)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert_same(ours, ref, f"step {t}")
        assert not torch.equal(ours.get_parameter(f"{name}.weight"), before), t
    gate.remove()


def test_a_tied_embedding_learns_through_the_head_after_the_cut() -> None:
    """GPT-2's wte is lm_head's weight: under a cut it learns through the head (its use before
    the cut gives nothing) and moves at every step; wpe keeps still."""
    ours, batch, loss_fn = gpt2(tied=True)
    assert ours.lm_head.weight is ours.transformer.wte.weight
    ref = copy.deepcopy(ours)
    opt, ref_opt = (OPTIMIZERS["sgd"](list(m.parameters())) for m in (ours, ref))
    gate = gg.BackpropGate(ours)
    for t, plan in enumerate([("none", None), ("depth", 1), ("learn", {1}), ("depth", 0)]):
        set_plan(gate, plan)
        wte = ours.transformer.wte.weight.detach().clone()
        wpe = ours.transformer.wpe.weight.detach().clone()
        with warnings.catch_warnings():  # wte's use before the cut: said, and expected
            warnings.simplefilter("ignore", gg.SharedParameterWarning)
            loss_fn(ours, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        reference_step(ref, batch, loss_fn, plan, embedding="transformer.wte")
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert_same(ours, ref, f"step {t}")
        assert not torch.equal(ours.transformer.wte.weight, wte), t
        assert torch.equal(ours.transformer.wpe.weight, wpe) == (t > 0), t
    gate.remove()


def test_a_gradient_the_user_gives_an_embedding_is_applied() -> None:
    """A .grad written on wpe between steps (a new tensor, or in place into the zeros), or got
    from a separate backward, is the user's: the step applies it, as plain torch would. Once
    applied, what is left of it is dropped like any left-over gradient."""
    ours, batch, loss_fn = gpt2()
    ref = copy.deepcopy(ours)
    opt, ref_opt = (OPTIMIZERS["sgd"](list(m.parameters())) for m in (ours, ref))
    gate = gg.BackpropGate(ours)
    cut: Plan = ("depth", 1)
    written = torch.randn(ours.transformer.wpe.weight.shape, generator=torch.Generator())
    ways = ["none", "new tensor", "in place", "separate backward", "left over", "new tensor"]
    for t, way in enumerate(ways):
        plan = ("none", None) if t == 0 else cut
        set_plan(gate, plan)
        for model in (ours, ref):
            wpe = model.transformer.wpe.weight
            if way == "new tensor" or (way == "in place" and wpe.grad is None):
                wpe.grad = written.clone() * t
            elif way == "in place":
                wpe.grad.copy_(written * t)  # the zeros zero_grad left, written over
        before = ours.transformer.wpe.weight.detach().clone()
        loss_fn(ours, batch).backward()
        reference_step(ref, batch, loss_fn, plan)
        if way == "separate backward":
            for model in (ours, ref):
                wpe = model.transformer.wpe.weight
                (wpe * written).sum().backward()
        given = ours.transformer.wpe.weight.grad
        given = None if given is None else given.clone()
        opt.step()
        ref_opt.step()
        assert_same(ours, ref, f"step {t} ({way})")
        moved = not torch.equal(ours.transformer.wpe.weight, before)
        assert moved == (way != "left over"), (t, way)
        if way not in ("none", "left over"):
            assert given is not None and given.any(), (t, way)
            assert torch.equal(ours.transformer.wpe.weight.grad, given), (t, way)  # kept
        opt.zero_grad(set_to_none=False)
        ref_opt.zero_grad(set_to_none=True)
    gate.remove()


def test_each_optimizer_drops_only_what_it_applied_already() -> None:
    """Two optimizers, the embeddings' and the rest's, stepping one after the other: a full
    step's gradient on wpe is the embeddings' optimizer's to apply (the other's step before it
    neither drops nor counts it as applied); under the cut, its zeros are dropped."""
    ours, batch, loss_fn = gpt2()
    ref = copy.deepcopy(ours)

    def split(model: nn.Module) -> list[torch.optim.Optimizer]:
        embeds = [model.transformer.wte.weight, model.transformer.wpe.weight]
        rest = [p for p in model.parameters() if all(p is not e for e in embeds)]
        return [OPTIMIZERS["sgd"](rest), OPTIMIZERS["sgd"](embeds)]

    opts, ref_opts = split(ours), split(ref)
    gate = gg.BackpropGate(ours)
    plans: list[Plan] = [("none", None), ("none", None), ("depth", 1), ("depth", 1)]
    for t, plan in enumerate(plans):
        set_plan(gate, plan)
        wpe = ours.transformer.wpe.weight.detach().clone()
        loss_fn(ours, batch).backward()
        reference_step(ref, batch, loss_fn, plan)
        for opt, ref_opt in zip(opts, ref_opts, strict=True):
            if opt is opts[1] and t == 2:  # the rest's step left wpe's zeros: not its own
                assert ours.transformer.wpe.weight.grad is not None, t
            opt.step()
            ref_opt.step()
        assert_same(ours, ref, f"step {t}")
        assert torch.equal(ours.transformer.wpe.weight, wpe) == (t >= 2), t
        for opt, ref_opt in zip(opts, ref_opts, strict=True):
            opt.zero_grad(set_to_none=False)
            ref_opt.zero_grad(set_to_none=True)
    gate.remove()


class Prefixed(nn.Module):
    """Blocks with parameters of the model's own around them, as ViT and CLIP hold theirs: a
    position embedding added before the blocks, a scale applied after them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pos = nn.Parameter(torch.randn(4))
        self.blocks = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 1)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x + self.pos)) * self.scale


def test_a_bare_parameter_of_the_model_before_the_cut_does_not_drift() -> None:
    """Also a parameter no module around the blocks holds; the gate made after a step (zeros
    left from before it) drops those zeros too. The one used after the blocks learns."""
    model = Prefixed()
    opt = OPTIMIZERS["adamw"](list(model.parameters()))
    x = torch.randn(2, 4)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    gate = gg.BackpropGate(model, depth=1)
    for _ in range(2):
        pos, first = model.pos.detach().clone(), model.blocks[0].weight.detach().clone()
        head, scale = model.head.weight.detach().clone(), model.scale.detach().clone()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        assert torch.equal(model.pos, pos) and torch.equal(model.blocks[0].weight, first)
        assert not torch.equal(model.head.weight, head) and not torch.equal(model.scale, scale)
        assert model.pos.grad is None
    gate.remove()


def test_what_one_optimizer_applied_is_not_what_another_has_yet_to_apply() -> None:
    """The scale learns after the cut at every step, its zeros and new gradient in one .grad:
    the step of the optimizer that does not hold it comes first and must not count that
    gradient as applied, or the scale's own optimizer would find it unchanged and drop it."""
    ours, ref = Prefixed(), Prefixed()

    def split(model: Prefixed) -> list[torch.optim.Optimizer]:
        own = [model.pos, model.scale]
        rest = [p for p in model.parameters() if all(p is not o for o in own)]
        return [OPTIMIZERS["sgd"](rest), OPTIMIZERS["sgd"](own)]

    opts, ref_opts = split(ours), split(ref)
    gate = gg.BackpropGate(ours, depth=1)
    for t in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(t))
        ours(x).sum().backward()
        learners = [*ref.blocks[2].parameters(), *ref.head.parameters(), ref.scale]
        with torch.no_grad():
            h = ref.blocks[:2](x + ref.pos)
        grads = torch.autograd.grad((ref.head(ref.blocks[2](h)) * ref.scale).sum(), learners)
        for param, grad in zip(learners, grads, strict=True):
            param.grad = grad
        for opt, ref_opt in zip(opts, ref_opts, strict=True):
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=False)
            ref_opt.zero_grad(set_to_none=True)
        assert_same(ours, ref, f"step {t}")
    gate.remove()


def test_in_steady_steps_the_guard_reads_no_gradient_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether a .grad is all zero costs a host sync: the guard asks only at a step under a cut
    that follows one where the parameter learned. The head, the final norm and the weight tied
    to the head learn at every plan, a named embedding is a learner, and with no cut all learn:
    none is asked about."""
    from gradgate._cut import stale_grads

    asked: list[int] = []
    all_zero = stale_grads._all_zero
    monkeypatch.setattr(
        stale_grads, "_all_zero", lambda params: asked.append(len(params)) or all_zero(params)
    )
    ours, batch, loss_fn = gpt2(tied=True)
    opt = OPTIMIZERS["sgd"](list(ours.parameters()))
    gate = gg.BackpropGate(ours)
    per_step = []
    plans: list[Plan] = [("none", None), ("depth", 1), ("depth", 1), ("depth", 2)]
    plans += [("learn", {1, "transformer.wpe"}), ("learn", {1, "transformer.wpe"})]
    plans += [("none", None), ("none", None), ("none", None)]  # no cut: all around learns
    for t, plan in enumerate(plans):
        set_plan(gate, plan)
        gate.skip = {0} if t == len(plans) - 1 else None  # DropBP cuts nowhere either
        with warnings.catch_warnings():  # wte's use before the cut: said, and expected
            warnings.simplefilter("ignore", gg.SharedParameterWarning)
            loss_fn(ours, batch).backward()
        asked.clear()
        opt.step()
        opt.zero_grad(set_to_none=False)
        per_step.append(list(asked))
    assert per_step == [[], [1], *[[]] * 7]  # wpe once, after the full step
    gate.remove()


class Normed(nn.Module):
    """A norm after each block, from a list of their own: code between the blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(3))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, norm in zip(self.blocks, self.norms, strict=True):
            x = norm(x + torch.tanh(block(x)))
        return self.head(x)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_norms_between_the_blocks_step_as_with_zero_grad_setting_none(optimizer: str) -> None:
    """The norms between the blocks learn from the first learner on and get nothing before it
    (frozen there): whatever the plans, zero_grad(set_to_none=False) moves exactly what
    set_to_none=True moves, and a norm that got no gradient keeps still."""
    ours, twin = Normed(), Normed()
    opts = [OPTIMIZERS[optimizer](list(m.parameters())) for m in (ours, twin)]
    gates = [gg.BackpropGate(m) for m in (ours, twin)]
    plans: list[Plan] = [("none", None), ("learn", {0, 2}), ("depth", 1), ("learn", {1})]
    plans += [("learn", {2, "norms.0"}), ("depth", 0), ("learn", {0, 2}), ("learn", {1})]
    for t, plan in enumerate(plans):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(t))
        norms = [n.weight.detach().clone() for n in ours.norms]
        for model, gate, opt, set_to_none in zip(
            (ours, twin), gates, opts, (False, True), strict=True
        ):
            set_plan(gate, plan)
            model(x).sum().backward()
            got = [n.weight.grad is not None for n in model.norms]
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        assert_same(ours, twin, f"step {t} {plan}")
        for i, norm in enumerate(ours.norms):  # the twin's: None where nothing came
            assert torch.equal(norm.weight, norms[i]) == (not got[i]), (t, i)
    assert got != [True] * 3  # some steps leave some norms out
    for gate in gates:
        gate.remove()
