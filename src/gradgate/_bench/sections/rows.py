"""Train only new tokens: ``gg.learn_rows`` against a full-embedding fine-tune and a
hand-written gradient mask, on a Llama-shaped model (random init, a 32k vocabulary).

Every method trains the embedding of the same model with everything else frozen, AdamW with
weight decay:

* **full embedding** — the whole embedding learns (what a user does without gradgate);
* **gradient mask** — the whole embedding is a learner, and a hook on its weight zeroes the
  gradient of every row but the new ones (the usual hand-written way): backward still makes
  the full gradient, AdamW keeps state for every row, and weight decay moves the other rows;
* **learn_rows** — ``gg.learn_rows(model, "model.embed_tokens", rows=new)``.

Figures, per method: the median time of a training step (forward with the loss, backward,
``optimizer.step()``, ``zero_grad``), the rounds interleaved so that the machine's drift hits
every method alike; the peak of live tensor bytes over two steps counted from before the first
forward (the model's tensors included; on CUDA ``torch.cuda.max_memory_allocated``); the
gradient and optimizer-state bytes after a step; and whether any row other than the new ones
moved. Ratios are to the full-embedding run, measured in the same process.

Run: ``python -m gradgate._bench.sections.rows`` (``--quick`` for a small vocabulary); writes
``gradgate-out/rows.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import gradgate as gg

from ..._plumbing.autograd import tensors_in
from ..._plumbing.torch_internals import TorchDispatchMode

METHODS = ("full embedding", "gradient mask", "learn_rows")
SIZES: dict[str, dict[str, int]] = {
    "full": dict(vocab=32000, hidden=256, inter=512, layers=2, rows=64, batch=2, seq=64),
    "quick": dict(vocab=4096, hidden=64, inter=128, layers=2, rows=16, batch=2, seq=32),
}  # fmt: skip


def build(size: dict[str, int]) -> nn.Module:
    """A random-init Llama-shaped causal LM of ``size`` (seed 0), in train mode, all frozen."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["inter"],
        num_hidden_layers=size["layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=size["seq"],
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    model: nn.Module = LlamaForCausalLM(config).train()
    model.requires_grad_(False)
    return model


def embedding(model: nn.Module) -> torch.Tensor:
    """The model's token-embedding weight."""
    weight = model.get_submodule("model.embed_tokens").weight
    assert isinstance(weight, torch.Tensor)
    return weight


def batch(size: dict[str, int], new: list[int]) -> dict[str, torch.Tensor]:
    """Token ids where one position in eight is a new token; labels = ids."""
    generator = torch.Generator().manual_seed(1)
    shape = (size["batch"], size["seq"])
    ids = torch.randint(0, size["vocab"] - size["rows"], shape, generator=generator)
    picks = torch.tensor(new)[torch.randint(0, len(new), shape, generator=generator)]
    ids = torch.where(torch.rand(shape, generator=generator) < 0.125, picks, ids)
    return {"input_ids": ids, "labels": ids}


Setup = Callable[[nn.Module, list[int]], torch.optim.Optimizer]


def full_embedding(model: nn.Module, new: list[int]) -> torch.optim.Optimizer:
    weight = embedding(model).requires_grad_(True)
    return torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.01)


def gradient_mask(model: nn.Module, new: list[int]) -> torch.optim.Optimizer:
    weight = embedding(model).requires_grad_(True)
    mask = torch.zeros(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)
    mask[new] = 1.0
    weight.register_hook(lambda grad: grad * mask)
    return torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.01)


def learn_rows(model: nn.Module, new: list[int]) -> torch.optim.Optimizer:
    gg.learn_rows(model, "model.embed_tokens", rows=new)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


SETUPS: dict[str, Setup] = dict(
    zip(METHODS, (full_embedding, gradient_mask, learn_rows), strict=True)
)


