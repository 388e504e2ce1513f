"""gg.PrefixCache's entries: padding-free for batches padded to their longest sample, a disk
store found again by a later run of the same model and cut, and refused for another."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from models import bert, gpt2
from test_prefix_cache import assert_same_steps

import gradgate as gg

LENGTHS = [5, 9, 7, 3, 12, 8]
TOKENS = [
    torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(i))
    for i, n in enumerate(LENGTHS)
]


def _batch(keys: list[int], *, left: bool = False, steps: int | None = None) -> dict[str, Any]:
    """The samples padded with 0 to ``steps`` (the longest of them by default), a mask, and
    labels -100 on the padding."""
    longest = steps or max(LENGTHS[k] for k in keys)
    ids = torch.zeros(len(keys), longest, dtype=torch.long)
    mask = torch.zeros(len(keys), longest, dtype=torch.long)
    for row, key in enumerate(keys):
        n = LENGTHS[key]
        at = slice(longest - n, longest) if left else slice(0, n)
        ids[row, at], mask[row, at] = TOKENS[key], 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


ORDERS = [[[0, 1], [2, 3], [4, 5]], [[4, 0], [1, 3], [5, 2]], [[5, 2], [1, 4], [3, 0]]]


def _lm_loss(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    loss: torch.Tensor = model(**inputs).loss
    return loss


def _classify_loss(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits, inputs["input_ids"][:, 0] % 3)


def _train(
    model: Any,
    cache: gg.PrefixCache | None,
    orders: Any = ORDERS,
    loss_fn: Any = _lm_loss,
    **batch: Any,
) -> list[Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for epoch in orders:
        for keys in epoch:
            optimizer.zero_grad(set_to_none=True)
            inputs = _batch(keys, **batch)
            if cache is None:
                loss = loss_fn(model, inputs)
            else:
                with cache.keys(keys):
                    loss = loss_fn(model, inputs)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            steps.append((loss.detach().clone(), grads))
            optimizer.step()
    return steps


def _both(name: str, orders: Any = ORDERS, **batch: Any) -> tuple[list[Any], list[Any], Any]:
    model = gpt2()[0] if name == "gpt2" else bert()[0]
    loss_fn = _lm_loss if name == "gpt2" else _classify_loss
    reference = copy.deepcopy(model)
    gg.BackpropGate(reference, depth=1)
    expected = _train(reference, None, orders, loss_fn, **batch)
    cache = gg.PrefixCache(gg.BackpropGate(model, depth=1), check=0.0)
    return expected, _train(model, cache, orders, loss_fn, **batch), cache


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_padded_batches_store_only_the_tokens(name: str) -> None:
    expected, got, cache = _both(name, steps=12)  # padded on the right to a fixed length
    assert_same_steps(expected, got)
    stats = cache.stats
    assert stats.stored_bytes == sum(LENGTHS) * 32 * 4  # tokens x width x float32, no padding
    assert (stats.hits, stats.misses) == (2 * len(LENGTHS), len(LENGTHS))


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_batches_padded_to_their_longest_sample(name: str) -> None:
    """Each batch as long as its longest sample: a sample's tokens meet another number of rows
    in the prefix's matrix products, which on the CPU round differently for so few rows; the
    steps agree to rounding (bit for bit where the kernels do not depend on the batch)."""
    expected, got, cache = _both(name)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(expected, got, strict=True):
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
        for key in grads_a:
            torch.testing.assert_close(grads_b[key], grads_a[key], rtol=1e-4, atol=1e-6)
    assert cache.stats.hits == 2 * len(LENGTHS)


def test_left_padded_rows_are_kept_whole_and_hit_at_the_same_padding() -> None:
    orders = [[[0, 1]], [[0, 1]], [[0, 4]], [[4, 0]]]  # 0 sits further right with 4 (longer)
    expected, got, cache = _both("gpt2", orders, left=True)
    assert_same_steps(expected, got)
    assert (cache.stats.hits, cache.stats.misses) == (4, 4)
    assert cache.stats.stored_bytes == (9 + 12 + 12) * 32 * 4  # 1; 0 and 4 at length 12


def _tokens_run(model: Any, cache: gg.PrefixCache, keys: list[int]) -> Any:
    ids = torch.stack([TOKENS[4][:5], TOKENS[1][:5], TOKENS[2][:5]])[: len(keys)]
    model.zero_grad(set_to_none=True)
    with cache.keys(keys):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_later_run_reads_the_disk_store(tmp_path: Any) -> None:
    model, _, _ = gpt2()
    pristine = copy.deepcopy(model)
    gate = gg.BackpropGate(model, depth=1)
    first = gg.PrefixCache(gate, store="disk", path=tmp_path, check=0)
    expected = _tokens_run(model, first, [7, 8, 9])
    assert first.stats.misses == 3
    first.remove()
    gate.remove()
    for gated in (model, copy.deepcopy(pristine)):  # the same weights, as a later run loads them
        gate = gg.BackpropGate(gated, depth=1)
        cache = gg.PrefixCache(gate, store="disk", path=tmp_path)
        got = _tokens_run(gated, cache, [7, 8, 9])
        assert (cache.stats.hits, cache.stats.misses) == (3, 0)
        assert torch.equal(expected[0], got[0])
        assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1], strict=True))
        cache.remove()
        gate.remove()
    assert sorted(p.name for p in (tmp_path / "cut-2").iterdir()) == [
        "chunk-00000.npy",
        "index.jsonl",
        "manifest.json",
    ]


def test_a_disk_store_of_other_weights_or_another_model_is_refused(tmp_path: Any) -> None:
    model, _, _ = gpt2()
    cache = gg.PrefixCache(gg.BackpropGate(model, depth=1), store="disk", path=tmp_path)
    _tokens_run(model, cache, [0, 1])
    cache.remove()
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.transformer.h[0].mlp.c_fc.weight.add_(0.01)
    later = gg.PrefixCache(gg.BackpropGate(other, depth=1), store="disk", path=tmp_path)
    with pytest.raises(gg.PrefixCacheError, match=r"computed with other weights before the cut"):
        _tokens_run(other, later, [0, 1])
    with pytest.raises(gg.PrefixCacheError, match=r"holds a prefix cache of another model"):
        gg.PrefixCache(gg.BackpropGate(gpt2(layers=4)[0], depth=1), store="disk", path=tmp_path)


def test_max_bytes_on_disk(tmp_path: Any) -> None:
    model, _, _ = gpt2()
    row = 5 * 32 * 4
    cache = gg.PrefixCache(
        gg.BackpropGate(model, depth=1), store="disk", path=tmp_path, max_bytes=2 * row, check=0
    )
    _tokens_run(model, cache, [0, 1, 2])
    assert (cache.stats.entries, cache.stats.stored_bytes, cache.stats.not_stored) == (
        2,
        2 * row,
        1,
    )
    _tokens_run(model, cache, [0, 1, 2])  # two hits, one miss: exact either way
    assert (cache.stats.hits, cache.stats.misses) == (2, 4)
