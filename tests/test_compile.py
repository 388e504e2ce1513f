"""gg.compile_blocks: eager-equal gradients at every depth, <= 3 graphs, no recompiles."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradgate as gg
from gradgate._bench.compiled import compile_counts, schedule

BACKEND = "aot_eager"  # dynamo's guards and graphs do not depend on the backend; this is fast


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x)).tanh()


class Gate(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc(x).chunk(2, dim=-1)
        return x + a * b.sigmoid()


class Net(nn.Module):
    """Blocks of two classes, alternating, between an embedding and a head."""

    def __init__(self, n: int = 6, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(3, d)
        self.blocks = nn.ModuleList(Mlp(d) if i % 2 == 0 else Gate(d) for i in range(n))
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow  # a subprocess or a compile: seconds
def test_gradients_equal_eager_after_every_depth_change() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Net()
    compiled = copy.deepcopy(eager)
    x = torch.randn(4, 5, 3)
    start = counters["stats"]["unique_graphs"]
    n = len(eager.blocks)
    warm, rest = schedule(n)
    warm.append(n - 1)  # the warm-up puts each block class once first after the cut
    with (
        gg.BackpropGate(eager, "blocks.*") as eager_gate,
        gg.compile_blocks(compiled, "blocks.*", backend=BACKEND),
        gg.BackpropGate(compiled, "blocks.*") as compiled_gate,
    ):
        for step, depth in enumerate(warm + rest):
            if step == len(warm):
                after_warm_up = counters["stats"]["unique_graphs"]
            eager_gate.depth = compiled_gate.depth = depth
            for model in (eager, compiled):
                model.zero_grad(set_to_none=True)
                model(x).pow(2).mean().backward()
            expected, got = _grads(eager), _grads(compiled)
            for name, grad in expected.items():
                if grad is None:
                    assert got[name] is None, (depth, name)
                else:
                    torch.testing.assert_close(got[name], grad, msg=f"{name} at {depth}")
    graphs = counters["stats"]["unique_graphs"] - start
    assert graphs <= 3 * 2  # two block classes
    assert counters["stats"]["unique_graphs"] == after_warm_up  # no recompiles after warm-up


@pytest.mark.slow  # a subprocess or a compile: seconds
def test_bench_counts_three_graphs_and_no_recompiles() -> None:
    row = compile_counts("gradgate+compile", backend=BACKEND, size="tiny", n=4)
    assert row["graphs"] <= 3
    assert row["recompiles"] == 0
    assert row["recompile_limit_hits"] == 0


def test_handle_restores_the_original_forwards() -> None:
    net = Net(n=2)
    before = {name: vars(block).get("forward") for name, block in net.blocks.named_children()}
    handle = gg.compile_blocks(net, "blocks.*", backend=BACKEND)
    assert all("forward" in vars(block) for block in net.blocks)
    with pytest.raises(gg.InvalidOptionError, match=r"already compiled by gg\.compile_blocks"):
        gg.compile_blocks(net, "blocks.*", backend=BACKEND)
    handle.remove()
    handle.remove()
    after = {name: vars(block).get("forward") for name, block in net.blocks.named_children()}
    assert before == after == {"0": None, "1": None}
    assert net.blocks[0].forward.__func__ is Mlp.forward


def test_nothing_selected_is_a_clear_error() -> None:
    with pytest.raises(gg.UnknownModuleError, match=r"blocks=\[\] names no block"):
        gg.compile_blocks(Net(n=2), [], backend=BACKEND)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x).tanh()


def _whole_model_run(backend: str) -> tuple[int, int, dict[str, int]]:
    """torch.compile(model) of a gated model over every depth, twice; gradients against eager.

    Returns the graphs after the first pass, after both, and dynamo's graph-break reasons.
    """
    import warnings

    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    n = 4
    eager = nn.Sequential(nn.Linear(3, 8), *[Block(8) for _ in range(n)], nn.Linear(8, 2))
    model = copy.deepcopy(eager)
    x = torch.randn(4, 3)
    torch._dynamo.reset()
    counters.clear()
    blocks = [str(i) for i in range(1, n + 1)]
    graphs = []
    with (
        warnings.catch_warnings(record=True) as caught,
        gg.BackpropGate(eager, blocks) as eager_gate,
        gg.BackpropGate(model, blocks) as gate,
    ):
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend=backend)
        for _ in range(2):
            for depth in [None, *range(n + 1), None]:
                eager_gate.depth = gate.depth = depth
                for net, call in ((eager, eager), (model, compiled)):
                    net.zero_grad(set_to_none=True)
                    call(x).pow(2).mean().backward()
                pairs = zip(eager.named_parameters(), model.parameters(), strict=True)
                for (name, want), got in pairs:
                    if want.grad is None:
                        assert got.grad is None, (depth, name)
                    else:
                        torch.testing.assert_close(got.grad, want.grad, msg=f"{name} at {depth}")
            graphs.append(counters["stats"]["unique_graphs"])
    assert [str(w.message) for w in caught] == []
    return graphs[0], graphs[1], dict(counters["graph_break"])


_OPAQUE = "Skip calling `torch.compiler.disable()`d function"  # the gate's hooks, by design


@pytest.mark.slow  # a subprocess or a compile: seconds
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_whole_model_compile_is_exact_quiet_and_does_not_recompile(backend: str) -> None:
    """The hooks are one opaque eager call each: dynamo guards on no plan and breaks nowhere else.

    One graph per module class and grad state (prefix, first after the cut, suffix): 7 here.
    """
    first, total, breaks = _whole_model_run(backend)
    assert total == first <= 7  # no graph after the first pass over all depths
    assert [reason for reason in breaks if not reason.startswith(_OPAQUE)] == []


@pytest.mark.slow  # a subprocess or a compile: seconds
@pytest.mark.xfail(strict=True, reason="torch 2.13: each hook call is a graph break; 7 graphs")
def test_whole_model_compile_target_three_graphs_no_breaks() -> None:
    """Issue 13's target; gg.compile_blocks meets it (see docs/performance.md)."""
    _, total, breaks = _whole_model_run("eager")
    assert total <= 3
    assert breaks == {}
