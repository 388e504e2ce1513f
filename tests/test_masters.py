"""gg.optim.LearnerMasters: fp32 masters and state only for what learns, bit for bit.

Each run is compared after every step, bitwise, with a hand-written reference: an fp32 copy of
each learning parameter stepped by ``torch.optim.AdamW(foreach=False)``, copied back to bf16.
"""

from __future__ import annotations

import copy
import io
from collections import OrderedDict

import pytest
import torch
from torch import nn

import gradgate as gg

OPTS = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "foreach": False}
N = 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    """An embedding, ``n`` residual blocks and a head: a tiny bf16 MLP stack."""

    def __init__(self, n: int = N, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(n))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def batches(steps: int, dtype: torch.dtype = torch.bfloat16) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 8, generator=g).to(dtype), torch.randn(8, 1, generator=g))
        for _ in range(steps)
    ]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16) if t.element_size() == 2 else t.detach()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_params(a: nn.Module, b: nn.Module, where: str = "") -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert same(p, q), f"{where}: {name} differs"


class Reference:
    """Hand-written masters: an fp32 copy and an AdamW(foreach=False) per learning parameter,
    made from it when it starts learning, dropped when it rests (kept with ``keep=True``, and
    always for fp32 parameters, which the AdamW steps in place)."""

    def __init__(self, model: nn.Module, keep: bool = False, inner=torch.optim.AdamW, **opts):
        self.params = list(model.parameters())
        self.keep = keep
        self.inner, self.opts = inner, opts or OPTS
        self.copies: dict[torch.Tensor, tuple[torch.Tensor, torch.optim.Optimizer]] = {}

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                if not self.keep and p.dtype != torch.float32:
                    self.copies.pop(p, None)
                continue
            if p not in self.copies:
                master = p if p.dtype == torch.float32 else p.detach().float().clone()
                self.copies[p] = (master, self.inner([master], **self.opts))
            master, opt = self.copies[p]
            if master is not p:
                master.grad = p.grad.float()
            opt.step()
            if master is not p:
                p.copy_(master.to(p.dtype))
                master.grad = None
            p.grad = None


def hand_written_badam(order: str, steps: int, k: int, *, seed: int = 3) -> nn.Module:
    """The issue's reference: a new fp32 copy of the active block and a new AdamW at each
    switch, requires_grad toggled by hand (no gate); the head's copy and AdamW persist."""
    model = make()
    sched = gg.schedules.BAdam(N, k, order=order, seed=seed)
    head = list(model.head.parameters())
    head32 = [p.detach().float().clone() for p in head]
    head_opt = torch.optim.AdamW(head32, **OPTS)
    pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
    opt = head_opt
    for t, (x, y) in enumerate(batches(steps)):
        if t % k == 0:
            block = model.blocks[sched.active(t)]
            pairs = [(p, p.detach().float().clone()) for p in block.parameters()]
            opt = torch.optim.AdamW([m for _, m in pairs], **OPTS)
        for p in model.parameters():
            p.requires_grad_(False)
        for p, _ in [*pairs, *zip(head, head32, strict=True)]:
            p.requires_grad_(True)
        loss_of(model, x, y).backward()
        for p, m in [*pairs, *zip(head, head32, strict=True)]:
            m.grad = p.grad.float()
        opt.step()
        head_opt.step()
        with torch.no_grad():
            for p, m in [*pairs, *zip(head, head32, strict=True)]:
                p.copy_(m.to(torch.bfloat16))
        for p in model.parameters():
            p.grad = None
    return model


def badam_run(order: str, steps: int, k: int, *, drop=True, offload=None, seed=3, foreach=False):
    """LearnerMasters + the BAdam schedule on a gate; checks that resting parameters keep
    their bits at every step. Returns the model and the optimizer."""
    model = make()
    gate = gg.BackpropGate(model, "blocks.*")
    sched = gg.schedules.BAdam(N, k, order=order, seed=seed)
    options = {**OPTS, "foreach": foreach}
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), offload=offload, **options)
    for t, (x, y) in enumerate(batches(steps)):
        sched.apply(gate, t)
        loss_of(model, x, y).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.grad is None}
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            assert name not in before or same(before[name], p), f"step {t}: {name} moved"
        if drop:
            gg.optim.drop_finished(opt, gate, sched, t + 1)
    gate.remove()
    return model, opt


