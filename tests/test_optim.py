"""gg.optim: groups per block, missing parameters added, optimizer state dropped (measured)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradgate as gg


def stack(n: int = 4, width: int = 8) -> nn.Module:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(3, width)
            self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(n)])
            self.head = nn.Linear(width, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x)
            for block in self.blocks:
                x = x + torch.tanh(block(x))
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


# -- param_groups ------------------------------------------------------------------------------
def test_param_groups_layerwise_decay_and_rest() -> None:
    net = stack()
    groups = gg.optim.param_groups(net, lr=1.0, decay=0.5, weight_decay=0.1)
    assert [(g["name"], g["lr"]) for g in groups] == [
        ("blocks.0", 0.125),
        ("blocks.1", 0.25),
        ("blocks.2", 0.5),
        ("blocks.3", 1.0),
        ("rest", 1.0),
    ]
    assert all(g["weight_decay"] == 0.1 for g in groups)
    assert [p for p in groups[1]["params"]] == list(net.blocks[1].parameters())
    rest = {id(p) for p in groups[-1]["params"]}
    assert rest == {id(p) for m in (net.embed, net.head) for p in m.parameters()}
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in net.parameters())  # each exactly once
    optimizer = torch.optim.AdamW(groups)
    assert [g["lr"] for g in optimizer.param_groups] == [0.125, 0.25, 0.5, 1.0, 1.0]


def test_param_groups_lr_per_block_rest_lr_and_shared_parameters() -> None:
    net = stack(n=3)
    net.blocks[2].weight = net.blocks[0].weight  # tied
    groups = gg.optim.param_groups(net, lr=[0.1, 0.2, 0.3], rest_lr=0.01)
    assert [g["lr"] for g in groups] == [0.1, 0.2, 0.3, 0.01]
    assert [len(g["params"]) for g in groups] == [2, 2, 1, 4]  # the tied weight once, first
    torch.optim.SGD(groups)  # no "some parameters appear in more than one group" error


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": [0.1, 0.2]}, r"lr has 2 rates; expected one per block \(4\)"),
        ({"lr": [0.1] * 4, "decay": 0.9}, r"decay=0.9 with a learning rate per block"),
        ({"lr": 0.1, "decay": 0}, r"decay=0; expected a number in \(0, 1\]"),
        ({"lr": "fast"}, r"lr='fast'; expected a number or a sequence"),
    ],
)
def test_param_groups_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(gg.InvalidOptionError, match=message):
        gg.optim.param_groups(stack(), **kwargs)


# -- add_missing -------------------------------------------------------------------------------
def test_add_missing_makes_unfrozen_parameters_train() -> None:
    net = stack()
    handle = gg.freeze(net, "blocks.*")
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    gg.unfreeze(net, "blocks.2", "blocks.3")
    before = copy.deepcopy(net.blocks)
    added = gg.optim.add_missing(optimizer, net, lr=0.05)
    assert added == ["blocks.2.weight", "blocks.2.bias", "blocks.3.weight", "blocks.3.bias"]
    assert gg.optim.add_missing(optimizer, net) == []  # nothing twice
    assert optimizer.param_groups[-1]["lr"] == 0.05
    net(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    moved = [not torch.equal(a.weight, b.weight) for a, b in zip(net.blocks, before, strict=True)]
    assert moved == [False, False, True, True]
    handle.undo()
    assert gg.optim.add_missing(optimizer, net, trainable_only=True) == [
        "blocks.0.weight",
        "blocks.0.bias",
        "blocks.1.weight",
        "blocks.1.bias",
    ]


def test_add_missing_can_add_frozen_ones_too() -> None:
    net = stack(n=2)
    with gg.frozen(net, "head"):
        optimizer = torch.optim.SGD(net.embed.parameters(), lr=0.1)
        assert gg.optim.add_missing(optimizer, net) == [
            f"blocks.{i}.{k}" for i in range(2) for k in ("weight", "bias")
        ]
        assert gg.optim.add_missing(optimizer, net, trainable_only=False) == [
            "head.weight",
            "head.bias",
        ]


# -- dropping state ----------------------------------------------------------------------------
def train_freezeout(drop: bool, steps: int = 12, n: int = 6, width: int = 32):
    net = stack(n=n, width=width)
    sched = gg.schedules.FreezeOut(n, total_steps=steps, first=0.25)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    torch.manual_seed(1)
    data = [torch.randn(8, 3) for _ in range(steps)]
    peak = 0
    with gg.BackpropGate(net, "blocks.*") as gate:
        for step, x in enumerate(data):
            sched.apply(gate, step)
            net(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if drop:
                gg.optim.drop_finished(optimizer, gate, sched, step + 1)
            peak = max(peak, gg.optim.state_bytes(optimizer))
    return net, optimizer, peak


def test_dropping_finished_state_changes_no_update_and_frees_the_moments() -> None:
    kept_net, kept, _ = train_freezeout(drop=False)
    dropped_net, dropped, _ = train_freezeout(drop=True)
    for a, b in zip(kept_net.parameters(), dropped_net.parameters(), strict=True):
        assert torch.equal(a, b)  # bit-identical training
    learned = [*kept_net.blocks.parameters(), *kept_net.head.parameters()]
    steps = 4 * sum(1 for p in learned)  # one float32 step counter per parameter
    assert gg.optim.state_bytes(kept) == 2 * param_bytes(learned) + steps
    head = list(dropped_net.head.parameters())
    assert gg.optim.state_bytes(dropped) == 2 * param_bytes(head) + 4 * len(head)
    ratio = gg.optim.state_bytes(kept) / param_bytes(kept_net.parameters())
    assert 1.8 < ratio < 2.0  # the 1.9x of the parameter bytes, kept for nothing


def test_lisa_keeps_optimizer_state_only_for_the_blocks_it_draws() -> None:
    # LISA's memory saving: layers that were not drawn hold no AdamW state (LMFlow's LISA
    # trainer resets the state of the layers it switches off); the always-learning ones keep it.
    n = 8
    net = stack(n=n)
    sched = gg.schedules.LISA(n, k=2, every=2, always=[0], seed=3)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    with gg.BackpropGate(net, "blocks.*") as gate:
        for step in range(12):
            sched.apply(gate, step)
            net(torch.randn(4, 3)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            gg.optim.drop_finished(optimizer, gate, sched, step + 1)
            now = sched.plan(step).learning(n)
            following = sched.plan(step + 1).learning(n)
            held = {i for i in range(n) if net.blocks[i].weight in optimizer.state}
            assert held == now & following, step  # learned now, and learns on
            assert net.head.weight in optimizer.state


def test_drop_finished_keeps_parameters_shared_with_a_learner() -> None:
    net = stack(n=3)
    net.blocks[0].weight = net.blocks[2].weight  # block 0 shares block 2's weight
    sched = gg.schedules.FreezeOut(3, stops=[1, 5, 5])
    optimizer = torch.optim.Adam(net.parameters())
    with gg.BackpropGate(net, "blocks.*") as gate:
        sched.apply(gate, 0)
        net(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        freed = gg.optim.drop_finished(optimizer, gate, sched, 1)
    assert freed == 2 * 8 * 4 + 4  # block 0's bias: two moments of 8 floats, a step counter
    assert net.blocks[2].weight in optimizer.state
    assert net.blocks[0].bias not in optimizer.state


def test_drop_finished_errors() -> None:
    net = stack(n=3)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = gg.schedules.FreezeOut(3, stops=[0, 0, 0])
    with pytest.raises(gg.InvalidOptionError, match=r"expected the gradgate\.BackpropGate"):
        gg.optim.drop_finished(optimizer, net, sched, 1)
    with (
        gg.BackpropGate(net, "blocks.*") as gate,
        pytest.raises(gg.InvalidOptionError, match="plans over 4 blocks but the gate has 3"),
    ):
        gg.optim.drop_finished(optimizer, gate, gg.schedules.FreezeOut(4, stops=[0] * 4), 1)
    # refused also where the schedule rests nothing yet (not at a later step)
    with pytest.raises(gg.InvalidOptionError, match=r"gate=a Net\): expected"):
        gg.optim.drop_finished(optimizer, net, gg.schedules.RandomDepth(3), 1)


def test_add_missing_from_named_parameters_only() -> None:
    net = stack(n=3)
    optimizer = torch.optim.SGD(net.head.parameters(), lr=0.1)
    pairs = [(n, p) for n, p in net.named_parameters() if n.startswith("blocks.1.")]
    assert gg.optim.add_missing(optimizer, pairs) == ["blocks.1.weight", "blocks.1.bias"]
    assert gg.optim.add_missing(optimizer, pairs) == []
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert id(net.blocks[0].weight) not in held and id(net.blocks[1].weight) in held


def adamw_reference(net, sched, steps: int, inputs, *, lr=0.01, wd=0.1) -> None:
    """LISA by hand: plain autograd, AdamW on the learners only, resting blocks' state reset."""
    betas, eps = (0.9, 0.999), 1e-8
    state: dict[int, list] = {}
    n = sched.n
    for step in range(steps):
        learning = sched.plan(step).learning(n)
        params = [p for i in sorted(learning) for p in net.blocks[i].parameters()]
        params += list(net.head.parameters())  # the embedding is before the cut
        grads = torch.autograd.grad(net(inputs[step]).pow(2).mean(), params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                t, m, v = state.get(id(p), [0, torch.zeros_like(p), torch.zeros_like(p)])
                t += 1
                m = betas[0] * m + (1 - betas[0]) * g
                v = betas[1] * v + (1 - betas[1]) * g * g
                p.mul_(1 - lr * wd)
                mhat, vhat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
                p.sub_(lr * mhat / (vhat.sqrt() + eps))
                state[id(p)] = [t, m, v]
        for i in sched.resting(step + 1):
            for p in net.blocks[i].parameters():
                state.pop(id(p), None)


def test_dropped_state_stays_dropped_under_zero_grad_set_to_none_false() -> None:
    # zero_grad(set_to_none=False) keeps a zero .grad: AdamW would step a resting block (weight
    # decay, old moments) and make its state again unless drop_state leaves .grad None.
    n, steps = 4, 8
    net = stack(n=n).double()
    reference = copy.deepcopy(net)
    inputs = [torch.randn(4, 3, dtype=torch.float64) for _ in range(steps)]
    sched = gg.schedules.LISA(n, k=1, every=2, seed=1, embeddings=False)  # as the reference
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    with gg.BackpropGate(net, "blocks.*") as gate:
        for step in range(steps):
            sched.apply(gate, step)
            net(inputs[step]).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            gg.optim.drop_finished(optimizer, gate, sched, step + 1)
            for i in sched.resting(step + 1):
                assert all(p.grad is None for p in net.blocks[i].parameters())
    adamw_reference(reference, sched, steps, inputs)
    for (name, a), b in zip(net.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    learners = [p for i in sched.plan(steps - 1).learning(n) for p in net.blocks[i].parameters()]
    learners += list(net.head.parameters())
    held = {id(p) for p in optimizer.state}
    assert held == {id(p) for p in learners} - {
        id(p) for i in sched.resting(steps) for p in net.blocks[i].parameters()
    }


def test_drop_state_of_a_frozen_block_keeps_it_still_without_a_gate() -> None:
    # No gate guards the step here: only drop_state's .grad = None keeps AdamW's weight decay
    # from moving the block and from making its state again (the 80 -> 664 bytes).
    net = stack(n=2)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    net(torch.randn(4, 3)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    net.blocks[0].requires_grad_(False)
    freed = gg.optim.drop_state(optimizer, net.blocks[0])
    assert freed == 2 * param_bytes(net.blocks[0].parameters()) + 2 * 4
    still = [p.detach().clone() for p in net.blocks[0].parameters()]
    before = gg.optim.state_bytes(optimizer)
    for _ in range(3):
        net(torch.randn(4, 3)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    for p, q in zip(net.blocks[0].parameters(), still, strict=True):
        assert torch.equal(p, q)
    assert gg.optim.state_bytes(optimizer) == before


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.f = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.f(self.ln(x)))


def normed_stack(n: int) -> nn.Module:
    net = stack(n=n)
    net.blocks = nn.ModuleList(Normed() for _ in range(n))
    return net


@pytest.mark.parametrize("hold", [False, True])
def test_lisa_always_names_of_blocks_and_of_modules_inside_blocks(hold: bool) -> None:
    # always=["blocks.0", "blocks.*.ln"]: block 0 and every block's norm learn at every step,
    # keep their AdamW state (Adam never restarts), and no draw is spent on block 0.
    from gradgate.integrations import Driver

    n, steps = 4, 9
    net = normed_stack(n)
    sched = gg.schedules.LISA(n, k=1, every=1, always=["blocks.0", "blocks.*.ln"], seed=2)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    driver = Driver(sched, gg.BackpropGate(net, "blocks.*"), blocks=None, log=True, drop_state=True)
    driver.attach(net)
    driver.hold_frozen = hold  # as the trainer callbacks do under activation checkpointing
    norms = [p for b in net.blocks for p in b.ln.parameters()]
    for step in range(steps):
        plan = driver.begin_step(step)
        assert 0 in plan.learning(n) and len(plan.learning(n)) == 2, (step, plan)
        assert all(p.requires_grad for p in [*net.blocks[0].parameters(), *norms])
        net(torch.randn(4, 3)).pow(2).mean().backward()
        assert all(p.grad is not None for p in [*net.blocks[0].parameters(), *norms])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        driver.end_step([optimizer], step + 1)
    for p in [*net.blocks[0].parameters(), *norms]:
        assert optimizer.state[p]["step"].item() == steps  # never dropped, never restarted
    assert 0 not in sched.resting(steps)
    driver.detach()
    driver.gate.remove()
