"""The benchmark's models, each with a batch, a loss and a hand-written ideal forward.

The *ideal* is what a careful user writes by hand for depth ``k``: the prefix (embeddings and
the first ``n - k`` blocks) under ``torch.no_grad()``, then the suffix with autograd on.
Plain-torch models live here; the transformers models in :mod:`.hf`. On CUDA the ``quick`` and
``full`` sizes are larger (a GPU step on the CPU sizes would measure only launch overhead).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

Size = Literal["full", "quick", "tiny"]
Depth = int | None
Dims = dict[str, tuple[int, ...]]
BASE_DEPTHS: tuple[Depth, ...] = (0, 1, 2, 3, 6, 9, 12, None)


@dataclass
class Workload:
    """One model to benchmark; every callable takes the model so copies can share it."""

    name: str
    model: nn.Module
    batch: Any
    targets: torch.Tensor
    blocks: list[str]
    forward: Callable[[nn.Module, Any], torch.Tensor]
    ideal_forward: Callable[[nn.Module, Any, Depth], torch.Tensor]
    prefix_parameters: Callable[[nn.Module, Depth], list[torch.Tensor]]
    depths: list[Depth] = field(default_factory=list)

    def loss(self, output: torch.Tensor) -> torch.Tensor:
        """Cross-entropy for logits, mean square otherwise."""
        if output.dim() == 3:
            return F.cross_entropy(output.flatten(0, 1), self.targets.flatten())
        return output.float().pow(2).mean()


def scaled_depths(n: int, *, quick: bool) -> list[Depth]:
    """The depths {0, 1, 2, 3, 6, 9, 12, None} scaled from 12 blocks to ``n``, unique.

    >>> scaled_depths(10, quick=False)
    [0, 1, 2, 3, 5, 8, 10, None]
    >>> scaled_depths(12, quick=True)
    [0, 3, 12, None]
    """
    base = (0, 3, 12, None) if quick else BASE_DEPTHS
    found: list[Depth] = []
    for depth in base:
        value = None if depth is None else min(n, int(depth * n / 12 + 0.5))
        if value not in found:
            found.append(value)
    return found


def dims(table: Dims, size: Size, device: torch.device) -> tuple[int, ...]:
    """The row of ``table`` for ``size`` on ``device`` (``cuda-quick`` / ``cuda-full`` on a GPU).

    >>> dims({"quick": (1,), "cuda-quick": (9,)}, "quick", torch.device("cpu"))
    (1,)
    """
    key = size if device.type == "cpu" or size == "tiny" else f"cuda-{size}"
    return table[key]


def on(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors moved to ``device`` (made on the CPU first, so every device sees the same)."""
    return [tensor.to(device) for tensor in tensors]


def _no_grad_unless(depth: Depth) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if depth is None else torch.no_grad()


def _cut(n: int, depth: Depth) -> int:
    return 0 if depth is None else n - depth


