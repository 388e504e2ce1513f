"""LearnerMasters' state_dict in one process: each group counts its parameters that have state,
so that a load which lost the masters and moments (torch.distributed.checkpoint's sharded load
reads into a fresh optimizer's empty state) raises instead of training on without them. The
sharded and full state dicts across ranks are tested in tests/test_masters_fsdp.py."""

from __future__ import annotations

import copy

import pytest
import torch
from test_masters import OPTS, batches, loss_of, make

import gradgate as gg


def stepped() -> tuple[torch.nn.Module, gg.optim.LearnerMasters]:
    model = make()
    model.blocks[0].requires_grad_(False)
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_each_saved_group_counts_its_parameters_with_state() -> None:
    model, opt = stepped()
    saved = opt.state_dict()
    learning = sum(p.requires_grad for p in model.parameters())
    assert [g["learner_masters_held"] for g in saved["param_groups"]] == [learning]
    assert len(saved["state"]) == learning
    fresh = gg.optim.LearnerMasters(torch.optim.AdamW, make().parameters(), **OPTS)
    fresh.load_state_dict(copy.deepcopy(saved))
    assert "learner_masters_held" not in fresh.param_groups[0]  # not a live option
    assert len(fresh.state) == learning


def test_a_load_that_lost_the_state_raises() -> None:
    _, opt = stepped()
    lost = {**opt.state_dict(), "state": {}}  # what a sharded DCP load into a fresh one reads
    fresh = gg.optim.LearnerMasters(torch.optim.AdamW, make().parameters(), **OPTS)
    with pytest.raises(gg.GradgateError, match=r"moments for 16 parameters, and 0 arrived"):
        fresh.load_state_dict(lost)
    assert not fresh.state and "learner_masters_held" not in fresh.param_groups[0]


def test_a_state_dict_without_counts_loads_as_before() -> None:
    """One saved by an earlier release, or a plain optimizer's taken on purpose (its moments
    upcast to float32, as LearnerMasters' message for a plain one says)."""
    _, opt = stepped()
    old = copy.deepcopy(opt.state_dict())
    for group in old["param_groups"]:
        del group["learner_masters_held"]
    fresh = gg.optim.LearnerMasters(torch.optim.AdamW, make().parameters(), **OPTS)
    fresh.load_state_dict(old)
    assert len(fresh.state) == len(old["state"]) == 16
    model = make()
    plain = torch.optim.AdamW(model.parameters(), **OPTS)
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    plain.step()
    moments = plain.state_dict()
    for entry in moments["state"].values():
        entry.update({k: v.float() for k, v in entry.items() if k != "step"})
    fresh = gg.optim.LearnerMasters(torch.optim.AdamW, make().parameters(), **OPTS)
    fresh.load_state_dict(moments)
    assert len(fresh.state) == len(list(model.parameters()))


def test_the_checkpoint_probe_makes_no_masters() -> None:
    """torch.distributed.checkpoint's get_optimizer_state_dict steps an optimizer without state
    once (lr 0, a zero .grad on every parameter that requires grad): LearnerMasters makes no
    master, also with a frozen head (which the probe leaves without a .grad), and moves nothing."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = make()
    model.head.requires_grad_(False)
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    before = copy.deepcopy(model.state_dict())
    assert get_optimizer_state_dict(model, opt)["state"] == {}
    assert not opt.state and opt.master_bytes() == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert opt.param_groups[0]["lr"] == OPTS["lr"]
