"""gg.graph: the autograd graph grouped by module, with frozen, cut and stop shown."""

from __future__ import annotations

import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from models import conv_stack, gpt2
from torch import nn

import gradgate as gg
from gradgate._observe.graph import (
    Graph,
    GraphNode,
    GraphvizError,
    GraphvizNotFoundError,
    NoGraphError,
)

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None,
    reason="Graphviz 'dot' is not installed (Debian package 'graphviz'): rendering untested",
)


# -- helpers ----------------------------------------------------------------------------------


def ops_in(g: Graph, module: str | None) -> list[GraphNode]:
    return [n for n in g.nodes if n.module == module and n.kind in ("op", "loss")]


def params_in(g: Graph, module: str) -> dict[str, str]:
    """Parameter short name -> node kind, for one cluster."""
    kinds = ("param", "frozen", "late_frozen", "cut")
    return {
        n.label.split("\n")[0]: n.kind for n in g.nodes if n.module == module and n.kind in kinds
    }


def dot_node_line(dot: str, node_id: str) -> str:
    return next(line for line in dot.splitlines() if line.strip().startswith(f"{node_id} ["))


def cluster_labels(dot: str) -> list[str]:
    return re.findall(r'graph \[label="([^"]*)"', dot)


def stop_targets(g: Graph) -> list[GraphNode]:
    return [g.node(edge.dst) for edge in g.stop_edges]


