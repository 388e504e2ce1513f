"""gg.choose: Spectrum's SNR scan (against the published formula), top per type, JSON."""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from models import llama
from torch import nn

import gradgate as gg


def spectrum_reference(weight: torch.Tensor) -> float:
    """Spectrum's published computation, written out in float64 numpy (an independent path)."""
    matrix = weight.detach().double().numpy()
    values = np.linalg.svd(matrix, compute_uv=False)  # descending
    sigma = (np.quantile(values, 0.75) - np.quantile(values, 0.25)) / 1.349
    rows, cols = matrix.shape
    beta = min(rows, cols) / max(rows, cols)
    threshold = sigma * np.sqrt((1 + np.sqrt(beta)) ** 2)
    signal = values[values > threshold].sum()
    noise = values[values <= threshold].sum()
    return float("inf") if noise == 0 else float(signal / noise / values[0])


def low_rank_plus_noise(rows: int, cols: int, rank: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    signal = torch.randn(rows, rank, generator=generator) @ torch.randn(
        rank, cols, generator=generator
    )
    return signal + 0.5 * torch.randn(rows, cols, generator=generator)


def net_of(*weights: torch.Tensor) -> nn.Module:
    layers = []
    for weight in weights:
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            layer.weight.copy_(weight)
        layers.append(layer)
    return nn.Sequential(*layers)


# -- the score -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(64, 64), (48, 96), (96, 40)])
def test_snr_is_spectrums_formula(shape: tuple[int, int]) -> None:
    weight = low_rank_plus_noise(*shape, rank=6, seed=sum(shape))
    scores = gg.choose.snr(net_of(weight), progress=False)
    expected = spectrum_reference(weight)
    assert math.isfinite(expected) and expected > 0
    assert scores["0"] == pytest.approx(expected, rel=1e-4)


def test_snr_counts_signal_and_noise_by_hand_on_known_singular_values() -> None:
    # W = U diag(s) V^T with chosen singular values: 4 equal ones (IQR 0 -> threshold 0) ...
    u, _ = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))
    v, _ = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(2)))
    s = torch.tensor([10.0, 5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5])
    scores = gg.choose.snr(net_of(u @ torch.diag(s) @ v.T), progress=False)
    # quantiles of the 8 values: q25 = 1.0, q75 = 1.0 + 0.25 * (5 - 1) ... linear interpolation
    q75, q25 = float(torch.quantile(s, 0.75)), float(torch.quantile(s, 0.25))
    threshold = (q75 - q25) / 1.349 * 2  # beta = 1
    signal = float(s[s > threshold].sum())
    noise = float(s[s <= threshold].sum())
    assert (q25, q75, round(threshold, 4)) == (1.0, 2.0, 1.4826)
    assert (signal, noise) == (15.0, 5.5)
    assert scores["0"] == pytest.approx(15.0 / 5.5 / 10.0, rel=1e-5)


def test_snr_is_inf_when_nothing_is_noise_and_zero_for_a_zero_matrix() -> None:
    torch.manual_seed(0)
    elongated = torch.randn(1024, 256)  # pure noise, but beta = 0.25: every value is "signal"
    scores = gg.choose.snr(net_of(elongated, torch.zeros(16, 16)), progress=False)
    assert scores == {"0": math.inf, "1": 0.0}


def test_snr_of_bf16_weights_equals_their_float32_copy_and_transposing_changes_nothing() -> None:
    weight = low_rank_plus_noise(40, 80, rank=4, seed=3).bfloat16()
    low = net_of(weight.float()).to(torch.bfloat16)
    assert low[0].weight.dtype == torch.bfloat16
    got = gg.choose.snr(low, progress=False)["0"]
    assert got == gg.choose.snr(net_of(weight.float()), progress=False)["0"]
    transposed = gg.choose.snr(net_of(weight.float().T), progress=False)["0"]
    assert transposed == pytest.approx(got, rel=1e-5)
    assert low[0].weight.dtype == torch.bfloat16  # the model is left as it was