class _LiveBytes(TorchDispatchMode):  # type: ignore[misc]
    """The peak of live tensor bytes: every storage an op makes, until it is freed, plus the
    tensors given at the start (each storage once)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._alive: dict[int, tuple[StorageWeakRef, int]] = {}
        for tensor in tensors:
            self._note(tensor)
        self.peak = self._live()

    def _note(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr() or id(storage)
        if key not in self._alive or self._alive[key][0].expired():
            self._alive[key] = (StorageWeakRef(storage), storage.nbytes())

    def _live(self) -> int:
        self._alive = {k: v for k, v in self._alive.items() if not v[0].expired()}
        return sum(nbytes for _, nbytes in self._alive.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tensors_in(out):
            self._note(tensor)
        self.peak = max(self.peak, self._live())
        return out


def step(
    model: nn.Module, opt: torch.optim.Optimizer, inputs: dict[str, torch.Tensor], micro: int
) -> None:
    """One optimizer step over ``micro`` micro-batches (gradient accumulation)."""
    for _ in range(micro):
        model(**inputs).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(size: dict[str, int], *, rounds: int, device: str, micro: int) -> dict[str, Any]:
    """Every method's figures, the timing rounds interleaved."""
    base = build(size).to(device)
    new = list(range(size["vocab"] - size["rows"], size["vocab"]))
    inputs = {k: v.to(device) for k, v in batch(size, new).items()}
    start = embedding(base).detach().clone()
    others = torch.ones(size["vocab"], dtype=torch.bool, device=device)
    others[new] = False
    figures: dict[str, dict[str, Any]] = {}
    runs = {}
    for method in METHODS:
        model = copy.deepcopy(base)
        opt = SETUPS[method](model, new)
        figures[method] = {"peak_bytes": _peak(model, opt, inputs, device, micro)}
        step(model, opt, inputs, micro)
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        weight = embedding(model)
        figures[method].update(
            optimizer_bytes=sum(t.nbytes for t in state),
            others_moved=not torch.equal(weight[others], start[others]),
        )
        runs[method] = (model, opt)
    times: dict[str, list[tuple[float, float]]] = {method: [] for method in METHODS}
    for _ in range(rounds):
        for method in METHODS:
            model, opt = runs[method]
            if device != "cpu":
                torch.cuda.synchronize()
            begin, cpu = time.perf_counter(), time.process_time()
            step(model, opt, inputs, micro)
            if device != "cpu":
                torch.cuda.synchronize()
            times[method].append((time.perf_counter() - begin, time.process_time() - cpu))
    for method in METHODS:
        figures[method]["step_seconds"] = statistics.median(t for t, _ in times[method])
        figures[method]["step_cpu_seconds"] = statistics.median(c for _, c in times[method])
    full = figures["full embedding"]
    for values in figures.values():
        values["time_ratio"] = values["step_seconds"] / full["step_seconds"]
        values["cpu_ratio"] = values["step_cpu_seconds"] / full["step_cpu_seconds"]
        values["bytes_below_full"] = full["peak_bytes"] - values["peak_bytes"]
    return {"size": size, "micro": micro, "rounds": rounds, "device": device, "figures": figures}


def _peak(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    inputs: dict[str, torch.Tensor],
    device: str,
    micro: int,
) -> int:
    """The peak of live tensor bytes over two steps, from before the first forward."""
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            step(model, opt, inputs, micro)
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    with _LiveBytes([*model.parameters(), *model.buffers(), *inputs.values()]) as counter:
        for _ in range(2):
            step(model, opt, inputs, micro)
    return int(counter.peak)


def table(result: dict[str, Any]) -> str:
    size = result["size"]
    target = 2 * 4 * size["vocab"] * size["hidden"]
    lines = [
        "| method | step time (median) | vs full | CPU time vs full | peak live bytes | "
        "below full | optimizer state | other rows moved |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method, f in result["figures"].items():
        lines.append(
            f"| {method} | {f['step_seconds'] * 1e3:.1f} ms | {f['time_ratio']:.2f} | "
            f"{f['cpu_ratio']:.2f} | "
            f"{f['peak_bytes'] / 2**20:.1f} MiB | {f['bytes_below_full'] / 2**20:.1f} MiB | "
            f"{f['optimizer_bytes'] / 2**20:.2f} MiB | {'yes' if f['others_moved'] else 'no'} |"
        )
    below = result["figures"]["learn_rows"]["bytes_below_full"]
    lines.append("")
    lines.append(
        f"learn_rows peaks {below:,} B below the full-embedding run: {below / target:.4f} x "
        f"the target 2 x 4 B x vocab x hidden = {target:,} B"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradgate._bench.sections.rows")
    parser.add_argument("--quick", action="store_true", help="a 4k vocabulary, seconds")
    parser.add_argument("--rounds", type=int, default=15, help="timed steps per method")
    parser.add_argument(
        "--micro", type=int, nargs="+", default=[1, 2], help="micro-batches per step, each run"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--batch", type=int, default=None, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--out", default="gradgate-out/rows.json")
    options = parser.parse_args(argv)
    size = dict(SIZES["quick" if options.quick else "full"])
    size.update({k: getattr(options, k) for k in ("batch", "seq") if getattr(options, k)})
    if options.threads:
        torch.set_num_threads(options.threads)
    command = "python -m gradgate._bench.sections.rows " + " ".join(argv or sys.argv[1:])
    results = []
    print(
        f"{size} on {options.device}, torch {torch.__version__}, {options.rounds} rounds, "
        f"{torch.get_num_threads()} threads"
    )
    for micro in options.micro:
        result = measure(size, rounds=options.rounds, device=options.device, micro=micro)
        results.append({**result, "command": command, "torch": torch.__version__})
        print(f"\n{micro} micro-batch(es) per optimizer step:")
        print(table(result))
    path = Path(options.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
