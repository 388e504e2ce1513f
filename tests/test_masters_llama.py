"""LearnerMasters + BAdam on a tiny bf16 HF Llama: bit for bit the hand-written update."""

from __future__ import annotations

import pytest
import torch
from test_masters import OPTS, same

import gradgate as gg

transformers = pytest.importorskip("transformers")
LAYERS, K = 3, 2


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def tokens(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 64, (2, 12), generator=g) for _ in range(steps)]


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def hand_written(order: str, steps: int) -> torch.nn.Module:
    """Only the active layer (and what runs after the layers: the final norm, lm_head) requires
    grad; a new fp32 copy of the layer and a new AdamW at each switch; the others persist."""
    model = tiny_llama()
    sched = gg.schedules.BAdam(LAYERS, K, order=order, seed=1)
    after = [*model.model.norm.parameters(), *model.lm_head.parameters()]
    after32 = [(p, p.detach().float().clone()) for p in after]
    after_opt = torch.optim.AdamW([m for _, m in after32], **OPTS)
    pairs: list = []
    opt = after_opt
    for t, ids in enumerate(tokens(steps)):
        if t % K == 0:
            layer = model.model.layers[sched.active(t)]
            pairs = [(p, p.detach().float().clone()) for p in layer.parameters()]
            opt = torch.optim.AdamW([m for _, m in pairs], **OPTS)
        model.requires_grad_(False)
        for p, _ in pairs + after32:
            p.requires_grad_(True)
        loss_of(model, ids).backward()
        for p, m in pairs + after32:
            m.grad = p.grad.float()
        opt.step()
        after_opt.step()
        with torch.no_grad():
            for p, m in pairs + after32:
                p.copy_(m.to(torch.bfloat16))
        model.zero_grad()
    return model


@pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")
@pytest.mark.parametrize("order", ["random", "descending"])
def test_tiny_llama_badam_is_the_hand_written_update_bit_for_bit(order: str) -> None:
    steps = 2 * LAYERS * K  # two cycles
    model = tiny_llama()
    gate = gg.BackpropGate(model)
    sched = gg.schedules.BAdam(LAYERS, K, order=order, seed=1)
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    history = []
    for t, ids in enumerate(tokens(steps)):
        sched.apply(gate, t)
        loss_of(model, ids).backward()
        resting = {n: p.detach().clone() for n, p in model.named_parameters() if p.grad is None}
        opt.step()
        opt.zero_grad()
        gg.optim.drop_finished(opt, gate, sched, t + 1)
        for name, p in model.named_parameters():
            assert name not in resting or same(resting[name], p), f"step {t}: {name} moved"
        history.append(opt.master_bytes())
    gate.remove()
    reference = hand_written(order, steps)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert same(p, q), name
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    after = sum(p.numel() for p in [*model.model.norm.parameters(), *model.lm_head.parameters()])
    # within a window: one layer and what runs after it; at a switch, only what runs after
    assert history[0] == 12 * (layer + after) + 4 * (9 + 2)
    assert history[1] == 12 * after + 4 * 2
    assert set(history) == {history[0], history[1]}
