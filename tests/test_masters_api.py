"""LearnerMasters as a torch optimizer: LR schedulers, errors, copies, fake tensors."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from test_masters import OPTS, assert_same_params, batches, loss_of, make, same
from torch import nn

import gradgate as gg
from gradgate.optim import LearnerMasters


def adamw(params, **opts) -> LearnerMasters:
    return LearnerMasters(torch.optim.AdamW, params, **{**OPTS, **opts})


# -- LR schedulers ---------------------------------------------------------------------------
def test_one_cycle_lr_cycles_lr_and_betas_as_on_the_reference() -> None:
    model = make()
    masters = [p.detach().float().clone() for p in model.parameters()]
    plain = torch.optim.AdamW(masters, **OPTS)
    opt = adamw(model.parameters())
    schedulers = [
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=6, cycle_momentum=True)
        for o in (opt, plain)
    ]
    for x, y in batches(6):
        loss_of(model, x, y).backward()
        for p, m in zip(model.parameters(), masters, strict=True):
            m.grad = p.grad.float()
        opt.step()
        plain.step()
        opt.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
        for p, m in zip(model.parameters(), masters, strict=True):
            assert same(p, m.to(torch.bfloat16))
        assert schedulers[0].get_last_lr() == schedulers[1].get_last_lr()
        assert opt.param_groups[0]["betas"] == plain.param_groups[0]["betas"]


def test_groups_carry_the_inner_options_and_their_own() -> None:
    model = make()
    opt = LearnerMasters(
        torch.optim.AdamW,
        [{"params": model.head.parameters(), "lr": 0.5}, {"params": model.embed.parameters()}],
        lr=0.1,
        betas=(0.8, 0.9),
    )
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1]
    assert opt.param_groups[1]["betas"] == (0.8, 0.9) and opt.defaults["eps"] == 1e-8
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    head_before = model.head.weight.detach().float().clone()
    opt.step()
    # one Adam step moves each element by about lr
    moved = (opt.state[model.head.weight]["master"] - head_before).abs().max().item()
    assert 0.3 < moved < 0.6
    assert gg.optim.add_missing(opt, model) == [n for n, _ in model.named_parameters()][2:-2]


def test_named_parameters_keep_their_names() -> None:
    model = make()
    opt = adamw(model.named_parameters())
    assert opt.param_groups[0]["param_names"][0] == "embed.weight"
    loss_of(model, *batches(1)[0]).backward()
    opt.step()
    assert set(opt.state_dict()["param_groups"][0]["param_names"]) >= {"head.bias"}


# -- copies -----------------------------------------------------------------------------------
def test_deepcopy_and_pickle_keep_working_optimizers() -> None:
    model = make()
    opt = adamw(model.parameters(), offload="cpu")
    loss_of(model, *batches(1)[0]).backward()
    opt.step()
    opt.zero_grad()
    twin_model, twin_opt = copy.deepcopy((model, opt))
    loaded_model, loaded_opt = pickle.loads(pickle.dumps((model, opt)))
    x, y = batches(2)[1]
    for m, o in ((model, opt), (twin_model, twin_opt), (loaded_model, loaded_opt)):
        loss_of(m, x, y).backward()
        o.step()
    assert_same_params(model, twin_model)
    assert_same_params(model, loaded_model)
    assert "offload='cpu'" in repr(twin_opt).splitlines()[0]


def test_repr_names_the_inner_optimizer() -> None:
    text = repr(adamw(make().parameters()))
    assert text.startswith("LearnerMasters(AdamW) (\nParameter Group 0\n")
    assert "    lr: 0.01" in text


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build, message",
    [
        (lambda p: LearnerMasters(torch.optim.AdamW, p, offload="gpu"), r"offload='gpu' is not"),
        (
            lambda p: LearnerMasters(torch.optim.AdamW(p), p),
            r"optimizer_class=a AdamW instance; expected a torch.optim.Optimizer class",
        ),
        (lambda p: LearnerMasters("AdamW", p), r"optimizer_class='AdamW'; expected"),
        (lambda p: LearnerMasters(torch.optim.LBFGS, p), r"LBFGS: it needs a closure"),
        (lambda p: LearnerMasters(torch.optim.SparseAdam, p), r"SparseAdam: it needs sparse"),
        (
            lambda p: LearnerMasters(torch.optim.Adagrad, p),
            r"Adagrad makes its state for every parameter when it is built",
        ),
        (lambda p: LearnerMasters(LearnerMasters, p), r"optimizer_class=LearnerMasters"),
        (lambda p: LearnerMasters(torch.optim.AdamW, p, lr=-1.0), r"AdamW refused the options"),
        (lambda p: LearnerMasters(torch.optim.AdamW, p, momentum=0.9), r"refused .*momentum"),
        (lambda p: LearnerMasters(torch.optim.AdamW, []), r"params is empty"),
        (lambda p: LearnerMasters(torch.optim.AdamW, p[0]), r"params=Parameter; expected an"),
        (
            lambda p: LearnerMasters(torch.optim.AdamW, [torch.zeros(2, dtype=torch.int8)]),
            r"parameter of dtype torch.int8; expected bfloat16 or float16",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(build, message) -> None:
    params = list(make().parameters())
    with pytest.raises(gg.InvalidOptionError, match=message):
        build(params)


def test_a_group_of_the_wrong_dtype_is_refused_whole() -> None:
    opt = adamw(make().parameters())
    with pytest.raises(gg.InvalidOptionError, match=r"dtype torch.int64"):
        opt.add_param_group({"params": [torch.zeros(3), torch.zeros(3, dtype=torch.long)]})
    assert len(opt.param_groups) == 1


def test_groups_replaced_behind_its_back_are_refused_at_step() -> None:
    """What deepspeed.initialize(optimizer=LearnerMasters(...)) would do: ZeRO writes its flat
    fp32 partitions into the groups."""
    model = make()
    opt = adamw(model.parameters())
    flat = torch.zeros(16, requires_grad=True)
    flat.grad = torch.ones(16)
    opt.param_groups[0]["params"] = [flat]
    with pytest.raises(gg.InvalidOptionError, match=r"DeepSpeed ZeRO replaces the groups.*"):
        opt.step()
    assert flat.grad is not None and not opt.state  # nothing stepped


def test_a_state_dict_for_other_parameters_is_refused_before_loading() -> None:
    model = make()
    opt = adamw(model.parameters())
    loss_of(model, *batches(1)[0]).backward()
    opt.step()
    saved = opt.state_dict()
    saved["state"][99] = saved["state"][0]
    fresh = adamw(model.parameters())
    with pytest.raises(gg.InvalidOptionError, match=r"state for parameter 99, which no saved"):
        fresh.load_state_dict(saved)
    assert not fresh.state
    with pytest.raises(gg.InvalidOptionError, match=r"expected the dict an optimizer's"):
        fresh.load_state_dict({"state": {}})


# -- fake tensors: what gg.estimate(masters="fp32") runs ------------------------------------------
def test_builds_and_steps_over_fake_parameters() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        bf16 = {"dtype": torch.bfloat16}
        model = nn.Sequential(nn.Linear(8, 16, **bf16), nn.GELU(), nn.Linear(16, 1, **bf16))
        opt = adamw(model.parameters(), offload="cpu")
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.step()
        opt.zero_grad()
        model[2](torch.randn(4, 16, dtype=torch.bfloat16)).sum().backward()
        opt.step()  # model[0] rests: offloaded
    master = opt.state[model[0].weight]["master"]
    assert isinstance(master, FakeTensor) and master.dtype == torch.float32
    assert model[0].weight in opt._resting and model[2].weight not in opt._resting
    assert opt.master_bytes() == 12 * (16 + 1) + 2 * 4


def test_the_state_dict_holds_plain_tensors() -> None:
    model = make()
    opt = adamw(model.parameters())
    loss_of(model, *batches(1)[0]).backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert sorted(loaded["state"][0]) == ["exp_avg", "exp_avg_sq", "master", "step"]


# -- which dtypes, named options, whose state_dict -------------------------------------------------
def test_float64_parameters_are_stepped_in_place_as_the_docs_say() -> None:
    """float32 and float64 get no master (the inner optimizer steps them as it would alone);
    bf16 and fp16 get masters; other dtypes are refused. docs/full-finetune.md says the same."""
    ours, theirs = make(torch.float64), make(torch.float64)
    opt = adamw(ours.parameters())
    plain = torch.optim.AdamW(theirs.parameters(), **OPTS)
    for x, y in batches(3, torch.float64):
        for model, optimizer in ((ours, opt), (theirs, plain)):
            loss_of(model, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_same_params(ours, theirs)
    assert all("master" not in entry for entry in opt.state.values())
    for dtype in (torch.complex64, torch.float8_e4m3fn):
        with pytest.raises(gg.InvalidOptionError, match=rf"dtype {dtype}; expected bfloat16"):
            adamw([torch.zeros(2, dtype=dtype)])
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "full-finetune.md").read_text()
    page = " ".join(page.replace("**", "").split())
    assert "float32 and float64 parameters" in page
    assert "other dtypes (float8, complex, integer) are refused" in page


@pytest.mark.parametrize(
    "options, named, not_named",
    [
        ({"lr": 1e-3, "betas1": 0.9}, r"betas1=0.9, which AdamW does not take \(did you mean "
         r"betas=\?\); expected options that AdamW\(params, \.\.\.\) takes: lr, betas,", "lr="),
        ({"lr": -1.0, "weight_decay": 0.1}, r"lr=-1.0: Invalid learning rate: -1.0", "weight"),
        ({"lr": 1e-3, "momentum": 0.9}, r"momentum=0.9, which AdamW does not take;", "lr="),
        ({"lr": 1e-3, "eps": -1.0, "betas": (0.9, 2.0)}, r"eps=-1.0: .*; betas=\(0.9, 2.0\)",
         "lr="),
    ],
)  # fmt: skip
def test_a_refused_option_is_named_alone_with_a_close_match(options, named, not_named) -> None:
    params = list(make().parameters())
    with pytest.raises(gg.InvalidOptionError, match=r"AdamW refused the options") as error:
        LearnerMasters(torch.optim.AdamW, params, **options)
    message = str(error.value)
    import re

    assert re.search(named, message), message
    assert not_named not in message.split("; expected")[0], message


def test_a_plain_optimizers_state_dict_is_refused_and_its_upcast_moments_accepted() -> None:
    model = make()
    plain = torch.optim.AdamW(model.parameters(), **OPTS)
    for x, y in batches(2):
        loss_of(model, x, y).backward()
        plain.step()
        plain.zero_grad()
    state = plain.state_dict()
    opt = adamw(model.parameters())
    with pytest.raises(
        gg.InvalidOptionError,
        match=r"the state_dict's entry 0, for a \(16, 8\) torch.bfloat16 parameter, holds "
        r"exp_avg in torch.bfloat16 and no fp32 master: a plain torch optimizer's state, "
        r"not LearnerMasters'.*upcast its moments to float32 first",
    ):
        opt.load_state_dict(state)
    assert not opt.state  # nothing loaded
    for entry in state["state"].values():  # the way in, on purpose: the message's line
        entry.update({k: v.float() for k, v in entry.items() if k != "step"})
    opt.load_state_dict(state)
    assert opt.state[model.head.weight]["exp_avg"].dtype == torch.float32
    fp32 = make(torch.float32)  # fp32 parameters: the plain state is LearnerMasters' own
    plain = torch.optim.AdamW(fp32.parameters(), **OPTS)
    loss_of(fp32, *batches(1, torch.float32)[0]).backward()
    plain.step()
    adamw(fp32.parameters()).load_state_dict(plain.state_dict())