# -- exact ------------------------------------------------------------------------------------
@pytest.mark.parametrize("drop", [True, False], ids=["drop_finished", "alone"])
@pytest.mark.parametrize("order", ["random", "ascending", "descending"])
def test_badam_is_bitwise_the_hand_written_fp32_master_adamw(order: str, drop: bool) -> None:
    steps = 3 * N * 2  # three cycles of two steps a block
    model, opt = badam_run(order, steps, 2, drop=drop)
    assert_same_params(model, hand_written_badam(order, steps, 2), order)
    active = gg.schedules.BAdam(N, 2, order=order, seed=3).active(steps - 1)
    held = {p for p, entry in opt.state.items() if "master" in entry}
    expected = list(model.head.parameters())  # drop_finished drops the block before the switch
    expected += [] if drop else list(model.blocks[active].parameters())
    assert held == set(expected)
    assert opt.master_bytes() == sum(12 * p.numel() + 4 for p in expected)


def test_foreach_inside_gives_the_same_bits_on_the_cpu() -> None:
    model, _ = badam_run("random", N * 2, 2, foreach=True)
    assert_same_params(model, hand_written_badam("random", N * 2, 2), "foreach")


def test_masters_follow_every_step_within_a_window_and_a_block_is_reset_on_return() -> None:
    model, opt = badam_run("ascending", 2 * N + 2, 2, drop=False)  # block 0 again at 8, 9
    entry = opt.state[model.blocks[0].fc1.weight]
    assert entry["step"].item() == 2  # reset at its return, as BAdam does
    assert same(entry["master"].to(torch.bfloat16), model.blocks[0].fc1.weight)
    model, opt = badam_run("ascending", 2 * N + 2, 2, drop=False, offload="cpu")
    assert opt.state[model.blocks[0].fc1.weight]["step"].item() == 4  # kept on the CPU


@pytest.mark.parametrize("gated", [False, True], ids=["no-gate", "BAdam(1)"])
def test_one_block_holding_everything_is_fp32_adamw_up_to_the_bf16_copy(gated: bool) -> None:
    model = make()
    whole = nn.Sequential(OrderedDict(body=model))  # one block: the whole model
    gate = gg.BackpropGate(whole, "body") if gated else None
    sched = gg.schedules.BAdam(1, switch_every=2)
    masters = [p.detach().float().clone() for p in model.parameters()]
    plain = torch.optim.AdamW(masters, **OPTS)
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    for t, (x, y) in enumerate(batches(5)):
        if gate is not None:
            sched.apply(gate, t)
            assert sched.resting(t) == frozenset()
        loss_of(whole, x, y).backward()
        for p, m in zip(model.parameters(), masters, strict=True):
            m.grad = p.grad.float()
        opt.step()
        plain.step()
        opt.zero_grad()
        for p, m in zip(model.parameters(), masters, strict=True):
            assert same(opt.state[p]["master"], m)
            assert same(p, m.to(torch.bfloat16))
            assert same(opt.state[p]["exp_avg_sq"], plain.state[m]["exp_avg_sq"])


def test_the_tensors_kept_are_fp32_masters_and_moments() -> None:
    _, opt = badam_run("random", 3, 2)
    for entry in opt.state.values():
        assert entry["master"].dtype == entry["exp_avg"].dtype == torch.float32


