"""Block discovery and selection by names, globs and ranges."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import REAL_MODELS, conv_stack
from torch import nn

import gradgate as gg


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpt2", [f"transformer.h.{i}" for i in range(3)]),
        ("bert", [f"bert.encoder.layer.{i}" for i in range(3)]),
        ("llama", [f"model.layers.{i}" for i in range(3)]),
        ("cnn_bn", ["0", "1", "2", "3"]),
        ("long_skip", [f"blocks.{i}" for i in range(6)]),
    ],
)
def test_blocks_of_real_architectures(name: str, expected: list[str]) -> None:
    model, _, _ = REAL_MODELS[name]()
    assert gg.blocks(model) == expected


def test_blocks_of_a_plain_sequential_are_its_children_with_parameters() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    assert gg.blocks(model) == ["0", "2", "4"]  # a ReLU as a block would repeat depths
    assert gg.blocks(conv_stack(10)[0]) == [str(i) for i in range(10)]


def test_blocks_of_a_cnn_whose_stages_are_attributes() -> None:
    class Stage(nn.Sequential):
        pass

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3)
            self.stage1 = Stage(nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8))
            self.stage2 = Stage(nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16))
            self.stage3 = Stage(nn.Conv2d(16, 32, 3), nn.BatchNorm2d(32))
            self.fc = nn.Linear(32, 10)

    assert gg.blocks(Net()) == ["stage1", "stage2", "stage3"]


def test_repeated_composite_blocks_win_over_repeated_leaves() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token = nn.Embedding(1000, 4)  # many parameters, but leaves
            self.position = nn.Embedding(1000, 4)
            self.layers = nn.ModuleList(Block() for _ in range(2))

    assert gg.blocks(Net()) == ["layers.0", "layers.1"]


def test_no_blocks_raises_with_the_fix() -> None:
    with pytest.raises(gg.NoBlocksError, match=r"found no repeated block sequence in Linear"):
        gg.blocks(nn.Linear(2, 2))


def test_select_names_suffixes_globs_ranges_and_positions() -> None:
    model, _, _ = REAL_MODELS["bert"]()
    assert gg.select(model, "encoder.layer.1") == ["bert.encoder.layer.1"]
    assert gg.select(model, "encoder.layer.*") == [f"bert.encoder.layer.{i}" for i in range(3)]
    assert gg.select(model, "encoder.layer.1:") == ["bert.encoder.layer.1", "bert.encoder.layer.2"]
    assert gg.select(model, "encoder.layer.-1:") == ["bert.encoder.layer.2"]
    assert gg.select(model, "encoder.layer.[0:2]") == [
        "bert.encoder.layer.0",
        "bert.encoder.layer.1",
    ]
    assert gg.select(model, 0, slice(-1, None)) == ["bert.encoder.layer.0", "bert.encoder.layer.2"]
    assert gg.select(model, "**.LayerNorm")[:2] == [
        "bert.embeddings.LayerNorm",
        "bert.encoder.layer.0.attention.output.LayerNorm",
    ]
    assert gg.select(model, "classifier", "bert.pooler") == ["bert.pooler", "classifier"]


def test_select_errors_name_the_value_and_suggest_names() -> None:
    model, _, _ = REAL_MODELS["gpt2"]()
    with pytest.raises(gg.UnknownModuleError, match=r"'transformer\.h\.3' matches no module") as e:
        gg.select(model, "transformer.h.3")
    assert "Did you mean 'transformer.h.2'" in str(e.value)
    with pytest.raises(gg.AmbiguousNameError, match=r"'ln_1' matches 3 modules .*full qualified"):
        gg.select(model, "ln_1")
    with pytest.raises(
        gg.UnknownModuleError,
        match=r"got the block index 7, but the model has 3 blocks; expected an index in -3\.\.2",
    ):
        gg.select(model, 7)
    with pytest.raises(gg.UnknownModuleError, match=r"pattern 2.5 has type float"):
        gg.select(model, 2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("position", [1, np.int64(1), torch.tensor(1), [np.int64(1)]])
def test_a_numpy_or_0d_tensor_block_position_is_an_int_everywhere(position) -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.Tanh()) for _ in range(3)])
    gate = gg.BackpropGate(model, blocks=position, depth=1)
    try:
        assert gate.blocks == ["1"]
    finally:
        gate.remove()
    assert gg.select(model, *(position if isinstance(position, list) else [position])) == ["1"]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [("blocks.0:3", ["0", "1", "2"]), ("blocks.-3:", ["0", "1", "2"]), ("blocks.1:2", ["1"])],
)
def test_a_range_string_within_the_container_selects_its_members(pattern, expected) -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    assert gg.select(model, pattern) == [f"blocks.{i}" for i in expected]


@pytest.mark.parametrize("pattern", ["blocks.0:99", "blocks.-4:", "blocks.[2:4]", "blocks.5:"])
def test_a_range_string_out_of_range_is_refused_like_a_slice(pattern) -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    before = [p.requires_grad for p in model.parameters()]
    for call in (
        lambda: gg.select(model, pattern),
        lambda: gg.freeze(model, pattern),
        lambda: gg.BackpropGate(model, blocks=pattern),
    ):
        with pytest.raises(gg.UnknownModuleError) as info:
            call()
        text = str(info.value)
        assert repr(pattern) in text
        assert "'blocks' has 3 numbered children" in text
        assert "expected bounds in -3..3" in text and "'blocks.0:3'" in text
    assert [p.requires_grad for p in model.parameters()] == before
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
