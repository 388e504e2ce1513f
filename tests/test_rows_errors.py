"""``gg.learn_rows`` refuses what it cannot do: an error naming the value and the fix, and
nothing applied to the model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from models import gpt2, llama
from torch import nn

import gradgate as gg


def snapshot(model: nn.Module) -> tuple[Any, ...]:
    """What learn_rows could change: parameters and flags, forwards, state-dict hooks."""
    return (
        [(n, p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)],
        [m.__dict__.get("forward") for m in model.modules()],
        [len(m._state_dict_hooks) + len(m._load_state_dict_pre_hooks) for m in model.modules()],
    )


OUT_OF_RANGE = (
    r"row 97 is out of range for 'model.embed_tokens', which has 97 rows \(0..96\)"
    r".*resize_token_embeddings"
)
EMPTY = r"rows is empty; expected at least one row index of 'model.embed_tokens' to learn"
BAD_ROWS = [
    ([3, 97], gg.InvalidOptionError, OUT_OF_RANGE),
    ([-1], gg.InvalidOptionError, r"row -1 is out of range"),
    ([5, 6, 5, 6], gg.InvalidOptionError, r"rows lists \[5, 6\] more than once.*set\(rows\)"),
    ([1.0, 2.0], gg.InvalidOptionError, r"rows holds 1.0 \(float\); expected integer row"),
    (torch.tensor([1.0, 2.0]), gg.InvalidOptionError, r"rows is a torch.float32 tensor; expected"),
    (torch.tensor([True, False]), gg.InvalidOptionError, r"rows is a torch.bool tensor"),
    (torch.tensor([[1, 2]]), gg.InvalidOptionError, r"rows has shape \(1, 2\); expected one"),
    ([], gg.InvalidOptionError, EMPTY),
    (torch.tensor([], dtype=torch.long), gg.InvalidOptionError, r"rows is empty"),
    (5, gg.InvalidOptionError, r"rows=5 \(int\); expected a list of row indices.*rows=\[32000\]"),
    ("5", gg.InvalidOptionError, r"rows='5' \(str\)"),
    ([True], gg.InvalidOptionError, r"rows holds True \(bool\)"),
    ([None], gg.InvalidOptionError, r"rows holds None \(NoneType\)"),
]


@pytest.mark.parametrize(("rows", "error", "message"), BAD_ROWS)
def test_bad_rows_are_refused_and_nothing_is_applied(rows: Any, error: type, message: str) -> None:
    model, _, _ = llama()
    before = snapshot(model)
    with pytest.raises(error, match=message):
        gg.learn_rows(model, "model.embed_tokens", rows=rows)
    assert snapshot(model) == before


def test_integer_rows_of_every_kind_are_taken() -> None:
    model, _, _ = llama()
    kinds = [
        [1, 2],
        (1, 2),
        range(1, 3),
        np.array([1, 2]),
        torch.tensor([1, 2], dtype=torch.int32),
        [np.int64(1), torch.tensor(2)],
    ]
    for rows in kinds:
        with gg.learn_rows(model, "model.embed_tokens", rows=rows) as handle:
            assert handle.rows == [1, 2]


MODULES = [
    (
        "model.layers.0.input_layernorm",
        r"'model.layers.0.input_layernorm' is a LlamaRMSNorm, which has no weight rows learn_rows"
        r" can follow; expected an nn.Embedding .* or an nn.Linear",
    ),
    ("model.layers.0", r"is a LlamaDecoderLayer, which has no weight rows"),
    ("model.embed", r"model.embed"),
    (3.5, r"module=3.5 \(float\); expected the name of an nn.Embedding or nn.Linear"),
]


@pytest.mark.parametrize(("module", "message"), MODULES)
def test_a_module_without_weight_rows_is_refused(module: Any, message: str) -> None:
    model, _, _ = llama()
    before = snapshot(model)
    with pytest.raises(gg.GradgateError, match=message):
        gg.learn_rows(model, module, rows=[1])
    assert snapshot(model) == before


def test_a_module_of_another_model_is_refused() -> None:
    model, _, _ = llama()
    with pytest.raises(gg.UnknownModuleError, match=r"not in LlamaForCausalLM"):
        gg.learn_rows(model, nn.Embedding(4, 4), rows=[1])


def test_a_module_object_is_taken() -> None:
    model, _, _ = llama()
    with gg.learn_rows(model, model.get_input_embeddings(), rows=[1]) as handle:
        assert handle.module == "model.embed_tokens"


def test_a_second_learn_rows_on_the_same_weight_is_refused() -> None:
    model, _, _ = gpt2(tied=True)
    first = gg.learn_rows(model, "transformer.wte", rows=[1, 2])
    before = snapshot(model)
    with pytest.raises(
        gg.RowsError,
        match=r"'transformer.wte' already learns rows \[1, 2\] through gg.learn_rows.*Remove",
    ):
        gg.learn_rows(model, "transformer.wte", rows=[3])
    with pytest.raises(
        gg.RowsError,
        match=r"'lm_head' is tied to 'transformer.wte', whose rows \[1, 2\] already learn through"
        r" gg.learn_rows of 'transformer.wte'",
    ):
        gg.learn_rows(model, "lm_head", rows=[3])
    assert snapshot(model) == before
    first.remove()
    gg.learn_rows(model, "lm_head", rows=[1, 2, 3]).remove()  # one call with all the rows


def test_max_norm_and_integer_weights_are_refused() -> None:
    with pytest.raises(gg.RowsError, match=r"max_norm=1.0: each forward renormalizes rows"):
        gg.learn_rows(nn.Embedding(4, 2, max_norm=1.0), "", rows=[1])
    emb = nn.Embedding(4, 2)
    emb.weight = nn.Parameter(torch.zeros(4, 2, dtype=torch.int8), requires_grad=False)
    with pytest.raises(gg.RowsError, match=r"is torch.int8 \(quantized or integer\)"):
        gg.learn_rows(emb, "", rows=[1])


def test_a_weight_tied_into_a_module_it_cannot_follow_is_refused() -> None:
    class Head(nn.Module):
        def __init__(self, weight: nn.Parameter) -> None:
            super().__init__()
            self.table = weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.table.t()

    emb = nn.Embedding(6, 3)
    model = nn.Sequential(emb, Head(emb.weight))
    with pytest.raises(
        gg.RowsError, match=r"is also '1.table' \(Head\), a use learn_rows cannot follow"
    ):
        gg.learn_rows(model, "0", rows=[1])
    assert [n for n, _ in model.named_parameters()] == ["0.weight"]


def test_a_ddp_wrapper_is_refused_with_the_order_to_use() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Embedding(6, 3)))
        with pytest.raises(gg.RowsError, match=r"DistributedDataParallel wrapper.*then wrap it"):
            gg.learn_rows(model, "0", rows=[1])
    finally:
        dist.destroy_process_group()


def test_a_weight_replaced_or_unfrozen_after_learn_rows_is_an_error_at_the_forward() -> None:
    model, batch, _ = llama()
    handle = gg.learn_rows(model, "model.embed_tokens", rows=[1])
    gg.unfreeze(model, "model.embed_tokens")
    with pytest.raises(gg.RowsError, match=r"learns as a whole again \(requires_grad=True"):
        model(**batch)
    handle.remove()
    handle = gg.learn_rows(model, "model.embed_tokens", rows=[1])
    state = {"weight": torch.zeros(97, 32)}
    model.model.embed_tokens.load_state_dict(state, strict=False, assign=True)
    with pytest.raises(gg.RowsError, match=r"was replaced after gg.learn_rows"):
        model(**batch)


def test_resizing_the_embedding_after_learn_rows_is_an_error_at_the_forward() -> None:
    """HF resizes in place (the same module and weight object, new data) and sets the module's
    parameters' requires_grad from the weight's: the rows would silently stop learning."""
    model, batch, _ = llama()
    gg.learn_rows(model, "model.embed_tokens", rows=[5])
    model.resize_token_embeddings(120, mean_resizing=False)
    with pytest.raises(gg.RowsError, match=r"was resized after gg.learn_rows, from \(97, 32\) to"):
        model(**batch)
