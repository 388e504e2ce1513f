"""Which modules should learn? Full fine-tuning, head only, LISA, BAdam, Spectrum's SNR top
fraction, Importance and uniform module sampling, at equal learned-parameter budgets.

A tiny Llama is pretrained on one synthetic language (a bigram table), then fine-tuned on
another that needs the blocks, not only the head: each token repeats the one two places back
with probability 0.7, else follows a new bigram table. Its entropy is known exactly, so the
result is the *excess* loss over it on held-out sequences. Every partial method lets a quarter
of the blocks' parameters learn per step (one block of four, or modules worth as much) plus
what runs after the blocks (the final norm, the head); all use AdamW at one learning rate,
drop the optimizer state of what stops learning, and redraw every ``every`` steps.

``python -m gradgate._bench.sections.learners --seeds 5 --steps 200`` runs the full size
(minutes on a CPU) and writes ``gradgate-out/learners/learners.json`` and ``learners.png``;
``--size tiny`` runs in seconds (the docs run it).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import gradgate as gg

VOCAB = 64
COPY = 0.7  # probability that a fine-tuning token repeats the one two places back
BUDGET = 0.25
METHODS = ("full", "blocks", "head", "lisa", "badam", "snr", "importance", "uniform")
LABELS = {
    "full": "full fine-tuning (everything)",
    "blocks": "all blocks (embeddings frozen)",
    "head": "head only (no block learns)",
    "lisa": "LISA, 1 random block of 4",
    "badam": "BAdam, 1 block of 4 in turn",
    "snr": "Spectrum SNR top 25% per type (static)",
    "importance": "Importance, 25% of the modules",
    "uniform": "uniform modules (Importance, floor=1)",
}
SIZES: dict[str, dict[str, int]] = {
    "full": dict(hidden=64, inter=256, heads=4, kv=2, seq=64, batch=16, pretrain=300,
                 steps=200, eval_every=20, seeds=5),
    "tiny": dict(hidden=16, inter=32, heads=2, kv=1, seq=12, batch=4, pretrain=20,
                 steps=8, eval_every=4, seeds=1),
}  # fmt: skip


@dataclass
class Run:
    """One method at one seed: eval excess loss per evaluated step, learned share per step."""

    method: str
    seed: int
    steps: list[int] = field(default_factory=list)
    excess: list[float] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Comparison:
    """The runs of every method and seed, and how they were made."""

    size: str
    lr: float
    every: int
    floor: float
    pretrain_loss: float
    runs: list[Run]

    def methods(self) -> list[str]:
        return list(dict.fromkeys(run.method for run in self.runs))

    def final(self, method: str) -> list[float]:
        """The last evaluation's excess loss of each seed."""
        return [run.excess[-1] for run in self.runs if run.method == method]

    def share(self, method: str) -> float:
        """The mean share of the blocks' parameters that learned per step."""
        return statistics.fmean(s for r in self.runs if r.method == method for s in r.shares)

    def table(self) -> str:
        """A Markdown table: method, learned share, final excess loss (mean, sd, min, max)."""
        lines = [
            "| method | blocks' parameters learning per step | excess loss (mean ± sd) "
            "| min | max |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for method in sorted(self.methods(), key=lambda m: statistics.fmean(self.final(m))):
            final = self.final(method)
            spread = statistics.stdev(final) if len(final) > 1 else 0.0
            lines.append(
                f"| {LABELS[method]} | {self.share(method):.1%} | "
                f"{statistics.fmean(final):.4f} ± {spread:.4f} | {min(final):.4f} | "
                f"{max(final):.4f} |"
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        document = {k: v for k, v in vars(self).items() if k != "runs"}
        document["runs"] = [vars(run) for run in self.runs]
        return json.dumps(document, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Comparison:
        document = json.loads(text)
        document["runs"] = [Run(**run) for run in document["runs"]]
        return cls(**document)

    def plot(self, path: Path) -> Path:
        """Mean eval excess loss against the step, one line per method, min-max bands."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(7.5, 4.5), dpi=80)
        for method in self.methods():
            runs = [r for r in self.runs if r.method == method]
            steps = runs[0].steps
            values = np.array([r.excess for r in runs])
            axes.plot(steps, values.mean(axis=0), label=LABELS[method], linewidth=1.6)
            axes.fill_between(steps, values.min(axis=0), values.max(axis=0), alpha=0.15)
        axes.set_xlabel("fine-tuning step")
        axes.set_ylabel("held-out loss above the task's entropy (nats)")
        axes.set_yscale("log")
        seeds = len({r.seed for r in self.runs})
        axes.set_title(f"25% of the blocks' parameters learn: AdamW lr {self.lr:g}, {seeds} seeds")
        axes.legend(fontsize=8)
        axes.grid(alpha=0.3)
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path)
        plt.close(figure)
        return path


# -- the task ------------------------------------------------------------------------------------
def bigram_table(seed: int) -> np.ndarray:
    table: np.ndarray = np.random.default_rng(seed).dirichlet([0.3] * VOCAB, size=VOCAB)
    return table


def pretraining_text(count: int, length: int) -> torch.Tensor:
    """Sequences of a bigram language (table seed 0)."""
    table, rng = bigram_table(0), np.random.default_rng(1)
    tokens = np.zeros((count, length), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, VOCAB, count)
    for t in range(1, length):
        tokens[:, t] = _sample_rows(table[tokens[:, t - 1]], rng)
    return torch.from_numpy(tokens)


def finetuning_text(count: int, length: int, seed: int) -> tuple[torch.Tensor, float]:
    """Sequences of the fine-tuning language, and their mean true loss per predicted token."""
    table, rng = bigram_table(7), np.random.default_rng(seed)
    tokens = np.zeros((count, length), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, VOCAB, count)
    nll = np.zeros((count, length - 1))
    for t in range(1, length):
        bigram = table[tokens[:, t - 1]]
        drawn = _sample_rows(bigram, rng)
        if t >= 2:
            copied = rng.random(count) < COPY
            drawn = np.where(copied, tokens[:, t - 2], drawn)
        tokens[:, t] = drawn
        p = bigram[np.arange(count), drawn]
        if t >= 2:
            p = (1 - COPY) * p + COPY * (drawn == tokens[:, t - 2])
        nll[:, t - 1] = -np.log(p)
    return torch.from_numpy(tokens), float(nll.mean())


def _sample_rows(probabilities: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    cumulative = probabilities.cumsum(axis=1)
    points = rng.random(len(probabilities))[:, None] * cumulative[:, -1:]
    drawn: np.ndarray = np.minimum((cumulative < points).sum(axis=1), VOCAB - 1)
    return drawn


def tiny_llama(size: dict[str, int]) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=size["hidden"],
        intermediate_size=size["inter"],
        num_hidden_layers=4,
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv"],
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def pretrain(size: dict[str, int]) -> tuple[nn.Module, float]:
    model = tiny_llama(size)
    text = pretraining_text(4096, size["seq"] + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    loss = torch.tensor(math.nan)
    for _ in range(size["pretrain"]):
        batch = text[torch.randint(0, len(text), (size["batch"],), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, loss.item()


# -- the methods ---------------------------------------------------------------------------------
def schedule_of(
    method: str, model: nn.Module, seed: int, every: int, floor: float
) -> gg.schedules.Schedule | None:
    matrices = ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"]
    if method == "lisa":
        return gg.schedules.LISA(4, k=1, every=every, embeddings=False, seed=seed)
    if method == "badam":
        return gg.schedules.BAdam(4, switch_every=every, order="random", seed=seed)
    if method == "importance":
        return gg.schedules.Importance(matrices, BUDGET, floor=floor, seed=seed, every=every)
    if method == "uniform":
        return gg.schedules.Importance(matrices, BUDGET, floor=1.0, seed=seed, every=every)
    return None


def finetune(
    pretrained: nn.Module,
    method: str,
    seed: int,
    size: dict[str, int],
    *,
    lr: float,
    every: int,
    floor: float,
    chosen: list[str],
) -> Run:
    model = copy.deepcopy(pretrained).train()
    text, _ = finetuning_text(2048, size["seq"] + 1, seed=100 + seed)
    held_out, entropy = finetuning_text(64, size["seq"] + 1, seed=999)
    gate = gg.BackpropGate(model)
    if method in ("head", "blocks"):
        gate.depth = 0 if method == "head" else 4
    elif method == "snr":
        gate.learn = chosen
    schedule = schedule_of(method, model, seed, every, floor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    in_blocks = [p for name in gg.blocks(model) for p in model.get_submodule(name).parameters()]
    total = sum(p.numel() for p in in_blocks)
    generator = torch.Generator().manual_seed(seed)
    run = Run(method, seed)
    started = time.perf_counter()
    for step in range(size["steps"] + 1):
        if step % size["eval_every"] == 0 or step == size["steps"]:
            run.steps.append(step)
            run.excess.append(_eval_loss(model, held_out) - entropy)
        if step == size["steps"]:
            break
        if schedule is not None:
            schedule.apply(gate, step)
        batch = text[torch.randint(0, len(text), (size["batch"],), generator=generator)]
        model(input_ids=batch, labels=batch).loss.backward()
        if schedule is not None:
            schedule.observe(model)
        run.shares.append(sum(p.numel() for p in in_blocks if p.grad is not None) / total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if schedule is not None:
            _drop_resting(optimizer, gate, schedule, model, step + 1)
    run.seconds = time.perf_counter() - started
    gate.remove()
    return run


def _drop_resting(
    optimizer: torch.optim.Optimizer,
    gate: gg.BackpropGate,
    schedule: gg.schedules.Schedule,
    model: nn.Module,
    step: int,
) -> None:
    """The same rule for every schedule: what does not learn at ``step`` starts afresh."""
    gg.optim.drop_finished(optimizer, gate, schedule, step)


def _eval_loss(model: nn.Module, text: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=text, labels=text).loss)


def compare(
    size: str = "tiny",
    *,
    seeds: int | None = None,
    steps: int | None = None,
    methods: Sequence[str] = METHODS,
    lr: float = 1e-3,
    every: int = 10,
    floor: float = 0.1,
    report: Callable[[str], None] | None = None,
) -> Comparison:
    """Pretrain once, then fine-tune with each method at each seed (on one thread: the
    model is small, and threads fight over a shared machine's cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _compare(size, seeds, steps, methods, lr, every, floor, report)
    finally:
        torch.set_num_threads(threads)


def _compare(
    size: str,
    seeds: int | None,
    steps: int | None,
    methods: Sequence[str],
    lr: float,
    every: int,
    floor: float,
    report: Callable[[str], None] | None,
) -> Comparison:
    config = dict(SIZES[size])
    config["steps"] = steps if steps is not None else config["steps"]
    seeds = seeds if seeds is not None else config["seeds"]
    pretrained, pretrain_loss = pretrain(config)
    scores = gg.choose.snr(pretrained, ["model.layers"], progress=False)
    chosen = gg.choose.top(scores, BUDGET)
    runs = []
    for method in methods:
        for seed in range(seeds):
            run = finetune(pretrained, method, seed, config, lr=lr, every=every, floor=floor,
                           chosen=chosen)  # fmt: skip
            runs.append(run)
            if report is not None:
                report(f"{method} seed {seed}: excess {run.excess[-1]:.4f} ({run.seconds:.0f} s)")
    return Comparison(size, lr, every, floor, pretrain_loss, runs)


def scan_time(layers: int = 2) -> dict[str, tuple[float, float]]:
    """(CPU seconds, wall seconds) :func:`gradgate.choose.snr` takes on one thread for each
    matrix of a Llama-3.2-1B-shaped model built with ``layers`` of its 16 layers, for the whole
    scan of that model, and for 16 layers extrapolated (the tied embedding once). CPU seconds
    of one thread stand for an idle machine's wall time where other work shares the cores."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        found = {}
        for name, module in model.named_modules():
            if _timed(name) and hasattr(module, "weight"):
                found[name] = _timing(gg.choose.spectrum_score, module.weight)
        found["whole scan"] = _timing(gg.choose.snr, model, progress=False)
    finally:
        torch.set_num_threads(threads)
    layer = [v for k, v in found.items() if k.startswith("model.layers.0.")]
    embed = found["model.embed_tokens"]
    found["16 layers + embedding (extrapolated)"] = (
        16 * sum(cpu for cpu, _ in layer) + embed[0],
        16 * sum(wall for _, wall in layer) + embed[1],
    )
    return found


def _timing(function: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    function(*args, **kwargs)
    return time.process_time() - cpu, time.perf_counter() - wall


def _timed(name: str) -> bool:
    return (name.startswith("model.layers.0.") and name.endswith("_proj")) or name.endswith(
        "embed_tokens"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradgate._bench.sections.learners")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--out", type=Path, default=Path("gradgate-out/learners"))
    parser.add_argument("--scan-layers", type=int, default=None, help="time gg.choose.snr on a "
                        "Llama-3.2-1B-shaped model with this many layers instead")  # fmt: skip
    parser.add_argument("--plot", type=Path, nargs="+", default=None, help="tabulate and plot "
                        "these learners.json (runs of one setting) together into --out, "
                        "instead of running")  # fmt: skip
    args = parser.parse_args(argv)
    if args.plot is not None:
        parts = [Comparison.from_json(path.read_text()) for path in args.plot]
        merged = parts[0]
        merged.runs = [run for part in parts for run in part.runs]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "learners.json").write_text(merged.to_json())
        print(merged.table(), f"\nwrote {merged.plot(args.out / 'learners.png')}", sep="\n")
        return 0
    if args.scan_layers is not None:
        print(f"{'matrix':40} {'CPU s':>8} {'wall s':>8}")
        for name, (cpu, wall) in scan_time(args.scan_layers).items():
            print(f"{name:40} {cpu:8.2f} {wall:8.2f}")
        return 0
    result = compare(args.size, seeds=args.seeds, steps=args.steps, methods=args.methods,
                     lr=args.lr, every=args.every,
                     report=lambda line: print(line, file=sys.stderr, flush=True))  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learners.json").write_text(result.to_json())
    result.plot(args.out / "learners.png")
    print(result.table())
    print(f"\npretraining loss {result.pretrain_loss:.4f}; wrote {args.out}/learners.json, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
