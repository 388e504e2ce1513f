"""``gg.learn_rows``: only the given rows of an embedding's or a linear layer's weight learn.

Reference: plain autograd on an unmodified copy of the model (``torch.autograd.grad`` of the
full weight, then its rows). The other rows must stay bit-identical under every optimizer,
no gradient of the full weight may exist, and the optimizer must hold state for the rows only.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
from collections.abc import Callable, Iterator

import pytest
import torch
from models import gpt2, llama
from torch import nn

import gradgate as gg

ROWS = [57, 96, 5, 7, 22]  # new tokens: in the batch and not, the last id, not in order


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """MKL splits a matrix product among threads by its shape: a product of k rows then sums
    in another order than the full one. With one thread both sum in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference_rows(model: nn.Module, batch: dict, loss_fn: Callable, name: str) -> torch.Tensor:
    """The rows' gradient by plain autograd on an unmodified copy (the full weight's gradient)."""
    twin = copy.deepcopy(model)
    weight = twin.get_submodule(name).weight
    (grad,) = torch.autograd.grad(loss_fn(twin, batch), [weight])
    return grad[ROWS]


@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (llama, "model.embed_tokens"),
        (llama, "lm_head"),
        (lambda: gpt2(tied=True), "transformer.wte"),
        (lambda: gpt2(tied=False), "transformer.wte"),
        (lambda: gpt2(tied=False), "lm_head"),
    ],
)
def test_the_rows_gradient_is_plain_autograds_bit_for_bit(factory: Callable, name: str) -> None:
    model, batch, loss_fn = factory()
    with one_thread():
        expected = reference_rows(model, batch, loss_fn, name)
        with gg.learn_rows(model, name, rows=ROWS) as handle:
            loss_fn(model, batch).backward()
            grad = handle.parameter.grad
            assert grad is not None and grad.shape == (len(ROWS), expected.shape[1])
            assert torch.equal(grad, expected)
            assert model.get_submodule(name).weight.grad is None  # no full-weight gradient


def test_an_embedding_row_is_exact_with_every_thread() -> None:
    """The embedding's backward sums each row's positions in order: the same with k rows."""
    model, batch, loss_fn = llama()
    expected = reference_rows(model, batch, loss_fn, "model.embed_tokens")
    with gg.learn_rows(model, "model.embed_tokens", rows=ROWS) as handle:
        loss_fn(model, batch).backward()
        assert torch.equal(handle.parameter.grad, expected)


def test_a_linear_row_with_every_thread_is_within_rounding() -> None:
    model, batch, loss_fn = llama()
    expected = reference_rows(model, batch, loss_fn, "lm_head")
    with gg.learn_rows(model, "lm_head", rows=ROWS) as handle:
        loss_fn(model, batch).backward()
        torch.testing.assert_close(handle.parameter.grad, expected, rtol=1e-5, atol=1e-6)


def test_the_outputs_and_the_other_gradients_are_unchanged_bit_for_bit() -> None:
    model, batch, loss_fn = gpt2(tied=True)
    twin = copy.deepcopy(model)
    reference = dict(zip(
        [n for n, _ in twin.named_parameters()],
        torch.autograd.grad(loss_fn(twin, batch), list(twin.parameters())),
        strict=True,
    ))  # fmt: skip
    with gg.learn_rows(model, "transformer.wte", rows=ROWS):
        assert torch.equal(model(**batch).logits, twin(**batch).logits)
        loss_fn(model, batch).backward()
        for name, param in model.named_parameters():
            if name.startswith("transformer.wte."):  # the frozen weight and its rows
                continue
            assert param.grad is not None, name
            assert torch.equal(param.grad, reference[name]), name


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd_momentum_decay": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, weight_decay=0.1),
    # fused kernels move no version counter: the step hook writes the weight all the same
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("tied", [True, False])
def test_the_other_rows_never_move_and_the_rows_follow_the_reference(
    optimizer: str, tied: bool
) -> None:
    """Three steps of ``optimizer(model.parameters())``: the other rows are bit-identical to the
    start, the rows equal a reference that trains the whole weight with the other rows' gradient
    masked by hand (a hook) and only the rows in the optimizer's view."""
    model, batch, loss_fn = gpt2(tied=tied)
    start = model.transformer.wte.weight.detach().clone()
    reference = copy.deepcopy(model)
    with one_thread():
        handle = gg.learn_rows(model, "transformer.wte", rows=ROWS)
        opt = OPTIMIZERS[optimizer](list(model.parameters()))
        ref_rows = _masked_reference(reference, batch, loss_fn, optimizer)
        for _ in range(3):
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
        weight = model.transformer.wte.weight
        others = [i for i in range(weight.shape[0]) if i not in ROWS]
        assert torch.equal(weight[others], start[others])  # bit-identical
        assert not torch.equal(handle.parameter, start[ROWS])  # the rows did learn
        assert torch.equal(handle.parameter.detach(), ref_rows)
        assert torch.equal(weight[ROWS], ref_rows)  # the weight holds them after each step
        state = [t for t in opt.state[handle.parameter].values() if t.dim()]
        assert state and all(t.shape == (len(ROWS), weight.shape[1]) for t in state)
        assert weight not in opt.state
        handle.remove()
    assert torch.equal(model.transformer.wte.weight[ROWS], ref_rows)  # written back