def test_snr_scans_every_2d_weight_in_model_order_and_tied_weights_once() -> None:
    model, _, _ = llama(layers=2)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them
    calls = []
    original = gg.choose.spectrum_score

    def counting(weight: torch.Tensor) -> float:
        calls.append(weight)
        return original(weight)

    gg.choose.spectrum_score = counting
    try:
        scores = gg.choose.snr(model, progress=False)
    finally:
        gg.choose.spectrum_score = original
    matrices = [n for n, m in model.named_modules() if getattr(m, "weight", None) is not None
                and m.weight.dim() == 2]  # fmt: skip
    assert list(scores) == matrices
    assert len(matrices) == 2 * 7 + 2 and len(calls) == len(matrices) - 1
    assert scores["lm_head"] == scores["model.embed_tokens"]
    assert scores.complete and scores.model == "LlamaForCausalLM"
    assert scores.shapes["model.layers.0.mlp.down_proj"] == (32, 64)
    assert scores.types["model.layers.1.self_attn.q_proj"] == "self_attn.q_proj"


def test_snr_of_named_modules_expands_blocks_and_shows_progress(capsys) -> None:
    model, _, _ = llama(layers=2)
    scores = gg.choose.snr(model, ["model.layers.1", "lm_head"])
    assert list(scores) == [
        *(f"model.layers.1.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj",
                                           "self_attn.v_proj", "self_attn.o_proj")),
        *(f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
        "lm_head",
    ]  # fmt: skip
    assert not scores.complete
    assert "gg.choose.snr" in capsys.readouterr().err
    assert gg.choose.snr(model, "model.layers.0.mlp.*", progress=False).keys() == {
        f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")
    }


def test_snr_reads_gpt2_conv1d_weights_as_the_matrices_they_are() -> None:
    from models import gpt2

    model, _, _ = gpt2(layers=1)
    scores = gg.choose.snr(model, ["transformer.h.0.mlp.c_fc"], progress=False)
    weight = model.transformer.h[0].mlp.c_fc.weight  # stored (in, out)
    assert scores.shapes == {"transformer.h.0.mlp.c_fc": tuple(weight.shape)}
    assert scores["transformer.h.0.mlp.c_fc"] == pytest.approx(spectrum_reference(weight), rel=1e-4)


# -- module types and top ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("model.layers.3.self_attn.q_proj", "self_attn.q_proj"),
        ("encoder.layer.7.attention.self.query", "attention.self.query"),
        ("model.layers.3.mlp.experts.5.gate_proj", "mlp.experts.5.gate_proj"),
        ("lm_head", "lm_head"),
        ("model.embed_tokens", "model.embed_tokens"),
        ("features.4", "features.*"),
        ("3", "*"),
    ],
)
def test_module_type_is_the_name_after_the_layer_index(name: str, kind: str) -> None:
    assert gg.choose.Scores({name: 1.0}).types == {name: kind}


def _layers(n: int, kind: str = "q", scores: list[float] | None = None) -> dict[str, float]:
    scores = scores if scores is not None else [float(i) for i in range(n)]
    return {f"layers.{i}.{kind}": s for i, s in enumerate(scores)}


@pytest.mark.parametrize(
    ("n", "fraction", "count"),
    [(16, 0.25, 4), (100, 0.29, 29), (100, 0.57, 57), (4, 1, 4), (3, 0.5, 1)],
)
def test_top_keeps_the_floor_of_each_types_share(n: int, fraction: float, count: int) -> None:
    scores = _layers(n)
    picked = gg.choose.top(scores, fraction)
    assert picked == [f"layers.{i}.q" for i in range(n - count, n)]  # the best, in model order


def test_top_ranks_within_each_type_ties_in_order_and_nan_last() -> None:
    scores = {
        **_layers(4, "q", [1.0, math.inf, 3.0, math.inf]),
        **_layers(4, "v", [math.nan, 0.1, 0.2, 0.3]),
        "lm_head": 100.0,
    }
    assert gg.choose.top(scores, 0.5) == ["layers.1.q", "layers.3.q", "layers.2.v", "layers.3.v"]
    assert gg.choose.top(scores, 0.25) == ["layers.1.q", "layers.3.v"]
    assert gg.choose.top(scores, 1.0)[-1] == "lm_head"
    assert gg.choose.top(scores, 0.25, per=None) == ["layers.1.q", "layers.3.q"]  # floor(2.25)
    assert gg.choose.top(scores, 0.5, "type") == gg.choose.top(scores, 0.5)


def test_top_of_a_tiny_llama_picks_a_quarter_of_each_projection() -> None:
    model, _, _ = llama(layers=4)
    scores = gg.choose.snr(model, progress=False)
    picked = gg.choose.top(scores, 0.25)
    kinds = sorted(gg.choose.Scores(dict.fromkeys(picked, 0.0)).types.values())
    assert kinds == sorted(
        [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ]
    )
    assert all(n.startswith("model.layers.") for n in picked)


