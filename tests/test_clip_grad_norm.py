"""gg.optim.clip_grad_norm_ in one process: torch's clip_grad_norm_ with the norm summed in
float64. Across ranks (FSDP2's DTensor gradients) it is tested in tests/test_masters_fsdp.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradgate as gg


def grads_of(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        scale = 10.0 ** torch.randint(-3, 3, (), generator=g).item()
        p.grad = (torch.randn(shape, generator=g) * scale).to(dtype)
        params.append(p)
    return params


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple), max_size=5),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    norm_type=st.sampled_from([1.0, 2.0, 3.0, math.inf]),
    max_norm=st.floats(0.01, 100.0),
    seed=st.integers(0, 1000),
)
def test_it_is_torchs_clip_with_an_exact_norm(
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    norm_type: float,
    max_norm: float,
    seed: int,
) -> None:
    """The norm is the float64 norm of all gradients (rounded to float32); the gradients are
    scaled as torch scales them: by the clamped coefficient rounded to their dtype."""
    params = grads_of(shapes, dtype, seed)
    grads = [p.grad.clone() for p in params if p.grad is not None]  # type: ignore[union-attr]
    norm = gg.optim.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    if not grads:
        assert norm.item() == 0.0
        return
    each = [torch.linalg.vector_norm(g.double(), norm_type) for g in grads if g.numel()]
    wide = torch.linalg.vector_norm(torch.stack(each), norm_type) if each else torch.zeros(())
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, wide.float(), rtol=1e-6, atol=0)
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # in float32
    for p, g in zip(params, grads, strict=True):
        assert torch.equal(p.grad, g * coefficient.to(dtype)), (p.grad, g, coefficient)


def test_it_matches_torch_on_float64_gradients() -> None:
    params = grads_of([(3, 4), (4,), (2, 2)], torch.float64, 0)
    twins = grads_of([(3, 4), (4,), (2, 2)], torch.float64, 0)
    norm = gg.optim.clip_grad_norm_(params, 0.5)
    want = torch.nn.utils.clip_grad_norm_(twins, 0.5)
    assert norm.item() == pytest.approx(want.item(), rel=1e-7)
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_parameters_without_gradients_are_left_alone() -> None:
    layer = torch.nn.Linear(2, 2)
    layer.weight.grad = torch.full((2, 2), 2.0)
    assert gg.optim.clip_grad_norm_(layer.parameters(), 1.0).item() == 4.0
    assert layer.bias.grad is None
    torch.testing.assert_close(layer.weight.grad, torch.full((2, 2), 0.5))  # 2 / (4 + 1e-6)
    assert gg.optim.clip_grad_norm_(layer.weight, 10.0).item() == pytest.approx(1.0)  # a tensor


@pytest.mark.parametrize(
    ("max_norm", "norm_type", "message"),
    [
        (-1.0, 2.0, r"max_norm=-1.0; expected a number >= 0"),
        ("1", 2.0, r"max_norm='1'; expected a number >= 0"),
        (1.0, 0.0, r"norm_type=0.0; expected a number > 0 or math.inf"),
        (1.0, True, r"norm_type=True; expected a number > 0 or math.inf"),
    ],
)
def test_bad_options_are_named(max_norm: object, norm_type: object, message: str) -> None:
    layer = torch.nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()
    with pytest.raises(gg.GradgateError, match=message):
        gg.optim.clip_grad_norm_(layer.parameters(), max_norm, norm_type=norm_type)  # type: ignore[arg-type]
    assert torch.equal(layer.bias.grad, torch.ones(2))  # nothing was scaled
