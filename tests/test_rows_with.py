"""``gg.learn_rows`` with the rest of gradgate: a gate's plan, ``LearnerMasters``, the audit and
the memory planner."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from models import gpt2, llama
from test_memory_peak import lm_batch, real_peak
from torch import nn

import gradgate as gg
from gradgate._memory.estimate import StepPlanner

ROWS = [57, 96, 5, 7, 22]
EMBEDDING = "model.embed_tokens"


def test_under_a_depth_the_embedding_rows_never_learn_and_a_warning_says_so() -> None:
    model, batch, loss_fn = llama()
    handle = gg.learn_rows(model, EMBEDDING, rows=ROWS)
    gate = gg.BackpropGate(model, depth=2)
    message = r"used by 'model.embed_tokens' before a gate's cut set by a depth.*never learn"
    with pytest.warns(gg.PlanNotAppliedWarning, match=message):
        loss_fn(model, batch).backward()
    assert handle.parameter.grad is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per handle
        gate.depth = 3
        loss_fn(model, batch).backward()
    assert handle.parameter.grad is None
    gate.remove()


def test_tied_rows_under_a_depth_learn_through_the_head_alone() -> None:
    model, batch, loss_fn = gpt2(tied=True)
    twin = copy.deepcopy(model)
    with pytest.warns(gg.SharedParameterWarning), gg.backprop_depth(twin, 1):
        loss = loss_fn(twin, batch)
    loss.backward()
    expected = twin.transformer.wte.weight.grad[ROWS]  # the head's use: after the cut
    handle = gg.learn_rows(model, "transformer.wte", rows=ROWS)
    message = r"used by 'transformer.wte' before.*they learn only through 'lm_head'"
    with warnings.catch_warnings(record=True) as seen, gg.backprop_depth(model, 1):
        warnings.simplefilter("always")
        loss = loss_fn(model, batch)
    assert {type(w.message) for w in seen} == {gg.PlanNotAppliedWarning, gg.SharedParameterWarning}
    assert any(re.search(message, str(w.message)) for w in seen)
    loss.backward()
    torch.testing.assert_close(handle.parameter.grad, expected, rtol=1e-5, atol=1e-7)


def test_a_learning_set_naming_the_embedding_learns_its_rows_exactly() -> None:
    model, batch, loss_fn = llama()
    twin = copy.deepcopy(model)
    with gg.BackpropGate(twin) as reference:
        reference.learn = {2, EMBEDDING}
        loss_fn(twin, batch).backward()
    expected = twin.model.embed_tokens.weight.grad[ROWS]
    handle = gg.learn_rows(model, EMBEDDING, rows=ROWS)
    with gg.BackpropGate(model) as gate:
        gate.learn = {2, EMBEDDING}
        loss_fn(model, batch).backward()
        assert torch.equal(handle.parameter.grad, expected)
        for name, param in model.named_parameters():
            if name.startswith("model.layers.0.") or name.startswith("model.layers.1."):
                assert param.grad is None, name
        handle.parameter.grad = None
        gate.learn = {2}  # the embedding runs before the first learner: no graph, no warning
        loss_fn(model, batch).backward()
        assert handle.parameter.grad is None


def test_head_rows_learn_at_every_depth() -> None:
    model, batch, loss_fn = llama()
    expected = []
    for depth in (0, 2):
        twin = copy.deepcopy(model)
        with gg.backprop_depth(twin, depth):
            loss = loss_fn(twin, batch)
        loss.backward()
        expected.append(twin.lm_head.weight.grad[ROWS])
    handle = gg.learn_rows(model, "lm_head", rows=ROWS)
    for depth, grad in zip((0, 2), expected, strict=True):
        with gg.backprop_depth(model, depth):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.testing.assert_close(handle.parameter.grad, grad, rtol=1e-5, atol=1e-7)
        handle.parameter.grad = None


def test_learner_masters_hold_masters_and_state_for_the_rows_only() -> None:
    model, batch, loss_fn = llama()
    model = model.to(torch.bfloat16)
    gg.freeze(model, "**")
    handle = gg.learn_rows(model, EMBEDDING, rows=ROWS)
    start = model.model.embed_tokens.weight.detach().clone()
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), lr=1e-2)
    for _ in range(2):
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    rows = len(ROWS) * 32
    assert list(opt.state) == [handle.parameter]
    assert opt.state[handle.parameter]["master"].shape == (len(ROWS), 32)
    assert opt.master_bytes() == 3 * 4 * rows + 4  # master, exp_avg, exp_avg_sq; the step
    weight = model.model.embed_tokens.weight
    others = [i for i in range(97) if i not in ROWS]
    assert torch.equal(weight[others], start[others])
    assert torch.equal(weight[ROWS], handle.parameter.detach())
    assert not torch.equal(weight[ROWS], start[ROWS])


def test_the_audit_shows_the_embeddings_wgrad_rows_sized() -> None:
    model, batch, loss_fn = llama()
    with gg.audit(model) as full:
        loss_fn(model, batch).backward()
    model.zero_grad(set_to_none=True)
    handle = gg.learn_rows(model, EMBEDDING, rows=ROWS)
    with gg.audit(model) as rows:
        loss_fn(model, batch).backward()
    assert full.module(EMBEDDING).wgrad_bytes == 97 * 32 * 4
    assert rows.module(EMBEDDING).wgrad_bytes == len(ROWS) * 32 * 4
    assert (rows.module(EMBEDDING).wgrad, rows.module(EMBEDDING).dgrad) == (1, 0)
    assert rows.module("lm_head").wgrad_bytes == 97 * 32 * 4
    assert rows.wasted == []
    handle.remove()


def test_the_audit_of_head_rows() -> None:
    model, batch, loss_fn = llama()
    with gg.learn_rows(model, "lm_head", rows=ROWS), gg.audit(model) as report:
        loss_fn(model, batch).backward()
    head = report.module("lm_head")
    assert head.wgrad_bytes == len(ROWS) * 32 * 4
    assert head.wgrad == 1


def big_vocab_llama() -> tuple[nn.Module, dict]:
    model, _, _ = llama(layers=2)
    model.resize_token_embeddings(2048)
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids}


@pytest.mark.parametrize("frozen", [True, False])
def test_the_planner_plans_rows_sized_grads_and_state_to_the_real_peak(frozen: bool) -> None:
    model, batch = big_vocab_llama()
    with StepPlanner(model, (), lm_batch(batch)) as planner:
        plain = planner.row(None)
    if frozen:
        gg.freeze(model, "**")
    rows = list(range(2048 - 64, 2048))
    gg.learn_rows(model, EMBEDDING, rows=rows)
    with StepPlanner(model, (), lm_batch(batch)) as planner:
        row = planner.row(None)
    embedding, learned = 2048 * 32 * 4, 64 * 32 * 4
    assert row.param_bytes == plain.param_bytes + learned  # the rows parameter
    if frozen:
        assert (row.grad_bytes, row.optimizer_bytes) == (learned, 2 * learned + 4)
    else:
        assert row.grad_bytes == plain.grad_bytes - embedding + learned
        assert row.optimizer_bytes == plain.optimizer_bytes - 2 * (embedding - learned)
    assert (row.peak_bytes, row.peak_phase) == real_peak(model, kwargs=lm_batch(batch))


def test_estimate_plans_a_learning_set_with_the_rows() -> None:
    model, batch = big_vocab_llama()
    gg.freeze(model, "**")
    handle = gg.learn_rows(model, EMBEDDING, rows=[5, 6])
    plan = gg.estimate(model, **lm_batch(batch), depths=[1], learn=[{0, 1, EMBEDDING}])
    assert plan[1].grad_bytes == 0  # a depth never reaches the embedding
    learning = plan.rows[1]
    assert learning.grad_bytes == handle.parameter.nbytes
    assert learning.optimizer_bytes == 2 * handle.parameter.nbytes + 4


def test_a_meta_model_is_planned_with_its_rows() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    gg.freeze(model, "**")
    handle = gg.learn_rows(model, EMBEDDING, rows=list(range(31936, 32000)))
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    plan = gg.estimate(model, input_ids=ids, labels=ids, learn=[{0, 1, EMBEDDING}])
    row = plan.rows[0]
    assert handle.parameter.is_meta
    assert row.grad_bytes == 64 * 64 * 4
    assert row.optimizer_bytes == 2 * 64 * 64 * 4 + 4  # exp_avg, exp_avg_sq, the step


@pytest.mark.slow
def test_the_benchmark_runs_and_its_memory_figures_hold(tmp_path) -> None:
    import json

    from gradgate._bench.sections import rows

    out = tmp_path / "rows.json"
    assert rows.main(["--quick", "--rounds", "1", "--micro", "2", "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    figures = result["figures"]
    size = result["size"]
    state = 2 * 4 * size["vocab"] * size["hidden"]
    assert [figures[m]["others_moved"] for m in rows.METHODS] == [True, True, False]
    assert (
        figures["gradient mask"]["optimizer_bytes"] == figures["full embedding"]["optimizer_bytes"]
    )
    assert figures["learn_rows"]["optimizer_bytes"] == 2 * 4 * size["rows"] * size["hidden"] + 4
    assert figures["learn_rows"]["bytes_below_full"] >= state  # accumulation: the gradient too
