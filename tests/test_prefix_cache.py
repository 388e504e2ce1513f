"""gg.PrefixCache against the gate alone: the same losses and gradients, bit for bit, at every
step of several epochs (batches drawn in another order each epoch), on real architectures, in
memory and on disk; and a hit runs no block before the cut."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import bert, gpt2, llama, tiny_resnet
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gradgate as gg

SAMPLES = 6
ORDERS = [[0, 1, 2, 3, 4, 5], [3, 0, 5, 2, 1, 4], [4, 5, 0, 1, 2, 3]]  # an epoch each


def _tokens(factory: Callable[[], Any]) -> tuple[nn.Module, torch.Tensor, Any]:
    model, _, loss = factory()
    ids = torch.randint(0, 97, (SAMPLES, 12), generator=torch.Generator().manual_seed(5))
    return model, ids, lambda m, x: loss(m, {"input_ids": x})


def _images() -> tuple[nn.Module, torch.Tensor, Any]:
    model, _, loss = tiny_resnet()
    images = torch.randn(SAMPLES, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    return model, images, loss


MODELS = {
    "gpt2": lambda: _tokens(gpt2),
    "bert": lambda: _tokens(bert),
    "llama": lambda: _tokens(llama),
    "resnet": _images,
}


def train(
    model: nn.Module,
    data: torch.Tensor,
    loss_fn: Any,
    depth: int,
    cache: dict[str, Any] | None,
    orders: list[list[int]] = ORDERS,
) -> tuple[list[Any], gg.PrefixCache | None]:
    """Steps of SGD over batches of two samples; each step's loss and gradients."""
    gate = gg.BackpropGate(model, depth=depth)
    cached = None if cache is None else gg.PrefixCache(gate, **cache)
    optimizer = torch.optim.SGD([p for p in model.parameters()], lr=0.05)
    steps = []
    for order in orders:
        for start in range(0, len(order), 2):
            keys = order[start : start + 2]
            optimizer.zero_grad(set_to_none=True)
            within = contextlib.nullcontext() if cached is None else cached.keys(keys)
            with within:
                loss = loss_fn(model, data[keys])
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            steps.append((loss.detach().clone(), grads))
            optimizer.step()
    gate.remove()
    return steps, cached


def assert_same_steps(expected: list[Any], got: list[Any]) -> None:
    assert len(expected) == len(got)
    for step, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(loss_a, loss_b), (step, loss_a, loss_b)
        assert grads_a.keys() == grads_b.keys(), step
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), (step, name)


@pytest.mark.parametrize("store", ["memory", "disk"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("depth", [1, 0])
def test_the_same_steps_as_the_gate_alone(name: str, depth: int, store: str, tmp_path: Any) -> None:
    model, data, loss_fn = MODELS[name]()
    reference = copy.deepcopy(model)
    expected, _ = train(reference, data, loss_fn, depth, None)
    options: dict[str, Any] = {"store": store, "check": 0.0}
    if store == "disk":
        options["path"] = tmp_path / "cache"
    got, cache = train(model, data, loss_fn, depth, options)
    assert_same_steps(expected, got)
    assert cache is not None
    assert (cache.stats.hits, cache.stats.misses) == (2 * SAMPLES, SAMPLES)
    assert cache.stats.entries == SAMPLES and cache.stats.skipped_flops > 0
    cache.remove()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_hit_runs_no_block_before_the_cut(name: str) -> None:
    model, data, loss_fn = MODELS[name]()
    gate = gg.BackpropGate(model, depth=1)
    cache = gg.PrefixCache(gate, check=0.0)
    names = gate.blocks
    counts = []
    for _ in range(2):
        with FlopCounterMode(display=False) as counter, cache.keys([0, 1]):
            loss_fn(model, data[:2]).backward()
        counts.append(counter.get_flop_counts())

    def prefix_flops(table: dict[str, Any]) -> int:
        return sum(
            sum(ops.values())
            for module, ops in table.items()
            if any(module.endswith("." + block) for block in names[:-1])
        )

    assert prefix_flops(counts[0]) > 0  # the miss ran the prefix
    assert prefix_flops(counts[1]) == 0  # the hit ran none of it
    last = names[-1]
    learner = [sum(ops.values()) for m, ops in counts[1].items() if m.endswith("." + last)]
    assert learner and learner[0] > 0  # the learner still ran, forward and backward
    assert cache.stats.skipped_flops == prefix_flops(counts[0])  # 2 samples, 2 hits
    cache.remove()
    gate.remove()


def test_a_batch_of_hits_and_misses_matches_the_gate_alone() -> None:
    model, data, loss_fn = MODELS["gpt2"]()
    reference = copy.deepcopy(model)
    orders = [[0, 1, 2, 3], [0, 4, 1, 5, 2, 3]]  # the second epoch mixes hits and misses
    expected, _ = train(reference, data, loss_fn, 1, None, orders)
    got, cache = train(model, data, loss_fn, 1, {"check": 0.0}, orders)
    assert_same_steps(expected, got)
    assert cache is not None and (cache.stats.hits, cache.stats.misses) == (4, 6)


@pytest.mark.parametrize("order", ["cache first", "compile first"])
def test_compiled_blocks_behind_the_cache(order: str) -> None:
    model, data, loss_fn = MODELS["gpt2"]()
    reference = copy.deepcopy(model)
    expected, _ = train(reference, data, loss_fn, 1, None)
    handle = None
    if order == "compile first":
        handle = gg.compile_blocks(model, backend="eager")
    gate = gg.BackpropGate(model, depth=1)
    cache = gg.PrefixCache(gate, check=0.0)
    if order == "cache first":
        handle = gg.compile_blocks(model, backend="eager")
    optimizer = torch.optim.SGD(list(model.parameters()), lr=0.05)
    got = []
    for order_ in ORDERS:
        for start in range(0, len(order_), 2):
            keys = order_[start : start + 2]
            optimizer.zero_grad(set_to_none=True)
            with cache.keys(keys):
                loss = loss_fn(model, data[keys])
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            got.append((loss.detach().clone(), grads))
            optimizer.step()
    assert_same_steps(expected, got)
    assert cache.stats.hits == 2 * SAMPLES
    assert handle is not None
    handle.remove()
    cache.remove()
    gate.remove()
    assert all("forward" not in vars(block) for block in model.transformer.h)


def test_torch_compile_of_the_model_runs_without_the_cache() -> None:
    model, data, loss_fn = MODELS["gpt2"]()
    gate = gg.BackpropGate(model, depth=1)
    cache = gg.PrefixCache(gate)
    compiled = torch.compile(model, backend="eager")
    for _ in range(2):
        with cache.keys([0, 1]):
            loss_fn(compiled, data[:2]).backward()
    assert (cache.stats.hits, cache.stats.misses) == (0, 0)  # the cache stands aside
    assert model.transformer.h[0].attn.c_attn.weight.grad is None  # the gate still cuts
