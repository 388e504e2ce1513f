"""LISA on a tiny Llama: embeddings and head always learn, one random middle layer every 2 steps.

The layers that were not drawn pass gradients through (the embeddings below them learn) but
get no weight gradient, no AdamW step and no optimizer state. The plan is a pure function of
(seed, step): every rank draws the same layers with no communication.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import gradgate as gg


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def layer_weights(model: LlamaForCausalLM) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in layer.parameters()] for layer in model.model.layers]


def main() -> None:
    model = tiny_llama()
    n = len(gg.blocks(model))
    schedule = gg.schedules.LISA(n, k=1, every=2, seed=0)  # embeddings, norm, head: always
    gate = gg.BackpropGate(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))

    untouched_ok, drawn, stateful = True, [], []

    def has_state(layer: torch.nn.Module) -> bool:
        return any(p in optimizer.state for p in layer.parameters())

    for step in range(6):
        plan = schedule.apply(gate, step)
        learning = plan.learning(n)
        drawn.append(sorted(learning))
        before = layer_weights(model)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gg.optim.drop_finished(optimizer, gate, schedule, step + 1)  # undrawn layers: no state
        stateful.append([i for i, layer in enumerate(model.model.layers) if has_state(layer)])
        after = layer_weights(model)
        for i in range(n):
            same = all(torch.equal(a, b) for a, b in zip(after[i], before[i], strict=True))
            untouched_ok &= same != (i in learning)
    print(f"layers drawn per step: {drawn}")
    print(f"only the drawn layers moved, the others bit-identical: {untouched_ok}")
    print(f"layers with AdamW state after each step: {stateful}")
    print(f"embeddings learn: {model.model.embed_tokens.weight in optimizer.state}")

    # What one LISA step computes, against full backprop (gg.audit counts it).
    def audit(plan_learn):
        gate.learn = plan_learn
        with gg.audit(model) as report:
            model(input_ids=tokens, labels=tokens).loss.backward()
        model.zero_grad(set_to_none=True)
        return report.totals

    lisa = audit(schedule.plan(0).learn)
    gate.learn = None
    full = audit(None)
    share = lisa["backward_flops"] / full["backward_flops"]
    print(f"backward FLOPs of a LISA step vs full backprop: {share:.0%}")
    print(f"weight gradients computed: {lisa['wgrad']} of {full['wgrad']}")
    gate.remove()


if __name__ == "__main__":
    main()
