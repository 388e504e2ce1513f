"""DropBP on a tiny GPT-2: random blocks skip their backward, the gradient goes around them.

A skipped block still runs its forward (the loss is the model's), but records no graph: the
gradient passes to the block below through the residual connection only. The gradients equal
the hand-written DropBP reference, ``h + block(h).detach() - h.detach()`` per skipped block.
"""

import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import gradgate as gg


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=128,
        n_positions=64,
        n_embd=32,
        n_layer=6,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def reference_grads(model, tokens, skip):
    """DropBP by hand on a copy: each skipped block's output, detached, plus identity."""
    ref = copy.deepcopy(model)
    hooks = []
    for i in skip:

        def around(module, args, output):
            h = args[0]
            out = output[0] if isinstance(output, tuple) else output
            through = out.detach() + (h - h.detach())
            return (through, *output[1:]) if isinstance(output, tuple) else through

        hooks.append(ref.transformer.h[i].register_forward_hook(around))
    loss = ref(input_ids=tokens, labels=tokens).loss
    names = [n for n, _ in ref.named_parameters()]
    grads = torch.autograd.grad(loss, list(ref.parameters()), allow_unused=True)
    return dict(zip(names, grads, strict=True))


def main() -> None:
    model = tiny_gpt2()
    n = len(gg.blocks(model))
    schedule = gg.schedules.DropBP(n, 0.5, seed=0)
    gate = gg.BackpropGate(model)
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))

    exact, skipped = True, []
    for step in range(4):
        plan = schedule.apply(gate, step)
        skipped.append(sorted(plan.skip))
        model(input_ids=tokens, labels=tokens).loss.backward()
        expected = reference_grads(model, tokens, plan.skip)
        for name, param in model.named_parameters():
            want = expected[name]
            if want is None:
                exact &= param.grad is None
            else:
                exact &= param.grad is not None and torch.allclose(param.grad, want, atol=1e-6)
        model.zero_grad(set_to_none=True)
    print(f"blocks skipped per step: {skipped}")
    print(f"gradients equal the hand-written DropBP reference: {exact}")

    # What a step with half the blocks skipped costs, against full backprop.
    def audit():
        with gg.audit(model) as report:
            model(input_ids=tokens, labels=tokens).loss.backward()
        model.zero_grad(set_to_none=True)
        return report.totals

    gate.skip = {0, 2, 4}
    dropped = audit()
    gate.skip = None
    full = audit()
    flops = dropped["backward_flops"] / full["backward_flops"]
    saved = dropped["saved_bytes"] / full["saved_bytes"]
    print(
        f"3 of 6 blocks skipped: backward FLOPs {flops:.0%}, saved activations {saved:.0%} of full"
    )
    gate.remove()


if __name__ == "__main__":
    main()