# -- (i) a pre-LayerNorm transformer -------------------------------------------------------------
class PreLNBlock(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a 4x MLP, both residual."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class PreLNTransformer(nn.Module):
    """Token and position embeddings, ``n`` pre-LN blocks, a final norm and an LM head."""

    def __init__(self, *, vocab: int, d_model: int, heads: int, seq: int, n: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        self.blocks = nn.ModuleList(PreLNBlock(d_model, heads) for _ in range(n))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tok(ids) + self.pos[: ids.shape[1]]
        return out

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(h))
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.finish(h)


def _transformer_ideal(model: nn.Module, ids: Any, depth: Depth) -> torch.Tensor:
    assert isinstance(model, PreLNTransformer)
    cut = _cut(len(model.blocks), depth)
    with _no_grad_unless(depth):
        h = model.embed(ids)
        for block in model.blocks[:cut]:
            h = block(h)
    for block in model.blocks[cut:]:
        h = block(h)
    return model.finish(h)


def _transformer_prefix(model: nn.Module, depth: Depth) -> list[torch.Tensor]:
    assert isinstance(model, PreLNTransformer)
    if depth is None:
        return []
    cut = _cut(len(model.blocks), depth)
    return [model.tok.weight, model.pos, *model.blocks[:cut].parameters()]


_TRANSFORMER: Dims = {
    # d_model, sequence, batch, vocab
    "full": (256, 128, 16, 512),
    "quick": (64, 32, 4, 128),
    "tiny": (16, 8, 2, 32),
    "cuda-full": (768, 1024, 16, 8192),
    "cuda-quick": (512, 512, 8, 4096),
}


def transformer(
    *,
    size: Size = "full",
    n: int = 12,
    d_model: int | None = None,
    seed: int = 0,
    device: torch.device | None = None,
) -> Workload:
    """The 12-block pre-LN transformer (CPU full size: d_model 256, 4 heads, sequence 128,
    batch 16; on CUDA the GPT-2-small shape, sequence 1024)."""
    device = device or torch.device("cpu")
    d, seq, batch, vocab = dims(_TRANSFORMER, size, device)
    d = d_model or d
    torch.manual_seed(seed)
    model = PreLNTransformer(vocab=vocab, d_model=d, heads=_heads(d), seq=seq, n=n)
    ids, targets = on(
        device, torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    )
    return Workload(
        name="transformer",
        model=model.to(device),
        batch=ids,
        targets=targets,
        blocks=[f"blocks.{i}" for i in range(n)],
        forward=lambda m, x: m(x),
        ideal_forward=_transformer_ideal,
        prefix_parameters=_transformer_prefix,
        depths=scaled_depths(n, quick=size != "full"),
    )


def _heads(d_model: int) -> int:
    return 2 if d_model < 64 else 4 if d_model < 512 else d_model // 64


# -- (iii) the seeds' conv stack, scaled up ------------------------------------------------------
class ConvStack(nn.Module):
    """``n`` Conv2d(c, c, 3, padding=1) layers and a 1x1 conv head (so depth 0 still learns)."""

    def __init__(self, *, channels: int, n: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Conv2d(channels, channels, 3, padding=1) for _ in range(n)]
        )
        self.head = nn.Conv2d(channels, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.layers(x))
        return out


def _conv_ideal(model: nn.Module, x: Any, depth: Depth) -> torch.Tensor:
    assert isinstance(model, ConvStack)
    cut = _cut(len(model.layers), depth)
    h = x
    with _no_grad_unless(depth):
        for layer in list(model.layers)[:cut]:
            h = layer(h)
    for layer in list(model.layers)[cut:]:
        h = layer(h)
    out: torch.Tensor = model.head(h)
    return out


def _conv_prefix(model: nn.Module, depth: Depth) -> list[torch.Tensor]:
    assert isinstance(model, ConvStack)
    return (
        [] if depth is None else list(model.layers[: _cut(len(model.layers), depth)].parameters())
    )


_CONV: Dims = {
    # channels, side, batch
    "full": (32, 64, 8),
    "quick": (8, 32, 4),
    "tiny": (4, 8, 2),
    "cuda-full": (64, 128, 32),
    "cuda-quick": (32, 64, 16),
}


def conv_stack(
    *, size: Size = "full", n: int = 10, seed: int = 0, device: torch.device | None = None
) -> Workload:
    """10 x Conv2d(32, 32, 3) on 64x64 images (CPU full size)."""
    device = device or torch.device("cpu")
    channels, side, batch = dims(_CONV, size, device)
    torch.manual_seed(seed)
    model = ConvStack(channels=channels, n=n)
    (images,) = on(device, torch.randn(batch, channels, side, side))
    return Workload(
        name="conv_stack",
        model=model.to(device),
        batch=images,
        targets=torch.zeros(0, device=device),
        blocks=[f"layers.{i}" for i in range(n)],
        forward=lambda m, x: m(x),
        ideal_forward=_conv_ideal,
        prefix_parameters=_conv_prefix,
        depths=scaled_depths(n, quick=size != "full"),
    )