# -- fp32 parameters: the inner optimizer, exactly ------------------------------------------
@pytest.mark.parametrize(
    "inner, opts",
    [
        (torch.optim.AdamW, OPTS),
        (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1}),
        (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    ],
    ids=["AdamW", "Adam-amsgrad", "SGD-nesterov"],
)
@pytest.mark.parametrize("drop", [True, False])
def test_fp32_parameters_are_stepped_as_the_inner_optimizer_alone(inner, opts, drop) -> None:
    ours, theirs = make(torch.float32), make(torch.float32)
    opt = gg.optim.LearnerMasters(inner, ours.parameters(), **opts)
    plain = inner(theirs.parameters(), **opts)
    sched = gg.schedules.BAdam(N, 2, seed=1)
    gates = [gg.BackpropGate(m, "blocks.*") for m in (ours, theirs)]
    for t, (x, y) in enumerate(batches(10, torch.float32)):
        for model, optimizer, gate in zip((ours, theirs), (opt, plain), gates, strict=True):
            sched.apply(gate, t)
            loss_of(model, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if drop:
                gg.optim.drop_finished(optimizer, gate, sched, t + 1)
        assert_same_params(ours, theirs, f"step {t}")
    assert all("master" not in entry for entry in opt.state.values())
    assert opt.master_bytes() == gg.optim.state_bytes(plain) == gg.optim.state_bytes(opt)


def test_a_mixed_model_gives_masters_to_bf16_only() -> None:
    model = make()
    model.head.float()  # a module kept in fp32 (HF's _keep_in_fp32_modules)
    twin = copy.deepcopy(model)
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    ref = Reference(twin)
    for x, y in batches(4):
        for m in (model, twin):
            (m.head(m.blocks[0](m.embed(x)).float()).float() - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ref.step()
        assert_same_params(model, twin)
    assert "master" not in opt.state[model.head.weight]
    assert opt.state[model.embed.weight]["master"].dtype == torch.float32


# -- offload -------------------------------------------------------------------------------
def test_offload_keeps_resting_state_on_the_cpu_and_brings_it_back_exactly() -> None:
    model, opt = badam_run("random", 3 * N * 2, 2, offload="cpu")
    twin = make()
    gate = gg.BackpropGate(twin, "blocks.*")
    sched = gg.schedules.BAdam(N, 2, order="random", seed=3)
    ref = Reference(twin, keep=True)
    for t, (x, y) in enumerate(batches(3 * N * 2)):
        sched.apply(gate, t)
        loss_of(twin, x, y).backward()
        ref.step()
    assert_same_params(model, twin, "offload")
    # the last drop_finished rested the last block: only the head is held on the device
    assert opt.master_bytes() == sum(12 * p.numel() + 4 for p in model.head.parameters())
    every = [p for p in model.parameters() if p is not model.embed.weight]
    every = [p for p in every if p is not model.embed.bias]
    assert gg.optim.state_bytes(opt) == sum(12 * p.numel() + 4 for p in every)
    gate.remove()


def test_drop_state_on_learner_masters_rests_and_returns_the_device_bytes() -> None:
    for offload in (None, "cpu"):
        model, opt = badam_run("ascending", 1, 2, drop=False, offload=offload)
        block = list(model.blocks[0].parameters())
        held = opt.master_bytes()
        freed = gg.optim.drop_state(opt, model.blocks[0])
        assert freed == sum(12 * p.numel() + 4 for p in block)
        assert opt.master_bytes() == held - freed
        assert (block[0] in opt.state) is (offload == "cpu")  # waits on the CPU, or is gone


# -- checkpoints -------------------------------------------------------------------------------
def _resumable_run(steps, *, offload, stop=None, saved=None):
    """BAdam + LambdaLR; stop at ``stop`` and return a checkpoint, or resume from ``saved``."""
    model = make(seed=9 if saved else 0)  # a resumed run starts from other weights: loaded
    gate = gg.BackpropGate(model, "blocks.*")
    sched = gg.schedules.BAdam(N, 2, order="random", seed=5)
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), offload=offload, **OPTS)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    start = 0
    if saved is not None:
        state = torch.load(io.BytesIO(saved))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        lr.load_state_dict(state["lr"])
        sched.load_state_dict(state["sched"])
        start = sched.next_step
    for t, (x, y) in list(enumerate(batches(steps)))[start:]:
        if t == stop:
            buffer = io.BytesIO()
            torch.save(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "lr": lr.state_dict(),
                    "sched": sched.state_dict(),
                },
                buffer,
            )
            gate.remove()
            return buffer.getvalue()
        sched.apply(gate, t)
        loss_of(model, x, y).backward()
        opt.step()
        lr.step()
        opt.zero_grad()
        gg.optim.drop_finished(opt, gate, sched, t + 1)
    gate.remove()
    return model, opt