def _masked_reference(
    model: nn.Module, batch: dict, loss_fn: Callable, optimizer: str
) -> torch.Tensor:
    """The rows after three steps of the hand-written way: a parameter of the rows alone that
    the full weight's masked gradient feeds (so the optimizer sees exactly the rows)."""
    weight = model.transformer.wte.weight
    rows = nn.Parameter(weight.detach()[ROWS].clone())
    opt = OPTIMIZERS[optimizer]([*(p for p in model.parameters() if p is not weight), rows])
    for _ in range(3):
        (grad, *others) = torch.autograd.grad(
            loss_fn(model, batch), [weight, *(p for p in model.parameters() if p is not weight)]
        )
        rows.grad = grad[ROWS]
        for param, g in zip(
            (p for p in model.parameters() if p is not weight), others, strict=True
        ):
            param.grad = g
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            weight[ROWS] = rows
    return rows.detach()


def test_state_dict_has_no_new_keys_and_holds_the_learned_rows() -> None:
    model, batch, loss_fn = llama()
    keys = list(model.state_dict())
    handle = gg.learn_rows(model, "model.embed_tokens", rows=ROWS)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loss_fn(model, batch).backward()
    opt.step()
    state = model.state_dict()
    assert list(state) == keys
    assert torch.equal(state["model.embed_tokens.weight"][ROWS], handle.parameter.detach())
    assert "model.embed_tokens.weight_rows" in dict(model.named_parameters())
    # loading a plain checkpoint sets the rows from its weight
    fresh, _, _ = llama()
    fresh_handle = gg.learn_rows(fresh, "model.embed_tokens", rows=ROWS)
    fresh.load_state_dict(state)
    assert torch.equal(fresh_handle.parameter.detach(), handle.parameter.detach())


