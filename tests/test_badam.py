"""gg.schedules.BAdam: one block learns for switch_every steps, then the next."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn

import gradgate as gg
from gradgate.schedules import BAdam, Plan


def windows(sched: BAdam, cycles: int) -> list[int]:
    """The active block of each window."""
    m = sched.n - len([i for i in sched.always if isinstance(i, int)])
    return [sched.active(w * sched.switch_every) for w in range(cycles * m)]


@pytest.mark.parametrize("m", [2, 3, 4, 7])
@pytest.mark.parametrize("seed", range(12))
def test_random_draws_a_permutation_per_cycle_and_switches_at_every_window(m, seed) -> None:
    sched = BAdam(m, switch_every=3, seed=seed)
    order = windows(sched, 6)
    for c in range(6):
        assert sorted(order[c * m : (c + 1) * m]) == list(range(m))
    assert all(a != b for a, b in itertools.pairwise(order))
    for w, block in enumerate(order):  # every block gets exactly switch_every steps
        assert [sched.active(s) for s in range(3 * w, 3 * w + 3)] == [block] * 3


def test_random_cycles_differ_and_two_blocks_alternate() -> None:
    order = windows(BAdam(6, switch_every=1, seed=0), 8)
    assert len({tuple(order[c * 6 : (c + 1) * 6]) for c in range(8)}) > 4
    two = windows(BAdam(2, switch_every=1, seed=4), 5)
    assert two in ([0, 1] * 5, [1, 0] * 5)


def test_ascending_and_descending_sweep_in_order() -> None:
    assert windows(BAdam(3, 2, order="ascending"), 2) == [0, 1, 2, 0, 1, 2]
    assert windows(BAdam(3, 2, order="descending"), 2) == [2, 1, 0, 2, 1, 0]
    assert [BAdam(3, 2, order="ascending").active(s) for s in range(7)] == [0, 0, 1, 1, 2, 2, 0]


def test_plan_is_pure_and_the_same_in_another_process() -> None:
    sched = BAdam(5, 2, seed=7)
    here = [sched.active(s) for s in range(40)]
    assert [BAdam(5, 2, seed=7).active(s) for s in reversed(range(40))] == here[::-1]
    code = "import gradgate as gg; s = gg.schedules.BAdam(5, 2, seed=7); "
    code += "print([s.active(t) for t in range(40)])"
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert there.strip() == str(here)
    assert [BAdam(5, 2, seed=8).active(s) for s in range(40)] != here  # the seed matters


def test_plan_resting_and_finished() -> None:
    sched = BAdam(4, 2, order="ascending", always=[3, "head"])
    assert sched.plan(2) == Plan(learn=frozenset({1, 3, "head"}))
    assert sched.resting(2) == frozenset({0, 2})  # block 3 learns always: never rests
    assert sched.finished(100) == frozenset()
    assert windows(sched, 2) == [0, 1, 2, 0, 1, 2]
    assert sched.plan(0).metrics(4) == {
        "learning_blocks": 2,
        "skipped_blocks": 0,
        "learning_share": 0.5,
    }


def model() -> nn.Module:
    blocks = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    return nn.Sequential(OrderedDict(embed=nn.Linear(3, 3), blocks=blocks, head=nn.Linear(3, 1)))


def test_apply_sets_the_active_block_and_what_runs_after_learns() -> None:
    net = model()
    gate = gg.BackpropGate(net, "blocks.*")
    sched = BAdam(4, 1, order="descending")
    assert sched.apply(gate, 0) == Plan(learn=frozenset({3}))
    assert sched.apply(gate) == Plan(learn=frozenset({2}))  # counts itself from next_step
    net(torch.randn(2, 3)).sum().backward()
    learned = sorted(n for n, p in net.named_parameters() if p.grad is not None)
    assert learned == ["blocks.2.bias", "blocks.2.weight", "head.bias", "head.weight"]
    gate.remove()


def test_block_names_in_always_leave_the_rotation() -> None:
    net = model()
    gate = gg.BackpropGate(net, "blocks.*")
    sched = BAdam(4, 1, order="ascending", always=["blocks.0"])
    assert sched.active(0) == 0  # before it sees the gate, the name is only a name
    sched.apply(gate, 0)
    assert [sched.active(s) for s in range(4)] == [1, 2, 3, 1]
    assert sched.plan(0) == Plan(learn=frozenset({0, 1}))
    assert sched.resting(0) == frozenset({2, 3})
    gate.remove()
    whole = BAdam(4, 1, always=["blocks.*"])
    with pytest.raises(gg.InvalidOptionError, match=r"holds all 4 blocks, so no block is left"):
        whole.apply(gg.BackpropGate(model(), "blocks.*"), 0)
    assert whole._rotation == [0, 1, 2, 3]  # refused before anything changed


def test_state_dict_round_trip_and_refusal() -> None:
    sched = BAdam(4, 3, order="random", always=["head"], seed=2)
    gate = gg.BackpropGate(model(), "blocks.*")
    for _ in range(5):
        sched.apply(gate)
    state = sched.state_dict()
    assert state == {
        "schedule": "BAdam",
        "config": {"n": 4, "switch_every": 3, "order": "random", "always": ["head"]},
        "seed": 2,
        "next_step": 5,
    }
    again = BAdam(4, 3, order="random", always=["head"], seed=2)
    again.load_state_dict(state)
    assert again.next_step == 5 and again.apply(gate) == sched.apply(gate)
    with pytest.raises(gg.InvalidOptionError, match=r"the state's config is .* but this BAdam"):
        BAdam(4, 4, always=["head"], seed=2).load_state_dict(state)
    gate.remove()


def test_repr() -> None:
    assert repr(BAdam(4)) == "BAdam(4, switch_every=50, order='random', always=[], seed=0)"
    assert repr(BAdam(4, 2, order="ascending", always=[1, "head"], seed=3)) == (
        "BAdam(4, switch_every=2, order='ascending', always=[1, 'head'], seed=3)"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"switch_every": 0}, r"switch_every=0 .*expected"),
        ({"switch_every": 1.5}, r"switch_every=1.5"),
        (
            {"order": "fixed"},
            r"order='fixed' is not allowed; expected one of 'random', 'ascending'",
        ),
        ({"always": [4]}, r"always entry=4"),
        ({"always": [0, 1, 2, 3]}, r"always=\[0, 1, 2, 3\] holds all 4 blocks"),
        ({"seed": "x"}, r"seed='x'"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, message) -> None:
    with pytest.raises(gg.InvalidOptionError, match=message):
        BAdam(4, **kwargs)


def test_a_gate_of_another_size_is_refused() -> None:
    gate = gg.BackpropGate(model(), "blocks.*")
    with pytest.raises(gg.InvalidOptionError, match=r"plans over 3 blocks but the gate has 4"):
        BAdam(3, 2).apply(gate, 0)
    gate.remove()


# -- a weight tied between a block and the head ------------------------------------------------
def tied_gpt2(dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny GPT-2 whose head shares its weight with block 0's MLP output projection (a
    (128, 32) matrix both ways): the head learns at every step, so the weight does."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=128, n_positions=16,
                        use_cache=False, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                        tie_word_embeddings=False)  # fmt: skip
    net = GPT2LMHeadModel(config).eval()
    net.lm_head.weight = net.transformer.h[0].mlp.c_proj.weight
    return net.to(dtype)


def tied_run(dtype: torch.dtype, drop) -> tuple[nn.Module, torch.optim.Optimizer]:
    import warnings

    net = tied_gpt2(dtype)
    gate = gg.BackpropGate(net)
    sched = BAdam(3, switch_every=1, order="ascending")
    opts = {"lr": 1e-2, "weight_decay": 0.1}
    if dtype == torch.float32:
        opt: torch.optim.Optimizer = torch.optim.AdamW(net.parameters(), **opts)
    else:
        opt = gg.optim.LearnerMasters(torch.optim.AdamW, net.parameters(), **opts)
    tied = net.lm_head.weight
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():  # block 0 before the cut: only the head's use learns
        warnings.simplefilter("ignore", gg.SharedParameterWarning)
        for step in range(7):
            sched.apply(gate, step)
            net(input_ids=ids).logits.float().pow(2).mean().backward()
            assert tied.grad is not None  # through the head, at every step
            opt.step()
            opt.zero_grad()
            drop(opt, gate, sched, step + 1)
            kept = opt.state.get(tied, {}).get("step")
            assert kept is not None and kept.item() == step + 1, step  # never reset
    gate.remove()
    return net, opt


def by_hand(opt: torch.optim.Optimizer, gate: gg.BackpropGate, sched: BAdam, step: int) -> None:
    """What drop_finished promises, written out: the resting blocks' state goes, except for
    a parameter the head (which learns at every step) holds too."""
    model = gate._model
    for position in sched.resting(step):
        for param in model.get_submodule(gate.blocks[position]).parameters():
            if param is not model.lm_head.weight:
                gg.optim.drop_state(opt, [param])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["AdamW", "masters"])
def test_drop_finished_keeps_the_state_of_a_weight_tied_to_the_head(dtype) -> None:
    ours, opt = tied_run(dtype, gg.optim.drop_finished)
    theirs, _ = tied_run(dtype, by_hand)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q), name
    if dtype == torch.bfloat16:
        assert opt.state[ours.lm_head.weight]["master"].dtype == torch.float32
