"""The comparison of learner choices (gradgate._bench.sections.learners): its task and its
budgets."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")
from gradgate._bench.sections import learners


def test_the_finetuning_entropy_is_the_loss_of_the_true_next_token_distribution() -> None:
    tokens, entropy = learners.finetuning_text(200, 9, seed=3)
    table = torch.from_numpy(learners.bigram_table(7))
    losses = []
    for row in tokens:
        for t in range(1, len(row)):
            p = table[row[t - 1]].clone()
            if t >= 2:
                p = (1 - learners.COPY) * p
                p[row[t - 2]] += learners.COPY
            assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-9)
            losses.append(-math.log(float(p[row[t]])))
    assert entropy == pytest.approx(sum(losses) / len(losses), rel=1e-9)
    copies = (tokens[:, 2:] == tokens[:, :-2]).float().mean().item()
    assert 0.65 < copies < 0.8  # 0.7 copied, plus bigram draws that happen to repeat


def test_every_partial_method_learns_at_most_a_quarter_of_the_blocks() -> None:
    result = learners.compare("tiny", methods=("head", "lisa", "snr", "importance", "uniform"))
    shares = {method: result.share(method) for method in result.methods()}
    assert shares["head"] == 0.0 and shares["lisa"] == 0.25
    assert all(0.2 < shares[m] <= 0.25 for m in ("snr", "importance", "uniform"))
    again = learners.Comparison.from_json(result.to_json())
    assert again.table() == result.table() and "| head only" in again.table()
    assert all(run.excess[-1] < run.excess[0] for run in result.runs if run.method != "head")