def test_save_pretrained_writes_the_plain_model_with_the_rows(tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    model, batch, loss_fn = gpt2(tied=True)
    handle = gg.learn_rows(model, "transformer.wte", rows=ROWS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn(model, batch).backward()
    opt.step()
    model.save_pretrained(tmp_path)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.transformer.wte.weight[ROWS], handle.parameter.detach())
    assert torch.equal(loaded(**batch).logits, model(**batch).logits)


def test_remove_puts_the_model_back_with_the_learned_rows() -> None:
    model, batch, loss_fn = gpt2(tied=True)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    forward = model.transformer.wte.__dict__.get("forward")
    handle = gg.learn_rows(model, "transformer.wte", rows=ROWS)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loss_fn(model, batch).backward()
    opt.step()
    learned = handle.parameter.detach().clone()
    handle.remove()
    handle.remove()  # once only
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert model.transformer.wte.__dict__.get("forward") is forward
    assert model.lm_head.__dict__.get("forward") is None
    assert torch.equal(model.transformer.wte.weight[ROWS], learned)
    assert list(model.transformer.wte._state_dict_hooks) == []
    loss_fn(model, batch).backward()  # the plain model trains the whole weight again
    assert model.transformer.wte.weight.grad is not None


def test_the_context_manager_undoes_also_when_the_body_raises() -> None:
    model, _, _ = llama()
    with pytest.raises(KeyboardInterrupt), gg.learn_rows(model, "lm_head", rows=ROWS):
        raise KeyboardInterrupt
    assert "weight_rows" not in model.lm_head._parameters
    assert model.lm_head.weight.requires_grad


def test_a_frozen_weight_learns_its_rows_and_stays_frozen_after() -> None:
    """``gg.freeze(model, '**')`` then ``learn_rows``: PEFT's way, the rows of a frozen model."""
    model, batch, loss_fn = llama()
    freeze = gg.freeze(model, "**")
    with gg.learn_rows(model, "model.embed_tokens", rows=ROWS) as handle:
        assert [n for n, p in model.named_parameters() if p.requires_grad] == [
            "model.embed_tokens.weight_rows"
        ]
        loss_fn(model, batch).backward()
        assert handle.parameter.grad is not None
        freeze.remove()  # the weight stays frozen while its rows learn
        assert not model.model.embed_tokens.weight.requires_grad
    assert model.model.embed_tokens.weight.requires_grad


def test_handle_state_dict_holds_only_the_rows() -> None:
    model, _, _ = llama()
    handle = gg.learn_rows(model, "model.embed_tokens", rows=ROWS)
    state = handle.state_dict()
    assert sorted(state) == ["rows", "weight"]
    assert state["rows"].tolist() == ROWS and state["weight"].shape == (len(ROWS), 32)
    with torch.no_grad():
        handle.parameter.zero_()
    handle.load_state_dict(state)
    assert torch.equal(handle.parameter.detach(), state["weight"])
    assert torch.equal(model.model.embed_tokens.weight[ROWS], state["weight"])
    with pytest.raises(gg.GradgateError, match=r"rows \[57, 96, 5\]"):
        handle.load_state_dict({"rows": torch.tensor(ROWS[:3]), "weight": state["weight"][:3]})


def test_copies_learn_their_own_rows() -> None:
    """deepcopy, pickle and torch.save give a working model bound to its own tensors."""
    model, batch, loss_fn = llama()
    gg.learn_rows(model, "model.embed_tokens", rows=ROWS)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [
        copy.deepcopy(model),
        pickle.loads(pickle.dumps(model)),
        torch.load(buffer, weights_only=False),
    ]
    for twin in copies:
        loss_fn(twin, batch).backward()
        assert twin.model.embed_tokens.weight_rows.grad is not None
        assert model.model.embed_tokens.weight_rows.grad is None
        assert list(twin.state_dict()) == list(llama()[0].state_dict())


def test_two_forwards_before_one_backward() -> None:
    """The weight is written from the rows only after they changed: a second forward before
    backward does not invalidate the first one's graph (the tied head saved the weight)."""
    model, batch, loss_fn = gpt2(tied=True)
    handle = gg.learn_rows(model, "transformer.wte", rows=ROWS)
    (loss_fn(model, batch) + loss_fn(model, batch)).backward()
    expected = 2 * reference_rows(gpt2(tied=True)[0], batch, loss_fn, "transformer.wte")
    torch.testing.assert_close(handle.parameter.grad, expected)


def test_rows_in_a_batch_of_no_new_tokens_get_a_zero_gradient() -> None:
    model, batch, loss_fn = llama()
    rows = [r for r in range(97) if r not in batch["input_ids"]][:3]
    with gg.learn_rows(model, "model.embed_tokens", rows=rows) as handle:
        loss_fn(model, batch).backward()
        assert torch.equal(handle.parameter.grad, torch.zeros(3, 32))


def test_padding_idx_and_scale_grad_by_freq_follow_the_embedding() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(20, 4, padding_idx=5, scale_grad_by_freq=True)
    ids = torch.tensor([[5, 1, 1, 2], [5, 9, 1, 19]])
    grad_out = torch.randn(2, 4, 4)
    (expected,) = torch.autograd.grad(emb(ids), [emb.weight], grad_out)
    rows = [5, 1, 19, 0]
    with gg.learn_rows(emb, "", rows=rows) as handle:
        emb(ids).backward(grad_out)
        assert torch.equal(handle.parameter.grad, expected[rows])
        assert torch.equal(handle.parameter.grad[0], torch.zeros(4))  # the padding row


def test_autocast_rows_match_the_reference() -> None:
    model, batch, loss_fn = gpt2(tied=True)
    with one_thread():
        twin = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(twin, batch)
        (grad,) = torch.autograd.grad(loss, [twin.transformer.wte.weight])
        with gg.learn_rows(model, "transformer.wte", rows=ROWS) as handle:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model, batch)
            loss.backward()
            assert torch.equal(handle.parameter.grad, grad[ROWS])


