"""The transformers workloads: GPT-2 and Llama at random-init configs (nothing is downloaded).

transformers is imported inside the functions, so the benchmark's other workloads run
without it. Each ideal forward repeats what the model's own forward does, with the prefix
under ``torch.no_grad()``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .workloads import Depth, Dims, Size, Workload, _cut, _no_grad_unless, dims, on, scaled_depths


def _logits_of(model: nn.Module, ids: Any) -> torch.Tensor:
    logits: torch.Tensor = model(input_ids=ids, use_cache=False).logits
    return logits


def _causal_mask(config: Any, embeds: torch.Tensor, positions: torch.Tensor) -> Any:
    from transformers.masking_utils import create_causal_mask

    # transformers renamed ``past_key_values`` to ``cache`` (5.2x); the old name is deprecated.
    parameters = inspect.signature(create_causal_mask).parameters
    no_cache = {"cache" if "cache" in parameters else "past_key_values": None}
    return create_causal_mask(
        config=config,
        inputs_embeds=embeds,
        attention_mask=None,
        position_ids=positions,
        **no_cache,
    )


# -- GPT-2 ---------------------------------------------------------------------------------------
def _gpt2_ideal(model: nn.Module, ids: Any, depth: Depth) -> torch.Tensor:
    body: Any = model.transformer
    cut = _cut(len(body.h), depth)
    with _no_grad_unless(depth):
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        embeds = body.wte(ids)
        h = body.drop(embeds + body.wpe(positions))
        mask = _causal_mask(body.config, embeds, positions)
        for block in body.h[:cut]:
            h = block(h, None, mask, None, use_cache=False, position_ids=positions)
    for block in body.h[cut:]:
        h = block(h, None, mask, None, use_cache=False, position_ids=positions)
    logits: torch.Tensor = model.lm_head(body.ln_f(h))  # type: ignore[operator]
    return logits


def _gpt2_prefix(model: nn.Module, depth: Depth) -> list[torch.Tensor]:
    if depth is None:
        return []
    body: Any = model.transformer
    cut = _cut(len(body.h), depth)
    return [body.wte.weight, body.wpe.weight, *body.h[:cut].parameters()]


_GPT2: Dims = {
    # n_embd, sequence, batch, vocab
    "full": (64, 128, 8, 512),
    "quick": (32, 32, 4, 128),
    "tiny": (16, 8, 2, 32),
    "cuda-full": (768, 1024, 8, 8192),
    "cuda-quick": (512, 512, 8, 4096),
}


def gpt2(
    *, size: Size = "full", n: int = 12, seed: int = 0, device: torch.device | None = None
) -> Workload:
    """``GPT2LMHeadModel``, untied, no dropout (CPU full size: n_embd 64, sequence 128)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    device = device or torch.device("cpu")
    d, seq, batch, vocab = dims(_GPT2, size, device)
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=n,
        n_embd=d,
        n_head=4 if d < 512 else d // 64,
        vocab_size=vocab,
        n_positions=seq,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        use_cache=False,
    )
    model = GPT2LMHeadModel(config).train()
    ids, targets = on(
        device, torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    )
    return Workload(
        name="gpt2",
        model=model.to(device),
        batch=ids,
        targets=targets,
        blocks=[f"transformer.h.{i}" for i in range(n)],
        forward=_logits_of,
        ideal_forward=_gpt2_ideal,
        prefix_parameters=_gpt2_prefix,
        depths=scaled_depths(n, quick=size != "full"),
    )


# -- Llama ---------------------------------------------------------------------------------------
def _llama_ideal(model: nn.Module, ids: Any, depth: Depth) -> torch.Tensor:
    body: Any = model.model
    cut = _cut(len(body.layers), depth)
    with _no_grad_unless(depth):
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        h = body.embed_tokens(ids)
        mask = _causal_mask(body.config, h, positions)
        rotary = body.rotary_emb(h, position_ids=positions)
        for layer in body.layers[:cut]:
            h = _llama_layer(layer, h, mask, positions, rotary)
    for layer in body.layers[cut:]:
        h = _llama_layer(layer, h, mask, positions, rotary)
    logits: torch.Tensor = model.lm_head(body.norm(h))  # type: ignore[operator]
    return logits


def _llama_layer(
    layer: nn.Module, h: torch.Tensor, mask: Any, positions: torch.Tensor, rotary: Any
) -> torch.Tensor:
    out = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
    return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


def _llama_prefix(model: nn.Module, depth: Depth) -> list[torch.Tensor]:
    if depth is None:
        return []
    body: Any = model.model
    cut = _cut(len(body.layers), depth)
    return [body.embed_tokens.weight, *body.layers[:cut].parameters()]


_LLAMA: Dims = {
    # hidden, intermediate, heads, kv heads, sequence, batch, vocab
    "full": (64, 172, 4, 2, 128, 8, 512),
    "quick": (32, 86, 4, 2, 32, 4, 128),
    "tiny": (16, 44, 2, 1, 8, 2, 32),
    "cuda-full": (2048, 5632, 32, 8, 2048, 4, 32000),
    "cuda-quick": (1024, 2816, 16, 4, 512, 4, 32000),
}


def llama(
    *, size: Size = "full", n: int | None = None, seed: int = 0, device: torch.device | None = None
) -> Workload:
    """``LlamaForCausalLM`` with grouped-query attention: tiny on the CPU, about 1 B parameters
    (16 layers, hidden 2048, sequence 2048 x 4) at the CUDA full size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    device = device or torch.device("cpu")
    hidden, inter, heads, kv_heads, seq, batch, vocab = dims(_LLAMA, size, device)
    n = n or (16 if device.type == "cuda" and size == "full" else 8)
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).train()
    ids, targets = on(
        device, torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    )
    return Workload(
        name="llama",
        model=model.to(device),
        batch=ids,
        targets=targets,
        blocks=[f"model.layers.{i}" for i in range(n)],
        forward=_logits_of,
        ideal_forward=_llama_ideal,
        prefix_parameters=_llama_prefix,
        depths=scaled_depths(n, quick=size != "full"),
    )
