"""gg.PrefixCache never serves what the model would no longer compute: a changed cut, changed
weights before the cut, a random prefix, changed inputs for a key; bad keys and options are
refused with messages that say what was expected."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from models import gpt2, tiny_resnet
from torch import nn

import gradgate as gg


def _stack(n: int = 6, *, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(n):
        layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        if dropout:
            layer.append(nn.Dropout(dropout))
        layers.append(layer)
    return nn.Sequential(nn.Linear(4, 8), nn.Sequential(*layers), nn.Linear(8, 3))


X = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))


def _step(model: nn.Module, cache: gg.PrefixCache | None, keys: list[int]) -> tuple[Any, ...]:
    model.zero_grad(set_to_none=True)
    if cache is None:
        loss = model(X[keys]).pow(2).sum()
    else:
        with cache.keys(keys):
            loss = model(X[keys]).pow(2).sum()
    loss.backward()
    return (loss.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None))


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def _pair(depth: int = 1) -> tuple[nn.Module, gg.BackpropGate, nn.Module, gg.BackpropGate]:
    model = _stack()
    reference = copy.deepcopy(model)
    return (
        model,
        gg.BackpropGate(model, depth=depth),
        reference,
        gg.BackpropGate(reference, depth=depth),
    )


def test_a_changed_cut_reads_no_entries_of_another_cut() -> None:
    model, gate, reference, ref_gate = _pair()
    cache = gg.PrefixCache(gate, check=0.0)
    for depth in (1, 1, 3, 3, 1):
        gate.depth = ref_gate.depth = depth
        _same(_step(reference, None, [0, 1]), _step(model, cache, [0, 1]))
    assert (cache.stats.hits, cache.stats.misses) == (6, 4)  # depth 1 again: its entries hold


@pytest.mark.parametrize(
    "change",
    ["load_state_dict", "in_place", "replaced", "data", "optimizer"],
)
def test_weights_changed_before_the_cut_are_recomputed(change: str) -> None:
    model, gate, reference, ref = _pair()
    cache = gg.PrefixCache(gate, check=0.0)
    _step(model, cache, [0, 1])
    new = _stack()
    for p in new.parameters():
        p.data.mul_(1.5)
    for net in (model, reference):
        first = net[1][0][0]
        if change == "load_state_dict":
            net.load_state_dict(new.state_dict())
        elif change == "in_place":
            with torch.no_grad():
                first.weight.mul_(1.5)
        elif change == "replaced":
            first.weight = nn.Parameter(first.weight.detach() * 1.5)
        elif change == "data":
            first.weight.data = first.weight.detach() * 1.5
        else:  # a step with no cut: the prefix learns too, and an optimizer steps it
            optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
            net.zero_grad(set_to_none=True)
            for gate_of_net in [g for g in (gate, ref) if g._model is net]:
                gate_of_net.depth = None
                net(X[:2]).pow(2).sum().backward()
                optimizer.step()
                net.zero_grad(set_to_none=True)
                gate_of_net.depth = 1
    _same(_step(reference, None, [0, 1]), _step(model, cache, [0, 1]))
    assert (cache.stats.hits, cache.stats.misses) == (0, 4)
    _same(_step(reference, None, [0, 1]), _step(model, cache, [0, 1]))
    assert cache.stats.hits == 2


def test_a_prefix_block_unfrozen_moves_the_cut() -> None:
    model, gate, reference, ref_gate = _pair()
    cache = gg.PrefixCache(gate, check=0.0)
    _step(model, cache, [0, 1])
    gate.learn = ref_gate.learn = {2, 5}  # block 2 learns again
    for _ in range(2):
        _same(_step(reference, None, [0, 1]), _step(model, cache, [0, 1]))
    assert (cache.stats.hits, cache.stats.misses) == (2, 4)


@pytest.mark.parametrize("kind", ["dropout", "batchnorm"])
def test_a_random_prefix_warns_when_the_cache_is_built(kind: str) -> None:
    if kind == "dropout":
        model: nn.Module = _stack(dropout=0.1).train()
        gate = gg.BackpropGate(model, depth=1)
        expected = "Dropout, p=0.1"
    else:
        model, _, _ = tiny_resnet()
        model.train()
        gate = gg.BackpropGate(model, depth=1)
        expected = "BatchNorm2d in train mode"
    with pytest.warns(gg.PrefixCacheWarning, match=expected) as caught:
        gg.PrefixCache(gate)
    assert "eval mode" in str(caught[0].message)
    model.eval()
    gg.PrefixCache(gate)  # in eval mode: deterministic, nothing to say
    model.train()
    gate.remove()
    gg.PrefixCache(gg.BackpropGate(model, depth=1, prefix_mode="eval"))  # the gate evals it


def test_check_finds_a_hit_that_differs_and_names_dropout() -> None:
    model = _stack(dropout=0.5).train()
    gate = gg.BackpropGate(model, depth=1)
    with pytest.warns(gg.PrefixCacheWarning):
        cache = gg.PrefixCache(gate, check=1.0)
    _step(model, cache, [0, 1])
    with pytest.raises(gg.PrefixCacheError, match=r"key 0 differs.*1\) dropout"):
        _step(model, cache, [0, 1])


def test_check_recomputes_its_share_of_hits() -> None:
    model, gate, reference, _ = _pair()
    cache = gg.PrefixCache(gate, check=0.5)
    for _ in range(41):
        _same(_step(reference, None, [0, 1, 2, 3]), _step(model, cache, [0, 1, 2, 3]))
    stats = cache.stats
    assert stats.hits == 160 and 40 <= stats.checked <= 120  # the first, then about half
    never = gg.PrefixCache(gg.BackpropGate(_stack(), depth=1), check=0.0)
    for _ in range(3):
        _step(never.gate._model, never, [0, 1])
    assert never.stats.checked == 0


def test_a_changed_input_for_a_key_raises() -> None:
    model = _stack()
    cache = gg.PrefixCache(gg.BackpropGate(model, depth=1))
    with cache.keys([0, 1]):
        model(X[:2]).sum().backward()
    with (
        cache.keys([0, 1]),
        pytest.raises(gg.PrefixCacheError, match=r"input of key 1 differs.*augmentation"),
    ):
        model(torch.stack([X[0], X[1].flip(0)])).sum()


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ([0, 1, 2], "3 keys for a batch of 2 samples"),
        ([4, 4], "key 4 appears twice in one batch"),
        ([0.0, 1.0], "key 0.0 has type float .floats are not stable keys"),
        (torch.tensor([0.0, 1.0]), "tensor of torch.float32"),
        ([True, False], "key True has type bool"),
        (7, "not a single value"),
        (torch.zeros(2, 2, dtype=torch.long), "shape \\(2, 2\\)"),
    ],
)
def test_bad_keys_are_refused(keys: Any, message: str) -> None:
    model = _stack()
    cache = gg.PrefixCache(gg.BackpropGate(model, depth=1))
    with pytest.raises(gg.InvalidOptionError, match=message), cache.keys(keys):
        model(X[:2])
    assert cache.stats.misses == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"store": "ram"}, "store='ram' is not allowed; expected one of 'memory', 'disk'"),
        ({"store": "disk"}, "store='disk' needs a path"),
        ({"path": "somewhere"}, "path='somewhere' with store='memory'"),
        ({"check": 1.5}, "check=1.5 is out of range; expected \\[0, 1\\]"),
        ({"check": -0.1}, "check=-0.1 is out of range"),
        ({"check": "often"}, "check='often'; expected a number in \\[0, 1\\]"),
        ({"max_bytes": "lots"}, "max_bytes 'lots' is not a size"),
        ({"max_bytes": -1}, "max_bytes -1 is not a size"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], message: str) -> None:
    gate = gg.BackpropGate(_stack(), depth=1)
    with pytest.raises(gg.InvalidOptionError, match=message):
        gg.PrefixCache(gate, **options)
    forward = gate._model.forward
    assert not isinstance(forward, type(None))
    assert "PrefixCache" not in type(gate._model.__dict__.get("forward")).__name__  # nothing left


def test_only_a_live_gate() -> None:
    with pytest.raises(gg.InvalidOptionError, match=r"expected a live gg\.BackpropGate"):
        gg.PrefixCache(_stack())  # type: ignore[arg-type]
    gate = gg.BackpropGate(_stack(), depth=1)
    gate.remove()
    with pytest.raises(gg.InvalidOptionError, match=r"expected a live gg\.BackpropGate"):
        gg.PrefixCache(gate)


def test_max_bytes_bounds_the_store() -> None:
    model, gate, reference, _ = _pair()
    cache = gg.PrefixCache(gate, max_bytes=3 * 8 * 4, check=0.0)  # 3 entries of 8 floats
    for _ in range(3):
        _same(_step(reference, None, [0, 1, 2, 3]), _step(model, cache, [0, 1, 2, 3]))
    stats = cache.stats
    assert (stats.entries, stats.stored_bytes, stats.not_stored) == (3, 96, 3)
    assert (stats.hits, stats.misses) == (6, 6)


def test_the_cache_leaves_no_trace() -> None:
    from gradgate._cut.prefix_cache.wrappers import BlockForward, CacheForward

    model = _stack()
    gate = gg.BackpropGate(model, depth=1)
    cache = gg.PrefixCache(gate)
    with cache.keys([0, 1]):
        model(X[:2]).sum().backward()
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        wrappers = [vars(m).get("forward") for m in (twin, *twin[1])]
        assert not any(isinstance(w, (CacheForward, BlockForward)) for w in wrappers)
        twin(X[:2]).sum().backward()  # a plain model: every parameter learns
        assert all(p.grad is not None for p in twin.parameters())
    cache.remove()
    gate.remove()
    assert "forward" not in model.__dict__ and all("forward" not in b.__dict__ for b in model[1])
    assert cache.stats.entries == 0


def test_forwards_without_keys_are_not_cached() -> None:
    model = _stack()
    cache = gg.PrefixCache(gg.BackpropGate(model, depth=1))
    for _ in range(2):
        model(X[:2]).sum().backward()
    assert cache.stats == gg.PrefixCache(gg.BackpropGate(_stack(), depth=1)).stats


def test_a_model_returning_prefix_outputs_is_not_served() -> None:
    model, _, _ = gpt2()
    gate = gg.BackpropGate(model, depth=1)
    cache = gg.PrefixCache(gate, check=0.0)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.warns(gg.PrefixCacheWarning, match="output_hidden_states"), cache.keys([0, 1]):
        model(input_ids=ids, output_hidden_states=True).logits.sum().backward()
    with cache.keys([0, 1]):
        out = model(input_ids=ids, output_hidden_states=True)
    assert cache.stats.hits == 0 and cache.stats.entries == 0
    assert all(torch.isfinite(h).all() for h in out.hidden_states)


def test_the_gate_removed_first_leaves_the_cache_harmless() -> None:
    model = _stack()
    gate = gg.BackpropGate(model, depth=1)
    cache = gg.PrefixCache(gate)
    with cache.keys([0, 1]):
        model(X[:2]).sum().backward()
    gate.remove()
    model.zero_grad(set_to_none=True)
    with cache.keys([0, 1]):  # no gate, no cut: every block runs and learns, nothing served
        model(X[:2]).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert (cache.stats.hits, cache.stats.misses) == (0, 2)
    cache.remove()
    assert "forward" not in model.__dict__ and all("forward" not in b.__dict__ for b in model[1])