def test_a_scaled_embedding_subclass_is_followed_through_its_own_forward() -> None:
    """Gemma-style: ``forward`` returns ``super().forward(ids) * scale``; the rows get the
    scaled gradient because the functional call inside is followed, not the module's output."""

    class Scaled(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 3.0

    torch.manual_seed(0)
    emb = Scaled(10, 4)
    ids = torch.tensor([1, 2, 2, 9])
    (expected,) = torch.autograd.grad(emb(ids).pow(2).sum(), [emb.weight])
    with gg.learn_rows(emb, "", rows=[2, 9]) as handle:
        emb(ids).pow(2).sum().backward()
        assert torch.equal(handle.parameter.grad, expected[[2, 9]])


def test_in_place_changes_of_the_output_are_allowed() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 6))
    with gg.learn_rows(model, "1", rows=[0, 5]) as handle:
        out = model(torch.tensor([1, 2]))
        out.mul_(2)
        out.sum().backward()
        assert handle.parameter.grad is not None


def test_no_grad_and_a_frozen_rows_parameter_record_nothing() -> None:
    model, batch, loss_fn = llama()
    with gg.learn_rows(model, "model.embed_tokens", rows=ROWS) as handle:
        with torch.no_grad():
            assert loss_fn(model, batch).grad_fn is None
        with gg.frozen(model, "model.embed_tokens"):
            loss_fn(model, batch).backward()
        assert handle.parameter.grad is None


def test_another_optimizers_step_leaves_the_weight_as_a_pending_graph_needs_it() -> None:
    """GAN-style: another model's optimizer steps between this model's forward and backward;
    the tied head saved the weight for its input gradient, so it must not be written now."""
    model, batch, loss_fn = gpt2(tied=True)
    handle = gg.learn_rows(model, "transformer.wte", rows=ROWS)
    other = nn.Linear(2, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with torch.no_grad():
        handle.parameter.add_(1.0)  # changed since the last write: written at the forward
    loss = loss_fn(model, batch)
    other(torch.ones(1, 2)).sum().backward()
    other_opt.step()
    loss.backward()
    assert handle.parameter.grad is not None


def test_a_gradient_accumulated_before_learn_rows_carries_on_in_the_rows() -> None:
    model, batch, loss_fn = llama()
    reference = copy.deepcopy(model)
    for _ in range(2):
        loss_fn(reference, batch).backward()
    loss_fn(model, batch).backward()  # the first micro-batch, before learn_rows
    handle = gg.learn_rows(model, "model.embed_tokens", rows=ROWS)
    assert model.model.embed_tokens.weight.grad is None  # no stale full gradient to step
    loss_fn(model, batch).backward()
    expected = reference.model.embed_tokens.weight.grad[ROWS]
    assert torch.equal(handle.parameter.grad, expected)


@pytest.mark.slow
def test_a_compiled_model_learns_its_rows_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 20))
    reference = copy.deepcopy(model)
    ids = torch.tensor([[1, 2, 3, 3]])
    (expected,) = torch.autograd.grad(reference(ids).pow(2).sum(), [reference[0].weight])
    with gg.learn_rows(model, "0", rows=[1, 3]) as handle:
        torch.compile(model)(ids).pow(2).sum().backward()
        assert torch.equal(handle.parameter.grad, expected[[1, 3]])
