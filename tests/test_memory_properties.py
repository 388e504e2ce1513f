"""The planner's peak against real CPU steps (``tests/live_bytes.py``) where one model shape
alone reaches a path: LearnerMasters over several chunks, a frozen block replayed in a later
row, autocast's weight cache; and a property test over random architectures, learning sets,
frozen modules, masters and autocast. Each row is equal to the byte, as in
``test_memory_peak.py``."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from live_bytes import LiveBytes
from test_memory_peak import real_peak
from torch import nn

import gradgate as gg
from gradgate._tools.masters import _chunks


def masters_loop(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return gg.optim.LearnerMasters(torch.optim.AdamW, params, lr=1e-3, foreach=False)


def test_masters_in_several_chunks_plan_the_steady_state_step() -> None:
    """LearnerMasters makes its masters chunk by chunk in its first step; a later step holds
    every master while the first (largest) chunk's temporaries live, higher than the first
    step ever was. A plan of the first step only was 3.75 MB under the real peak here."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 1024), nn.Linear(1024, 1152), nn.Linear(1152, 256),
                        nn.Linear(256, 64)).to(torch.bfloat16)  # fmt: skip
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    learners = [(i, p) for i, p in enumerate(net[1:].parameters())]
    assert len(_chunks(learners)) > 1  # the path this test is for
    plan = gg.estimate(net, x, depths=[3], masters="fp32", device="cpu")
    real, phase = real_peak(net, (x,), depth=3, optimizer=masters_loop)
    assert (plan[3].peak_bytes, plan[3].peak_phase) == (real, phase) == (38168600, "step")


class MLP(nn.Module):
    """A residual MLP block; a wide one's hidden activations are a transient even under
    ``no_grad``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def test_a_replayed_frozen_block_keeps_its_own_peak() -> None:
    """Depth 1 after depth 0 in one plan: blocks 0 and 1 run with grad off and are replayed
    from depth 0's record. Their hidden activations (4 MiB each) are the step's peak; a replay
    without the block's own rise read 1.4 MB against a real 9.6 MB."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(*[MLP(32, h) for h in (2048, 2048, 16)]), nn.Linear(32, 4))
    x = torch.randn(512, 32)
    plan = gg.estimate(net, x, depths=[0, 1], device="cpu")
    for row in plan.rows:
        assert (row.peak_bytes, row.peak_phase) == real_peak(net, (x,), depth=row.depth)
    assert plan[1].peak_phase == "forward" and plan[1].peak_bytes > 8 * 2**20


class Reused(nn.Module):
    """One linear layer applied six times in a forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            x = torch.tanh(self.layer(x))
        return x


def test_autocast_casts_a_weight_used_six_times_once() -> None:
    """autocast keeps one bf16 copy of a weight for the whole forward (its cache); a plan with
    a copy per use was 1.6 MB and 3.7 MB over the real peaks here."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(*[Reused(512) for _ in range(2)]), nn.Linear(512, 4))
    x = torch.randn(4, 512)
    plan = gg.estimate(net, x, depths=[1, 2], amp="bf16", device="cpu")
    for row in plan.rows:
        real = real_peak(net, (x,), depth=row.depth, amp=torch.bfloat16)
        assert (row.peak_bytes, row.peak_phase) == real, row.depth
    copies = 2 * 512 * 512  # one bf16 copy of each learning weight, not six
    assert plan[2].other_bytes < 6 * copies


# -- random architectures ---------------------------------------------------------------------


class Block(nn.Module):
    """One of five kinds: a linear layer, one applied twice, an MLP, a residual MLP, a
    LayerNorm then a linear."""

    def __init__(self, kind: str, width: int, hidden: int) -> None:
        super().__init__()
        self.kind = kind
        if kind in ("linear", "twice"):
            self.f: nn.Module = nn.Linear(width, width)
        elif kind == "norm":
            self.f = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width))
        else:
            self.f = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "twice":
            return self.f(torch.tanh(self.f(x)))
        return x + self.f(x) if self.kind == "residual" else self.f(x)


class Stack(nn.Module):
    def __init__(self, kinds: list[str], width: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(kind, width, hidden) for kind in kinds)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def two_real_steps(
    model: Stack, x: torch.Tensor, row: int | frozenset[int], precision: str
) -> tuple[int, str]:
    """The live-bytes peak of two real steps (forward, backward, step, zero_grad) with the
    gate set to ``row`` (a depth or a learning set), and its phase."""
    gate = gg.BackpropGate(model, "blocks.*")
    if isinstance(row, int):
        gate.depth = row
    else:
        gate.learn = row
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (
        masters_loop(params)
        if precision == "masters"
        else torch.optim.AdamW(params, lr=1e-3, foreach=False)
    )
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "amp" else None
    try:
        with LiveBytes(model, x) as counter, warnings.catch_warnings():
            warnings.simplefilter("ignore", gg.SharedParameterWarning)
            for _ in range(2):
                counter.phase = "forward"
                with amp or contextlib.nullcontext():
                    loss = model(x).sum()
                counter.phase = "backward"
                loss.backward()
                del loss
                counter.phase = "step"
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        gate.remove()
    return counter.peak, counter.peak_phase


@settings(max_examples=10, deadline=None, derandomize=True)
@given(data=st.data())
def test_the_plan_is_the_real_peak_on_random_architectures(data: Any) -> None:
    n = data.draw(st.integers(1, 4), label="blocks")
    kinds = data.draw(st.lists(st.sampled_from(["linear", "twice", "mlp", "residual", "norm"]),
                               min_size=n, max_size=n), label="kinds")  # fmt: skip
    width = data.draw(st.sampled_from([8, 24, 64]), label="width")
    hidden = data.draw(st.sampled_from([16, 96]), label="hidden")
    batch = data.draw(st.integers(1, 6), label="batch")
    precision = data.draw(st.sampled_from(["fp32", "masters", "amp"]), label="precision")
    row: int | frozenset[int] = data.draw(
        st.integers(0, n) | st.frozensets(st.integers(0, n - 1)), label="depth or learn"
    )
    frozen = data.draw(st.sets(st.integers(0, n - 1)), label="frozen blocks")
    torch.manual_seed(0)
    model = Stack(kinds, width, hidden)
    for index in frozen:
        model.blocks[index].requires_grad_(False)
    if precision == "masters":
        model = model.to(torch.bfloat16)
    x = torch.randn(batch, 8, dtype=next(model.parameters()).dtype)
    options: dict[str, Any] = {
        "masters": "fp32" if precision == "masters" else None,
        "amp": "bf16" if precision == "amp" else None,
    }
    # depth 0 first: its blocks run with grad off and are replayed in the drawn row
    depths, learn = ([0, row], None) if isinstance(row, int) else ([0], [row])
    plan = gg.estimate(model, x, depths=depths, learn=learn, blocks="blocks.*", device="cpu",
                       **options)  # fmt: skip
    for planned, real_row in zip(plan.rows, [0, row], strict=False):
        real = two_real_steps(model, x, real_row, precision)
        assert (planned.peak_bytes, planned.peak_phase) == real, real_row
