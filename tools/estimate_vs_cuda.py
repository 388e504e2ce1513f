"""``gg.estimate`` against a real CUDA step: predicted peak and ``torch.cuda.max_memory_allocated``.

A Llama of about 0.5 B parameters in bf16 (transformers config, random weights), AdamW, the loss
from ``labels=``. Per depth: the plan's peak (params + grads + optimizer + saved) and the peak a
real training step allocates (the second step, so that the optimizer state exists; measured
from zero, so the parameters count as in the plan)::

    PYTHONPATH=src python tools/estimate_vs_cuda.py            # needs a CUDA device
    PYTHONPATH=src python tools/estimate_vs_cuda.py --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch

import gradgate as gg

MiB = 2**20


def llama(layers: int, hidden: int, seq: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        vocab_size=vocab,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def measured_peak(model: torch.nn.Module, ids: torch.Tensor, depth: int) -> int:
    """The allocator's peak over the second of two AdamW steps at ``depth``, from zero."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    peak = 0
    with gg.backprop_depth(model, depth):
        for _ in range(2):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--json", help="write the rows here")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("estimate_vs_cuda: needs a CUDA device")
    with torch.device("meta"):
        meta = llama(options.layers, options.hidden, options.seq, options.vocab)
    ids = torch.randint(0, options.vocab, (options.batch, options.seq))
    depths = sorted({0, 1, 2, options.layers // 2, options.layers})
    plan = gg.estimate(meta, input_ids=ids, labels=ids, depths=depths, use_cache=False)
    model = llama(options.layers, options.hidden, options.seq, options.vocab).cuda()
    ids = ids.cuda()
    rows = []
    print(f"{'depth':>5} {'predicted MiB':>14} {'measured MiB':>13} {'measured / predicted':>21}")
    for depth in depths:
        predicted, measured = plan[depth].peak_bytes, measured_peak(model, ids, depth)
        rows.append({"depth": depth, "predicted": predicted, "measured": measured})
        print(
            f"{depth:>5} {predicted / MiB:>14.1f} {measured / MiB:>13.1f} "
            f"{measured / predicted:>21.3f}"
        )
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if options.json:
        with open(options.json, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