# -- what top's names feed -------------------------------------------------------------------
def _chosen_llama() -> tuple[nn.Module, dict, list[str]]:
    model, batch, _ = llama(layers=4)
    model.train()
    picked = gg.choose.top(gg.choose.snr(model, progress=False), 0.25)
    return model, batch, picked


def test_top_feeds_gate_learn_exactly() -> None:
    model, batch, picked = _chosen_llama()
    reference = {n: p for n, p in model.named_parameters()}
    loss = model(**batch).logits.float().pow(2).mean()
    expected = dict(
        zip(reference, torch.autograd.grad(loss, list(reference.values())), strict=True)
    )
    gate = gg.BackpropGate(model)
    gate.learn = picked
    model(**batch).logits.float().pow(2).mean().backward()
    learning = {f"{n}.weight" for n in picked} | {"model.norm.weight", "lm_head.weight"}
    for name, param in model.named_parameters():
        if name in learning:
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-7)
        else:
            assert param.grad is None, name
    gate.remove()


def test_top_feeds_freeze_and_estimate() -> None:
    model, batch, picked = _chosen_llama()
    others = [n for n in gg.choose.snr(model, progress=False) if n not in picked]
    with gg.freeze(model, *others):
        learning = {n for n, p in model.named_parameters() if p.requires_grad}
    matrices = {f"{n}.weight" for n in picked}
    assert matrices <= learning and not ({f"{n}.weight" for n in others} & learning)
    plan = gg.estimate(model, **batch, learn=picked, optimizer="sgd")
    (row,) = plan.rows
    head = {"model.norm", "lm_head"}
    expected = sum(model.get_submodule(n).weight.numel() for n in [*picked, *head])
    assert row.grad_bytes == 4 * expected


# -- JSON -------------------------------------------------------------------------------------
def test_scores_round_trip_through_json_and_files(tmp_path) -> None:
    model, _, _ = llama(layers=2)
    scores = gg.choose.snr(model, progress=False)
    scores["model.layers.0.mlp.up_proj"] = math.inf
    text = scores.to_json()
    document = json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert document["schema"] == "gradgate.snr/1" and document["model"] == "LlamaForCausalLM"
    assert document["modules"]["model.layers.0.mlp.up_proj"]["score"] == "inf"
    back = gg.choose.Scores.from_json(text, model=model)
    assert back == scores and list(back) == list(scores)
    assert back.shapes == scores.shapes and back.complete
    path = gg.choose.save(scores, tmp_path / "snr.json")
    assert gg.choose.load(path, model=model) == scores
    assert gg.choose.Scores.load(scores.save(tmp_path / "again.json")) == scores


def test_scores_read_spectrums_own_files() -> None:
    text = '{"model.layers.0.mlp.up_proj": {"snr": 1.5, "type": "mlp.up_proj"}, ' \
           '"lm_head": {"snr": Infinity, "type": "lm_head"}}'  # fmt: skip
    assert gg.choose.Scores.from_json(text) == {
        "model.layers.0.mlp.up_proj": 1.5,
        "lm_head": math.inf,
    }


def test_scores_for_another_model_are_refused() -> None:
    small, _, _ = llama(layers=2)
    big, _, _ = llama(layers=3)
    text = gg.choose.snr(small, progress=False).to_json()
    with pytest.raises(
        gg.GradgateError,
        match=r"for another model: LlamaForCausalLM has 7 2-D "
        r"weights they lack \('model.layers.2.self_attn.q_proj'",
    ):
        gg.choose.Scores.from_json(text, model=big)
    partial = gg.choose.snr(big, "model.layers.2.*_attn.q_proj", progress=False).to_json()
    with pytest.raises(
        gg.GradgateError,
        match=r"'model.layers.2.self_attn.q_proj' \(recorded "
        r"shape \(32, 32\)\) has no such module in LlamaForCausalLM; expected",
    ):
        gg.choose.Scores.from_json(partial, model=small)
    wide = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    narrow = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))
    with pytest.raises(
        gg.GradgateError,
        match=r"'0' \(recorded shape \(6, 4\)\) has shape "
        r"\(5, 4\) in Sequential.*re-run gg.choose.snr\(model\)",
    ):
        gg.choose.Scores.from_json(gg.choose.snr(wide, progress=False).to_json(), model=narrow)


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fraction", "message"),
    [
        (0, r"fraction=0 is out of range; expected a number in \(0, 1\], the share of each type"),
        (1.5, r"fraction=1.5 is out of range; expected a number in \(0, 1\]"),
        (-0.25, r"fraction=-0.25 is out of range"),
        (math.nan, r"fraction=nan; expected a number in \(0, 1\]"),
        (True, r"fraction=True; expected a number in \(0, 1\]"),
        ("0.5", r"fraction='0.5'; expected a number in \(0, 1\], .* e.g. 0.25"),
    ],
)
def test_top_refuses_a_fraction_outside_0_1(fraction: object, message: str) -> None:
    with pytest.raises(gg.InvalidOptionError, match=message):
        gg.choose.top(_layers(4), fraction)  # type: ignore[arg-type]


