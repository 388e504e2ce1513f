"""Selection traps a new user hits (issue 37): one block gated alone, lazy modules, flat
Sequentials with norms and a classifier, integers as module names, duplicate block names."""

from __future__ import annotations

import copy

import pytest
import torch
from models import tiny_gpt2
from torch import nn

import gradgate as gg


class Residual(nn.Module):
    """A pre-norm residual block whose MLP is an nn.Sequential."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)
        self.blocks = nn.ModuleList(Residual() for _ in range(n))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _hooks(model: nn.Module) -> list[int]:
    names = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
    return [
        sum(len(getattr(m, h)) for h in names) + ("forward" in vars(m)) for m in model.modules()
    ]


# -- item 3: one block of a bigger model, gated alone ---------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: tiny_gpt2(4).transformer.h[3], id="gpt2-block"),
        pytest.param(lambda: Net().blocks[3], id="residual-block-with-sequential-mlp"),
        pytest.param(lambda: nn.TransformerEncoderLayer(8, 2), id="torch-encoder-layer"),
    ],
)
def test_a_single_block_gated_alone_is_refused_without_a_child_list(make) -> None:
    block = make()
    before = _hooks(block)
    for call in (gg.blocks, lambda m: gg.BackpropGate(m, depth=1)):
        with pytest.raises(gg.NoBlocksError) as error:
            call(block)
        text = str(error.value)
        assert f"{type(block).__name__} looks like a single block" in text
        assert "gate the model that contains it" in text
        assert "blocks=[" not in text  # no child list to paste: it would cut inside the block
        for child in ("ln_1", "attn", "mlp.0", "mlp.2", "norm", "self_attn", "linear1"):
            assert repr(child) not in text
    assert _hooks(block) == before


def test_the_model_that_contains_the_block_finds_the_blocks_and_trains_the_last_one() -> None:
    model = tiny_gpt2(4)
    assert gg.blocks(model) == [f"transformer.h.{i}" for i in range(4)]
    net = Net()
    assert gg.blocks(net) == [f"blocks.{i}" for i in range(4)]
    x = torch.randn(2, 3)
    reference = copy.deepcopy(net)
    params = dict(reference.named_parameters())
    wanted = [n for n in params if n.startswith(("blocks.3.", "head."))]
    expected = torch.autograd.grad(reference(x).sum(), [params[n] for n in wanted])
    with gg.backprop_depth(net, 1):
        net(x).sum().backward()
    got = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(wanted)
    for name, grad in zip(wanted, expected, strict=True):
        torch.testing.assert_close(got[name], grad)


def test_a_model_with_a_flat_stack_and_a_final_norm_keeps_its_stack() -> None:
    # The single-block rule drops only an MLP (two layers) inside a block-like module.
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(3, 8)
            self.layers = nn.Sequential(
                *[m for _ in range(3) for m in (nn.Linear(8, 8), nn.ReLU())]
            )
            self.norm = nn.LayerNorm(8)
            self.head = nn.Linear(8, 1)

    assert gg.blocks(Model()) == ["layers.0", "layers.2", "layers.4"]


def test_a_single_block_can_still_be_gated_over_blocks_named_explicitly() -> None:
    block = Net().blocks[0]
    with gg.BackpropGate(block, blocks=["mlp.0", "mlp.2"], depth=1) as gate:
        assert gate.blocks == ["mlp.0", "mlp.2"]
        block(torch.randn(2, 8)).sum().backward()
    assert block.mlp[0].weight.grad is None and block.mlp[2].weight.grad is not None


# -- item 13: lazy modules ---------------------------------------------------------------------
def lazy_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(1))


LAZY_CALLS = {
    "blocks": lambda m: gg.blocks(m),
    "select": lambda m: gg.select(m, "0"),
    "BackpropGate": lambda m: gg.BackpropGate(m, depth=1),
    "backprop_depth": lambda m: gg.backprop_depth(m, 1),
    "stop_gradient_at": lambda m: gg.stop_gradient_at(m, "2"),
    "freeze": lambda m: gg.freeze(m, "0"),
    "unfreeze": lambda m: gg.unfreeze(m, "0"),
    "capture_grads": lambda m: gg.capture_grads(m, "2"),
    "scale_grad": lambda m: gg.scale_grad(m, "2", 0.5),
    "estimate": lambda m: gg.estimate(m, torch.randn(2, 3)),
    "optim.param_groups": lambda m: gg.optim.param_groups(m, lr=0.1),
}


@pytest.mark.parametrize("name", sorted(LAZY_CALLS))
def test_a_lazy_module_is_refused_with_the_fix_before_its_first_forward(name: str) -> None:
    model = lazy_net()
    before = _hooks(model)
    with pytest.raises(gg.GradgateError) as error:
        LAZY_CALLS[name](model)
    text = str(error.value)
    assert "'0.weight' (LazyLinear)" in text and "not initialized yet" in text
    assert "run one forward first" in text
    assert _hooks(model) == before
    assert all(nn.parameter.is_lazy(p) for p in model.parameters())  # nothing was applied


def test_a_lazy_module_works_after_one_forward() -> None:
    model = lazy_net()
    x = torch.randn(2, 3)
    model(x)  # the forward that initializes it
    assert gg.blocks(model) == ["0", "2", "4"]
    reference = copy.deepcopy(model)
    expected = torch.autograd.grad(reference(x).sum(), [reference[4].weight, reference[4].bias])
    with gg.backprop_depth(model, 1):
        model(x).sum().backward()
    assert model[0].weight.grad is None and model[2].weight.grad is None
    torch.testing.assert_close((model[4].weight.grad, model[4].bias.grad), expected)
    with gg.frozen(model, "0"):
        assert not model[0].weight.requires_grad
    assert gg.estimate(model, x).rows


# -- item 14: a flat Sequential's blocks are its repeated compute layers ---------------------------
def flat_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for cin, cout in ((3, 4), (4, 4), (4, 8)):
        layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def test_a_flat_cnn_has_its_convolutions_as_blocks_not_its_norms_or_classifier() -> None:
    assert gg.blocks(flat_cnn()) == ["0", "3", "6"]
    with gg.BackpropGate(flat_cnn(), depth=1) as gate:
        assert gate.blocks == ["0", "3", "6"]


def test_a_flat_cnn_at_depth_1_trains_its_last_conv_its_norm_and_the_classifier() -> None:
    model = flat_cnn()
    x = torch.randn(2, 3, 8, 8)
    reference = copy.deepcopy(model)
    params = dict(reference.named_parameters())
    wanted = [n for n in params if n.split(".")[0] in ("6", "7", "11")]
    expected = torch.autograd.grad(reference(x).sum(), [params[n] for n in wanted])
    with gg.backprop_depth(model, 1):
        model(x).sum().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(wanted)
    for name, grad in zip(wanted, expected, strict=True):
        torch.testing.assert_close(got[name], grad)


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        ([nn.Linear(4, 4) for _ in range(6)], [str(i) for i in range(6)]),  # README's example
        (
            [*(m for _ in range(3) for m in (nn.Linear(8, 8), nn.ReLU())), nn.Linear(8, 2)],
            ["0", "2", "4", "6"],  # an MLP: every Linear, the last one too
        ),
        (
            [nn.Linear(4, 4), nn.LayerNorm(4), nn.ReLU(), nn.Linear(4, 4), nn.LayerNorm(4)],
            ["0", "3"],
        ),
        ([nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)], ["1", "2", "3"]),
    ],
)
def test_flat_sequentials_count_their_repeated_compute_layers(layers, expected) -> None:
    assert gg.blocks(nn.Sequential(*layers)) == expected


def test_a_flat_sequential_whose_layers_do_not_repeat_has_no_blocks() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(36, 2)
    )
    with pytest.raises(gg.NoBlocksError, match=r"blocks=\['0', '4'\]"):
        gg.blocks(model)


# -- item 16: an integer is a block position in every call; a block named twice is refused -----
def mlp() -> nn.Sequential:
    torch.manual_seed(0)  # blocks '0', '2', '4': position 1 is the child named '2', not '1'
    return nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))


def _learned(model: nn.Module) -> list[str]:
    model.zero_grad(set_to_none=True)
    model(torch.randn(2, 3)).sum().backward()
    return [n for n, p in model.named_parameters() if p.grad is not None]


def _frozen_by(model: nn.Module, position: int | str) -> list[str]:
    gg.freeze(model, position)
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def _scaled_to_zero(model: nn.Module, position: int | str) -> list[str]:
    gg.scale_grad(model, position, 0.0)
    _learned(model)
    return [n for n, p in model.named_parameters() if not p.grad.abs().sum()]


def _captured(model: nn.Module, position: int | str) -> list[str]:
    store = gg.capture_grads(model, position)
    _learned(model)
    return list(store.keys())


def _learning_set(model: nn.Module, position: int | str) -> list[str]:
    gg.BackpropGate(model).learn = {position}
    return _learned(model)


def _stop_gradient(model: nn.Module, position: int | str) -> list[str]:
    gg.stop_gradient_at(model, position)
    return _learned(model)


POSITION_CALLS = {  # each call with block position 1 and with its name '2': the same effect
    "select": lambda m, p: gg.select(m, p),
    "freeze": _frozen_by,
    "capture_grads": _captured,
    "scale_grad": _scaled_to_zero,
    "blocks=": lambda m, p: gg.BackpropGate(m, blocks=[p, "4"]).blocks,
    "learn": _learning_set,
    "stop_gradient_at": _stop_gradient,
    "param_groups": lambda m, p: [g["name"] for g in gg.optim.param_groups(m, lr=0.1, blocks=[p])],
}


@pytest.mark.parametrize("name", sorted(POSITION_CALLS))
def test_an_integer_means_the_same_block_position_in_every_call(name: str) -> None:
    by_position = POSITION_CALLS[name](mlp(), 1)
    by_name = POSITION_CALLS[name](mlp(), "2")
    assert by_position == by_name
    assert by_position  # it did something
    if name == "blocks=":
        assert by_position == ["2", "4"]


@pytest.mark.parametrize(
    ("spec", "twice"),
    [
        (["0", "0"], "'0'"),
        (["0", "2", "0"], "'0'"),
        ([0, "0"], "'0'"),
        (["*", "2"], "'2'"),
        ([0, 0], "'0'"),
    ],
)
def test_a_block_named_twice_is_refused(spec, twice: str) -> None:
    model = mlp()
    before = _hooks(model)
    with pytest.raises(gg.InvalidOptionError) as error:
        gg.BackpropGate(model, blocks=spec)
    text = str(error.value)
    assert f"blocks={spec!r}" in text and f"names the block {twice} twice" in text
    assert "expected each block once" in text
    assert _hooks(model) == before