@pytest.mark.parametrize("offload", [None, "cpu"])
@pytest.mark.parametrize("stop", [3, 4], ids=["mid-window", "at-a-switch"])
def test_a_resumed_run_continues_bit_for_bit(offload, stop) -> None:
    whole, whole_opt = _resumable_run(12, offload=offload)
    saved = _resumable_run(12, offload=offload, stop=stop)
    state = torch.load(io.BytesIO(saved))["opt"]["state"]
    assert {entry["master"].dtype for entry in state.values()} == {torch.float32}
    resumed, resumed_opt = _resumable_run(12, offload=offload, saved=saved)
    assert_same_params(whole, resumed, "resumed")
    for p, q in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert (p in whole_opt.state) == (q in resumed_opt.state)
        for key, value in whole_opt.state.get(p, {}).items():
            assert same(value, resumed_opt.state[q][key]), key


def test_a_plain_optimizer_checkpoint_loads_upcast_and_masters_come_from_the_weights() -> None:
    model = make()
    plain = torch.optim.AdamW(model.parameters(), **OPTS)
    for x, y in batches(2):
        loss_of(model, x, y).backward()
        plain.step()
        plain.zero_grad()
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    state = plain.state_dict()
    for entry in state["state"].values():  # on purpose: upcast (else refused, test_masters_api)
        entry.update({k: v.float() for k, v in entry.items() if k != "step"})
    opt.load_state_dict(state)
    weight = model.head.weight
    assert opt.state[weight]["exp_avg"].dtype == torch.float32
    assert same(opt.state[weight]["exp_avg"], plain.state[weight]["exp_avg"].float())
    assert "master" not in opt.state[weight]
    x, y = batches(3)[2]
    loss_of(model, x, y).backward()
    before = weight.detach().float().clone()
    opt.step()
    assert opt.state[weight]["step"].item() == 3
    assert not same(opt.state[weight]["master"], before)  # made from the weight, then stepped


def test_a_parameter_written_from_outside_gets_a_new_master() -> None:
    model = make()
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    opt.step()
    with torch.no_grad():
        model.head.weight.fill_(0.5)  # e.g. weights loaded into the model mid-run
    opt.step()
    expected = torch.full_like(model.head.weight, 0.5, dtype=torch.float32)
    assert (opt.state[model.head.weight]["master"] - expected).abs().max() < 0.1
    assert (model.head.weight.float() - 0.5).abs().max() < 0.1


def test_offload_counts_a_block_that_learns_again_on_the_device_at_every_step() -> None:
    """A block that rested (its entries on the CPU) and learns again is on the device again:
    master_bytes() counts it from the step it wakes, not only once everything rests."""
    model = make()
    gate = gg.BackpropGate(model, "blocks.*")
    sched = gg.schedules.BAdam(N, 1, order="ascending")
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), offload="cpu", **OPTS)
    for t, (x, y) in enumerate(batches(3 * N)):
        sched.apply(gate, t)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        learning = [*model.blocks[sched.active(t)].parameters(), *model.head.parameters()]
        assert opt.master_bytes() == sum(12 * p.numel() + 4 for p in learning), t
        assert all(v.device == p.device for p in learning for v in opt.state[p].values()
                   if isinstance(v, torch.Tensor) and v.dim())  # fmt: skip
        gg.optim.drop_finished(opt, gate, sched, t + 1)
    gate.remove()