class ActorCritic(nn.Module):
    """DDPG-style pair: the actor's action feeds the critic."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.critic = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        action = self.actor(state)
        return self.critic(torch.cat([state, action], dim=-1))


# -- the seeds' conv stacks -------------------------------------------------------------------


def test_ten_convs_first_nine_frozen_shows_frozen_params_and_where_gradient_stops() -> None:
    model, x, loss_fn = conv_stack()
    with gg.frozen(model, "0:9"):
        loss = loss_fn(model, x)
        g = gg.graph(loss, model=model, collapse=False)
    dot = g.to_dot()
    assert list(g.clusters) == ["", *map(str, range(10))]
    for i in range(9):
        assert g.clusters[str(i)].state == "frozen"
        assert params_in(g, str(i)) == {"weight": "frozen", "bias": "frozen"}
        assert f'tooltip="{i}.weight (3, 3, 3, 3): frozen: no wgrad"' in dot
        assert ops_in(g, str(i)) == []
    assert g.clusters["9"].state == "learning"
    assert params_in(g, "9") == {"weight": "param", "bias": "param"}
    assert [n.label for n in ops_in(g, "9")] == ["ConvolutionBackward0"]
    # the stop marker points at conv 9's op: nothing above it requires grad
    assert stop_targets(g) == ops_in(g, "9")
    assert "nothing above requires grad" in g.node("stop").label
    conv9 = ops_in(g, "9")[0].id
    assert re.search(rf'stop -> {conv9} \[color="#c0392b", style="dashed"', dot)
    frozen_line = dot_node_line(dot, next(n.id for n in g.nodes if n.module == "0"))
    assert 'fillcolor="#e4e4e4"' in frozen_line  # greyed


def test_ten_convs_collapse_the_frozen_run_with_a_count() -> None:
    model, x, loss_fn = conv_stack()
    with gg.frozen(model, "0:9"):
        g = gg.graph(loss_fn(model, x), model=model)
    titles = [c.title for c in g.clusters.values()]
    assert titles == ["Sequential", "0–8 ×9 (Conv2d)\nfrozen", "9 (Conv2d)"]
    assert g.clusters["0"].members == tuple(map(str, range(9)))
    assert "0–8 ×9 (Conv2d)\\nfrozen" in g.to_dot()
    assert len([n for n in g.nodes if n.kind == "frozen"]) == 2  # one weight, one bias


def test_three_convs_middle_frozen_gradient_flows_through_it() -> None:
    model, x, loss_fn = conv_stack(3)
    with gg.frozen(model, "1"):
        g = gg.graph(loss_fn(model, x), model=model, collapse=False)
    assert {name: c.state for name, c in g.clusters.items()} == {
        "": "mixed",
        "0": "learning",
        "1": "frozen",
        "2": "learning",
    }
    # conv 1 still has its op (dgrad flows through it) but its parameters are frozen
    assert [n.label for n in ops_in(g, "1")] == ["ConvolutionBackward0"]
    assert params_in(g, "1") == {"weight": "frozen", "bias": "frozen"}
    op0, op1 = ops_in(g, "0")[0].id, ops_in(g, "1")[0].id
    assert any(e.src == op0 and e.dst == op1 for e in g.edges)
    assert g.stop_edges == []  # nothing is cut: the gradient reaches conv 0
    assert "stop [" not in g.to_dot()


def test_backprop_depth_two_draws_the_cut_dashed_and_the_stop_edge() -> None:
    model, x, loss_fn = conv_stack()
    with gg.backprop_depth(model, 2):
        g = gg.graph(loss_fn(model, x), model=model, collapse=False)
    dot = g.to_dot()
    for i in range(8):
        assert g.clusters[str(i)].state == "cut"
        assert params_in(g, str(i)) == {"weight": "cut", "bias": "cut"}
    assert [g.clusters[i].state for i in ("8", "9")] == ["learning", "learning"]
    labels = cluster_labels(dot)
    assert "7 (Conv2d)\\ncut: no graph" in labels
    cut_cluster = dot.split('label="7 (Conv2d)')[1].split("\n")[0]
    assert 'style="rounded,dashed,filled"' in cut_cluster
    assert stop_targets(g) == ops_in(g, "8")
    assert "cut: no graph recorded above" in g.node("stop").label
    # the stop hangs off the last cut module's cluster
    (to_stop,) = [e for e in g.edges if e.kind == "to_stop"]
    assert g.node(to_stop.src).module == "7"
    assert re.search(rf'{to_stop.src} -> stop \[.*ltail="cluster_8"', dot)

    collapsed = gg.graph(loss_fn(model, x), model=model)  # outside the gate: no cut
    assert collapsed.stop_edges == []
    with gg.backprop_depth(model, 2):
        collapsed = gg.graph(loss_fn(model, x), model=model)
    assert [c.title for c in collapsed.clusters.values()][1:] == [
        "0–7 ×8 (Conv2d)\ncut: no graph",
        "8–9 ×2 (Conv2d)",
    ]
    assert stop_targets(collapsed)[0].module == "8"


def test_late_freeze_is_marked_as_wasted_wgrad() -> None:
    model, x, loss_fn = conv_stack(2)
    loss = loss_fn(model, x)
    model[0].weight.requires_grad_(False)  # the seeds' misconception: too late
    g = gg.graph(loss, model=model, collapse=False)
    assert params_in(g, "0") == {"weight": "late_frozen", "bias": "param"}
    late = next(n for n in g.nodes if n.kind == "late_frozen")
    assert "wgrad wasted" in late.label
    assert "wgrad still computed" in late.tooltip
    assert any(e.src == late.id for e in g.edges)  # still in the autograd graph


# -- GPT-2 ------------------------------------------------------------------------------------


def test_gpt2_blocks_collapse_with_a_count_and_expand_on_request() -> None:
    model, batch, loss_fn = gpt2(layers=3)
    loss = loss_fn(model, batch)
    g = gg.graph(loss, model=model)
    blocks = [c for c in g.clusters.values() if c.type_name == "GPT2Block"]
    assert [(c.title, c.count) for c in blocks] == [("h.0–2 ×3 (GPT2Block)", 3)]
    assert "h.0–2 ×3 (GPT2Block)" in g.to_dot()
    assert all(c.state == "learning" for c in g.clusters.values() if c.state != "none")
    full = gg.graph(loss, model=model, collapse=False)
    titles = {c.title for c in full.clusters.values()}
    assert {"h.0 (GPT2Block)", "h.1 (GPT2Block)", "h.2 (GPT2Block)"} <= titles
    assert {"wte (Embedding)", "ln_f (LayerNorm)", "lm_head (Linear)"} <= titles
    # every parameter appears once, in its own module's cluster
    shown = {f"{n.module}.{n.label.split(chr(10))[0]}" for n in full.nodes if n.kind == "param"}
    assert shown == {name for name, _ in model.named_parameters()}
    # ops of one block nest in its sub-modules
    assert [n.label for n in ops_in(full, "transformer.h.1.attn.c_attn")] == ["AddmmBackward0"]
    assert len(full.nodes) > 3 * len(g.nodes) / 2


def test_gpt2_depth_two_shows_cut_blocks_and_the_stop_at_the_first_learning_block() -> None:
    model, batch, loss_fn = gpt2(layers=6)
    with gg.backprop_depth(model, 2):
        g = gg.graph(loss_fn(model, batch), model=model)
    blocks = {c.title: c.state for c in g.clusters.values() if c.type_name == "GPT2Block"}
    assert blocks == {
        "h.0–3 ×4 (GPT2Block)\ncut: no graph": "cut",
        "h.4–5 ×2 (GPT2Block)": "learning",
    }
    assert g.clusters["transformer.wte"].state == "cut"
    (target,) = stop_targets(g)
    assert (target.module, target.label) == ("transformer.h.4.ln_1", "NativeLayerNormBackward0")


def test_gpt2_24_blocks_build_and_render_fast(tmp_path: Path) -> None:
    model, batch, loss_fn = gpt2(layers=24)
    loss = loss_fn(model, batch)
    start = time.perf_counter()
    g = gg.graph(loss, model=model)
    dot = g.to_dot()
    built = time.perf_counter() - start
    assert "h.0–23 ×24 (GPT2Block)" in dot
    assert len(g.nodes) < 150  # legible: one block drawn, not 24
    assert built < 5.0
    if shutil.which("dot") is not None:
        start = time.perf_counter()
        g.render(tmp_path / "gpt2.svg")
        assert time.perf_counter() - start < 15.0
        assert "×24" in (tmp_path / "gpt2.svg").read_text()


# -- actor-critic -----------------------------------------------------------------------------


def test_critic_update_with_stop_gradient_shows_the_actor_cut() -> None:
    torch.manual_seed(0)
    pair, state = ActorCritic(), torch.randn(5, 4)
    with gg.stop_gradient_at(pair, "critic"):
        g = gg.graph(pair(state).mean(), model=pair, collapse=False)
    states = {name: c.state for name, c in g.clusters.items()}
    assert states["actor"] == "cut"
    assert states["actor.0"] == states["actor.2"] == "cut"
    assert states["critic"] == "learning"
    assert params_in(g, "actor.0") == {"weight": "cut", "bias": "cut"}
    assert ops_in(g, "actor.0") == ops_in(g, "actor.2") == []
    (target,) = stop_targets(g)
    assert (target.module, target.label) == ("critic.0", "AddmmBackward0")
    assert "actor (Sequential)\\ncut: no graph" in g.to_dot()


def test_actor_critic_without_a_cut_learns_everywhere() -> None:
    torch.manual_seed(0)
    pair, state = ActorCritic(), torch.randn(5, 4)
    g = gg.graph(pair(state).mean(), model=pair, collapse=False)
    assert g.clusters["actor"].state == g.clusters["critic"].state == "learning"
    assert g.stop_edges == []
    # the concatenation runs in the pair's own forward: drawn in the root cluster
    assert [n.label for n in ops_in(g, "")] == ["CatBackward0"]


# -- recording attribution --------------------------------------------------------------------


def test_recording_attributes_parameter_free_layers_exactly() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(2, 3)
    after = gg.graph(net(x).sum(), model=net, collapse=False)
    assert [n.label for n in ops_in(after, "")] == ["ReluBackward0"]  # best guess: the parent
    with gg.graph.recording(net) as rec:
        loss = net(x).sum()
    g = rec.graph(loss, collapse=False)
    assert [n.label for n in ops_in(g, "1")] == ["ReluBackward0"]
    assert g.clusters["1"].title == "1 (ReLU)"
    assert [n.label for n in ops_in(g, None)] == ["SumBackward0\nloss"]


def test_recording_removes_its_hooks_also_when_the_forward_raises() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(5, 1))

    def hook_count() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())

    def wrapped() -> int:  # the recording's hooks run around each module's forward
        return sum("forward" in vars(m) for m in net.modules())

    with pytest.raises(RuntimeError), gg.graph.recording(net):
        assert wrapped() == 3 and hook_count() == 0
        net(torch.randn(2, 3))  # shape mismatch in the second layer
    assert hook_count() == 0 and wrapped() == 0


def test_recording_gpt2_puts_every_model_op_in_a_module() -> None:
    model, batch, loss_fn = gpt2(layers=3)
    with gg.graph.recording(model) as rec:
        loss = loss_fn(model, batch)
    g = rec.graph(loss, collapse=False)
    # outside the model: only the loss computation
    assert sorted(n.label for n in ops_in(g, None)) == [
        "AddBackward0\nloss",
        "MeanBackward0",
        "MeanBackward0",
        "PowBackward0",
        "SelectBackward0",
    ]
    # the parameter-free GELU's ops land in its own module
    assert sorted(n.label for n in ops_in(g, "transformer.h.1.mlp.act")) == [
        "AddBackward0",
        "AddBackward0",
        "MulBackward0",
        "MulBackward0",
        "MulBackward0",
        "MulBackward0",
        "PowBackward0",
        "TanhBackward0",
    ]
    assert {n.label for n in ops_in(g, "lm_head")} == {
        "UnsafeViewBackward0",
        "MmBackward0",
        "ViewBackward0",
        "TBackward0",
    }
    collapsed = rec.graph(loss)
    assert "h.0–2 ×3 (GPT2Block)" in collapsed.to_dot()


# -- saved sizes, audit figures, escaping -----------------------------------------------------


def test_saved_sizes_label_the_ops() -> None:
    model, x, loss_fn = conv_stack(2)
    g = gg.graph(loss_fn(model, x), model=model, saved=True, collapse=False)
    (conv1,) = ops_in(g, "1")
    # conv 1 saves its input: 2 x 3 x 22 x 22 floats (weights are parameters, not counted)
    assert conv1.saved_bytes == 2 * 3 * 22 * 22 * 4
    assert "saved 11.3 KiB" in conv1.label
    assert "saved" not in gg.graph(loss_fn(model, x), model=model).to_dot().split("legend")[0]


@dataclass
class FakeRecord:
    name: str
    wgrad: int
    dgrad: int
    backward_flops: int


@dataclass
class FakeAudit:
    modules: list[FakeRecord]


def test_audit_figures_show_on_clusters_and_sum_over_collapsed_blocks() -> None:
    model, x, loss_fn = conv_stack(4)
    records = [FakeRecord(str(i), 2, int(i > 0), 1_500_000) for i in range(4)]
    g = gg.graph(loss_fn(model, x), model=model, audit=FakeAudit(records), collapse=False)
    assert g.clusters["0"].title == "0 (Conv2d)\nwgrad 2 · dgrad 0 · 1.5 MFLOP backward"
    collapsed = gg.graph(loss_fn(model, x), model=model, audit=FakeAudit(records[1:]))
    assert collapsed.clusters["0"].title.endswith("wgrad 6 · dgrad 3 · 4.5 MFLOP backward")
    as_mapping = type("Report", (), {"modules": {"2": {"wgrad": 1, "dgrad": 1}}})()
    g = gg.graph(loss_fn(model, x), model=model, audit=as_mapping, collapse=False)
    assert g.clusters["2"].title == "2 (Conv2d)\nwgrad 1 · dgrad 1"


def test_names_from_the_model_are_escaped() -> None:
    net = nn.ModuleDict({'say "hi"\\now': nn.Linear(2, 2)})
    loss = net['say "hi"\\now'](torch.randn(1, 2)).sum()
    dot = gg.graph(loss, model=net).to_dot()
    assert 'label="say \\"hi\\"\\\\now (Linear)"' in dot
    if shutil.which("dot") is not None:
        assert "say &quot;hi&quot;\\now" in gg.graph(loss, model=net).to_svg()


def test_without_a_model_the_graph_is_flat() -> None:
    net = nn.Linear(3, 1)
    x = torch.randn(2, 3, requires_grad=True)
    g = gg.graph(net(x).sum())
    assert g.clusters == {}
    assert Counter(n.kind for n in g.nodes) == {"loss": 1, "op": 2, "param": 2, "input": 1}
    assert "subgraph" not in g.to_dot(legend=False)
    assert {n.label for n in g.nodes if n.kind == "input"} == {"input\n(2, 3)"}


def test_several_losses_share_one_picture() -> None:
    pair, state = ActorCritic(), torch.randn(3, 4)
    actor_loss = pair.actor(state).pow(2).mean()
    critic_loss = pair(state).mean()
    g = gg.graph([actor_loss, critic_loss], model=pair, collapse=False)
    assert len([n for n in g.nodes if n.kind == "loss"]) == 2


# -- errors -----------------------------------------------------------------------------------


def test_loss_without_a_graph_is_a_clear_error() -> None:
    net = nn.Linear(2, 1)
    with torch.no_grad():
        loss = net(torch.randn(1, 2)).sum()
    with pytest.raises(NoGraphError, match=r"no autograd graph .*torch.no_grad\(\)"):
        gg.graph(loss, model=net)
    with pytest.raises(NoGraphError, match=r"loss=1.0 has type float; expected a torch\.Tensor"):
        gg.graph(1.0)  # type: ignore[arg-type]


def test_bad_options_name_the_value_and_the_choices(tmp_path: Path) -> None:
    net = nn.Linear(2, 1)
    loss = net(torch.randn(1, 2)).sum()
    g = gg.graph(loss, model=net)
    with pytest.raises(gg.InvalidOptionError, match=r"format='pdf' is not allowed.*'svg', 'png'"):
        g.render(tmp_path / "g.pdf")
    with pytest.raises(gg.InvalidOptionError, match=r"model has type str; expected a torch\.nn"):
        gg.graph(loss, model="net")  # type: ignore[arg-type]
    with pytest.raises(gg.InvalidOptionError, match=r"audit has type int and no \.modules"):
        gg.graph(loss, model=net, audit=3)


def test_missing_dot_names_the_graphviz_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = nn.Linear(2, 1)
    g = gg.graph(net(torch.randn(1, 2)).sum(), model=net)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(GraphvizNotFoundError, match="Debian/Ubuntu package 'graphviz'"):
        g.render(tmp_path / "g.svg")
    assert issubclass(GraphvizNotFoundError, gg.GradgateError)
    assert not (tmp_path / "g.svg").exists()


@needs_dot
def test_dot_failure_is_reported_with_its_message(monkeypatch: pytest.MonkeyPatch) -> None:
    net = nn.Linear(2, 1)
    g = gg.graph(net(torch.randn(1, 2)).sum(), model=net)
    monkeypatch.setattr(Graph, "to_dot", lambda self, legend=True: "digraph { a -> }")
    with pytest.raises(GraphvizError, match="failed with exit status"):
        g.to_svg()


# -- rendering --------------------------------------------------------------------------------


@needs_dot
def test_render_png_and_svg_with_clusters_and_legend(tmp_path: Path) -> None:
    model, x, loss_fn = conv_stack()
    with gg.backprop_depth(model, 2):
        g = gg.graph(loss_fn(model, x), model=model)
    png = g.render(tmp_path / "graph.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = g.render(tmp_path / "graph", format="svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert svg.count('class="cluster"') == len(g.clusters) + 1  # and the legend
    assert "0–7 ×8 (Conv2d)" in svg and "gradient stops here" in svg
    assert "frozen parameter: no wgrad" in svg
    assert g.to_svg() == svg


# -- inline display in Jupyter ----------------------------------------------------------------


@needs_dot
def test_jupyter_shows_the_svg_inline() -> None:
    model, x, loss_fn = conv_stack()
    with gg.backprop_depth(model, 2):
        g = gg.graph(loss_fn(model, x), model=model)
    svg = g._repr_svg_()
    assert svg is not None and "<svg" in svg and "gradient stops here" in svg
    assert g._repr_html_() is None  # so Jupyter picks the SVG


def test_jupyter_without_dot_shows_the_reason_and_the_dot_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    g = gg.graph(net(torch.randn(1, 2)).sum(), model=net)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert g._repr_svg_() is None
    html = g._repr_html_()
    assert html is not None and "not drawn" in html and "package &#x27;graphviz&#x27;" in html
    assert "DOT source" in html and "digraph gradgate {" in html
    assert "&lt;gradgate.Graph" in html and "<gradgate.Graph" not in html


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (2**20 - 1, "1.0 MiB"),  # not "1024.0 KiB"
        (3 * 2**29, "1.5 GiB"),
        (5 * 2**40, "5120.0 GiB"),
    ],
)
def test_saved_bytes_on_the_picture_take_the_unit_their_rounded_value_needs(
    size: int, text: str
) -> None:
    from gradgate._observe.graph.parts import format_bytes

    assert format_bytes(size) == text


@pytest.mark.parametrize(
    ("flops", "text"),
    [
        (0, "0 FLOP"),
        (999, "999 FLOP"),
        (1500, "1.5 kFLOP"),
        (999_960, "1.0 MFLOP"),  # not "1000.0 kFLOP"
        (999_999_999, "1.0 GFLOP"),  # not "1000.0 MFLOP"
        (2.5e12, "2500.0 GFLOP"),
    ],
)
def test_backward_flops_on_the_picture_take_the_unit_their_rounded_value_needs(
    flops: float, text: str
) -> None:
    from gradgate._observe.graph.parts import format_flops

    assert format_flops(flops) == text