def test_top_refuses_empty_or_malformed_scores_a_bad_per_and_an_empty_pick() -> None:
    with pytest.raises(gg.InvalidOptionError, match=r"scores=\{\} is empty; expected the scores"):
        gg.choose.top({})
    with pytest.raises(gg.InvalidOptionError, match=r"scores\['a'\] = 'x'; expected module names"):
        gg.choose.top({"a": "x"})  # type: ignore[dict-item]
    with pytest.raises(gg.InvalidOptionError, match=r"scores=\[1\] \(list\); expected a mapping"):
        gg.choose.top([1])  # type: ignore[arg-type]
    with pytest.raises(
        gg.InvalidOptionError,
        match=r"per='layer' is not allowed; expected one "
        r"of 'type', None",
    ):
        gg.choose.top(_layers(4), per="layer")  # type: ignore[arg-type]
    with pytest.raises(
        gg.InvalidOptionError,
        match=r"top\(fraction=0.2\) picks no module: each "
        r"type has at most 4 member\(s\).*at least 0.25, or per=None",
    ):
        gg.choose.top(_layers(4), 0.2)


def test_snr_refuses_modules_without_2d_weights_empty_lists_and_unscannable_weights() -> None:
    net = nn.Sequential(OrderedDict(norm=nn.LayerNorm(4), act=nn.ReLU(), fc=nn.Linear(4, 4)))
    with pytest.raises(
        gg.InvalidOptionError,
        match=r"the module 'norm' \(LayerNorm\) has a 1-D "
        r"weight of shape \(4,\) and no 2-D weight inside it; expected modules",
    ):
        gg.choose.snr(net, ["fc", "norm"], progress=False)
    with pytest.raises(gg.InvalidOptionError, match=r"'act' \(ReLU\) has no weight and no 2-D"):
        gg.choose.snr(net, "act", progress=False)
    with pytest.raises(
        gg.InvalidOptionError, match=r"modules=\[\] is empty; expected module names"
    ):
        gg.choose.snr(net, [], progress=False)
    with pytest.raises(gg.UnknownModuleError, match=r"'fd' matches no module.*Did you mean 'fc'"):
        gg.choose.snr(net, ["fd"], progress=False)
    with pytest.raises(gg.InvalidOptionError, match=r"Sequential has no module with a 2-D weight"):
        gg.choose.snr(nn.Sequential(nn.LayerNorm(3)), progress=False)
    with pytest.raises(gg.InvalidOptionError, match=r"progress='yes'; expected True or False"):
        gg.choose.snr(net, progress="yes")  # type: ignore[arg-type]
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(gg.InvalidOptionError, match=r"'0' is on the meta device.*load them first"):
        gg.choose.snr(meta, progress=False)
    quantised = nn.Sequential(nn.Linear(4, 4))
    quantised[0].weight = nn.Parameter(torch.ones(4, 4, dtype=torch.int8), requires_grad=False)
    with pytest.raises(
        gg.InvalidOptionError,
        match=r"dtype torch.int8 \(quantised\?\).*scan the "
        r"unquantised model",
    ):
        gg.choose.snr(quantised, progress=False)


def test_scores_json_that_is_not_a_score_file_is_refused() -> None:
    with pytest.raises(gg.InvalidOptionError, match=r"the text is not JSON"):
        gg.choose.Scores.from_json("{")
    with pytest.raises(
        gg.InvalidOptionError,
        match=r"is not a score file; expected what "
        r"Scores.to_json\(\) wrote",
    ):
        gg.choose.Scores.from_json('{"a": 1}')
    with pytest.raises(gg.InvalidOptionError, match=r"the score of 'a' is 'high'; expected a num"):
        gg.choose.Scores.from_json('{"a": {"snr": "high"}}')
