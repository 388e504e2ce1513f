"""``gg.estimate`` against real training steps: the plan's peak and the measured one, per depth.

Two models, each planned on the ``meta`` device and then run for real, two training steps per
depth (the first makes the optimizer's state; AdamW as torch picks it on the device, the loss
from the labels, the output dropped before backward, ``zero_grad(set_to_none=True)``):

* ``gpt``: a plain GPT-like model the project never saw (pre-norm blocks, causal SDPA, GELU
  MLP, untied head), 12 blocks of width 1024, vocabulary 16384, batch 8 x 512, float32, at
  every depth;
* ``llama8b``: the Llama-3-8B shape in bfloat16, batch 1 x 2048, at depths 0 to 4.

On CUDA the measured peak is ``torch.cuda.max_memory_allocated()`` over the two steps, from
zero (parameters and inputs count, as in the plan); ``max_memory_reserved()`` is shown beside
it (the allocator's fragmentation), so the default headroom of ``plan.fits`` can be checked.
With ``--device cpu`` the steps run on the CPU, measured by following storages
(``tests/live_bytes.py``), on small shapes (``--small``)::

    PYTHONPATH=src python tools/estimate_vs_cuda.py                     # needs a CUDA device
    PYTHONPATH=src python tools/estimate_vs_cuda.py --models gpt --json out.json
    PYTHONPATH=src python tools/estimate_vs_cuda.py --device cpu --small
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import gradgate as gg

MiB = 2**20
SHAPES = {  # model -> full size, --small size
    "gpt": ({"layers": 12, "width": 1024, "vocab": 16384, "batch": 8, "seq": 512},
            {"layers": 4, "width": 128, "vocab": 2048, "batch": 4, "seq": 128}),
    "llama8b": ({"layers": 32, "width": 4096, "vocab": 128256, "batch": 1, "seq": 2048},
                {"layers": 4, "width": 256, "vocab": 4096, "batch": 1, "seq": 256}),
}  # fmt: skip


class Block(nn.Module):
    """Pre-norm causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = max(1, width // 64)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).unbind(2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.out(attended.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token and position embeddings, blocks, a final norm, an untied head; returns the loss."""

    def __init__(self, layers: int, width: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(name: str, shape: dict[str, int], device: str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        if name == "gpt":
            return GPT(shape["layers"], shape["width"], shape["vocab"], shape["seq"])
        from transformers import LlamaConfig, LlamaForCausalLM

        width = shape["width"]
        config = LlamaConfig(
            hidden_size=width, intermediate_size=width * 7 // 2, num_hidden_layers=shape["layers"],
            num_attention_heads=width // 128, num_key_value_heads=max(1, width // 512),
            vocab_size=shape["vocab"], max_position_embeddings=max(8192, shape["seq"]),
            rope_theta=500000.0, tie_word_embeddings=False, use_cache=False,
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # made in bf16: no float32 copy of 8B on the GPU
        try:
            return LlamaForCausalLM(config).to(torch.bfloat16)
        finally:
            torch.set_default_dtype(previous)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    return out if isinstance(out, torch.Tensor) else out.loss


def measured_cuda(model: nn.Module, ids: torch.Tensor, depth: int) -> dict[str, int]:
    """Allocated and reserved peaks over two steps at ``depth`` (AdamW, foreach: CUDA's
    default), from zero."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with gg.backprop_depth(model, depth):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        for _ in range(2):
            loss_of(model, ids).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    found = {
        "measured": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.max_memory_reserved(),
    }
    del optimizer
    gc.collect()
    return found


def measured_cpu(model: nn.Module, ids: torch.Tensor, depth: int) -> dict[str, int]:
    """The live bytes of two steps at ``depth`` (AdamW's CPU default), following storages."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from live_bytes import LiveBytes

    with gg.backprop_depth(model, depth):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        with LiveBytes(model, ids) as counter:
            for _ in range(2):
                loss_of(model, ids).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return {"measured": counter.peak}


def compare(name: str, shape: dict[str, int], depths: list[int] | None, device: str) -> list[Any]:
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]))
    meta = build(name, shape, "meta")
    dtype = torch.bfloat16 if name == "llama8b" else torch.float32
    depths = depths if depths is not None else list(range(shape["layers"] + 1))
    started = time.perf_counter()
    plan = gg.estimate(meta, input_ids=ids, labels=ids, depths=depths, dtype=dtype, device=device)
    seconds = time.perf_counter() - started
    model = build(name, shape, device)
    ids = ids.to(device)
    measure: Callable[..., dict[str, int]] = measured_cuda if device == "cuda" else measured_cpu
    print(f"\n{name} {shape} {str(dtype).removeprefix('torch.')}, planned in {seconds:.1f} s")
    print(f"{'depth':>5} {'plan MiB':>10} {'phase':>8} {'measured MiB':>13} {'measured/plan':>14}"
          f" {'reserved MiB':>13} {'fits?':>6}")  # fmt: skip
    rows = []
    for depth in depths:
        row, found = plan[depth], measure(model, ids, depth)
        ok = row.peak_bytes + plan.headroom_for(row) >= found.get("reserved", found["measured"])
        rows.append({"model": name, "depth": depth, "plan": row.peak_bytes,
                     "phase": row.peak_phase, **found, "headroom_ok": ok})  # fmt: skip
        reserved = found.get("reserved")
        print(
            f"{depth:>5} {row.peak_bytes / MiB:>10.1f} {row.peak_phase:>8} "
            f"{found['measured'] / MiB:>13.1f} {found['measured'] / row.peak_bytes:>14.3f} "
            f"{'-' if reserved is None else f'{reserved / MiB:.1f}':>13} {'yes' if ok else 'NO':>6}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["gpt", "llama8b"])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="small shapes (for the CPU)")
    parser.add_argument("--json", help="write the rows here")
    options = parser.parse_args()
    if options.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("estimate_vs_cuda: needs a CUDA device (or --device cpu --small)")
    rows = []
    for name in options.models:
        shape = SHAPES[name][1 if options.small else 0]
        depths = [0, 1, 2, 3, 4] if name == "llama8b" else None
        rows += compare(name, shape, depths, options.device)
    where = torch.cuda.get_device_name() if options.device == "cuda" else "CPU"
    print(f"\n{where}, torch {torch.__version__}")
    if options.json:
        Path(options.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
