"""``plan.fits(budget)``: the largest depth that fits among all depths, not only among the rows
planned so far. The depths the answer depends on are planned when ``fits`` is asked (on the
copy of the model ``gg.estimate`` took), and join ``plan.rows``."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
from torch import nn

import gradgate as gg
from gradgate._demo._answers import _DEPTH_FITS, _depth_fits_sentence


def meta_llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(config).train()


def test_an_even_depth_sweep_answers_the_odd_depth_that_fits() -> None:
    """A Llama-shaped model planned at even depths only: every budget gets the answer of a plan
    of every depth, and the rows that prove it are in the plan afterwards."""
    model, ids = meta_llama(4), torch.zeros(2, 32, dtype=torch.long, device="meta")
    every = gg.estimate(model, input_ids=ids, labels=ids, dtype="bf16", depths=range(5))
    even = gg.estimate(model, input_ids=ids, labels=ids, dtype="bf16", depths=[0, 2, 4])
    needs = [row.peak_bytes + every.headroom_for(row) for row in every.rows]
    assert needs == sorted(needs) and len(set(needs)) == 5
    between = (needs[1] + needs[2]) // 2  # depth 1 fits, depth 2 does not
    assert every.fits(between) == 1
    assert [row.depth for row in even.rows] == [0, 2, 4]
    assert even.fits(between) == 1  # it answered 0, among the even rows
    assert [row.depth for row in even.rows] == [0, 1, 2, 4]
    assert even[1] == every[1]
    for budget in [needs[0] - 1, *needs, *((a + b) // 2 for a, b in itertools.pairwise(needs))]:
        assert even.fits(budget) == every.fits(budget), budget
    assert [row.depth for row in even.rows] == list(range(5))


def test_no_row_is_planned_when_the_planned_rows_decide() -> None:
    model, ids = meta_llama(4), torch.zeros(1, 32, dtype=torch.long, device="meta")
    plan = gg.estimate(model, input_ids=ids, labels=ids, depths=[0, 1, 2, 3, 4])
    rows = plan.rows
    assert plan.fits("1TiB") == 4 and plan.fits(1) is None
    assert plan.fits(plan[2].peak_bytes, headroom=0) == 2
    assert plan.rows is rows


def test_depths_are_planned_on_the_model_as_it_was_estimated() -> None:
    """The model changed after gg.estimate (frozen, in eval mode): the rows fits() adds are
    those of the model as planned, equal to a fresh plan of it."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                          for _ in range(8)])  # fmt: skip
    x = torch.randn(32, 64)
    every = gg.estimate(net, x, depths=range(9))
    plan = gg.estimate(net, x, depths=[0, 8])
    net.requires_grad_(False).eval()
    assert plan.fits(every[5].peak_bytes, headroom=0) == 5
    for depth in (4, 5, 6):
        assert plan[depth] == every[depth]


def test_learning_sets_answer_among_the_sets_planned() -> None:
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    plan = gg.estimate(net, torch.randn(2, 16), learn=[{3}, {1, 3}], optimizer="sgd")
    assert plan.fits("1GiB") == frozenset({1, 3})
    assert len(plan.rows) == 2


@pytest.mark.slow  # 5 s: the demo's own 24-layer model
def test_the_demo_sentence_names_the_largest_depth_that_fits() -> None:
    """The demo's 24-layer model in 16 GiB: depth 4 was the largest of 0, 1, 2, 4, 8, ... that
    fits, but depth 5 fits too (14.25 GiB + 1.21 GiB of headroom) and depth 6 does not."""
    ns: dict[str, object] = {}
    exec(_DEPTH_FITS, ns)  # the demo's own code
    plan = ns["plan"]
    assert isinstance(plan, gg.MemoryPlan)
    assert ns["depth"] == 5
    budget = 16 * 2**30
    assert plan[5].peak_bytes + plan.headroom_for(plan[5]) <= budget
    assert plan[6].peak_bytes + plan.headroom_for(plan[6]) > budget
    assert "the largest depth that fits in 16 GiB is 5 (14.3 GiB)" in _depth_fits_sentence(ns)


@pytest.mark.parametrize(
    ("headroom", "shown"), [("10%", "'10%'"), (-1, "-1"), ("1 gig", "'1 gig'")]
)
def test_a_bad_headroom_is_named_as_the_headroom(headroom: object, shown: str) -> None:
    plan = gg.estimate(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), torch.randn(1, 2))
    with pytest.raises(gg.InvalidOptionError, match=r"^headroom ") as error:
        plan.fits("24GiB", headroom=headroom)  # type: ignore[arg-type]
    assert shown in str(error.value) and "budget" not in str(error.value)
    with pytest.raises(gg.InvalidOptionError, match=r"^memory budget '24 gigs' is not a size"):
        plan.fits("24 gigs")


def test_a_pickled_plan_still_plans_more_depths() -> None:
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    x = torch.randn(4, 32)
    every = gg.estimate(net, x, depths=range(7))
    plan = pickle.loads(pickle.dumps(gg.estimate(net, x, depths=[0, 6])))
    assert plan.fits(every[3].peak_bytes, headroom=0) == 3
    assert plan[3] == every[3]


def test_a_plan_that_cannot_plan_more_says_its_answer_is_among_its_rows() -> None:
    plan = gg.estimate(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), torch.randn(2, 8))
    hand_made = gg.MemoryPlan("Net", [plan[0], plan[4]], optimizer="adamw", dtype="float32",
                              blocks=4)  # fmt: skip
    with pytest.warns(gg.GradgateWarning, match=r"among the planned depths \[0, 4\] only.*"
                      r"one of depths 1\.\.3, which were not planned"):  # fmt: skip
        assert hand_made.fits(plan[4].peak_bytes - 1, headroom=0) == 0
    assert hand_made.fits(plan[4].peak_bytes, headroom=0) == 4  # settled: no warning
