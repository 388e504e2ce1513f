"""DeepSpeed ZeRO: per-rank optimizer-state bytes and bytes communicated per step, plain ZeRO
against ``gg.integrations.deepspeed.step_learners_only``.

Two gloo processes on the CPU (DeepSpeed's CPU accelerator) train the residual MLP stack of the
schedules section through ``deepspeed.initialize`` with ``torch.optim.AdamW``, at a fixed depth,
under ZeRO stages 1, 2 and 3. Counted per rank: the bytes of the AdamW state (``exp_avg``,
``exp_avg_sq``, ``step``) after the steps, and every ``torch.distributed`` collective's payload
per step (all-reduce: the tensor; reduce-scatter: its input; all-gather: its output), with the
one byte per parameter by which the ranks agree on what learned counted apart.

Run: ``python -m gradgate._bench.sections.deepspeed`` (needs ``pip install gradgate[deepspeed]``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

import gradgate as gg

from .schedules import _model

WORLD = 2
METHODS = ("ZeRO", "step_learners_only")
# where each collective's payload is: (position, keywords); all-gather counts what it gathers
_PAYLOAD: dict[str, tuple[int, tuple[str, ...]]] = {
    "all_reduce": (0, ("tensor",)),
    "reduce_scatter_tensor": (1, ("input", "input_tensor")),
    "all_gather_into_tensor": (0, ("output_tensor",)),
    "reduce_scatter": (1, ("input_list",)),
    "all_gather": (0, ("tensor_list",)),
    "broadcast": (0, ("tensor",)),
}
# DeepSpeed's torch backend keeps its own references to these two
_BACKEND = {
    "all_gather_function": "all_gather_into_tensor",
    "reduce_scatter_function": "reduce_scatter_tensor",
}


def _payload(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    position, keywords = _PAYLOAD[name]
    found = (
        args[position] if len(args) > position else next(kwargs[k] for k in keywords if k in kwargs)
    )
    return list(found) if isinstance(found, (list, tuple)) else [found]


@contextmanager
def counting_collectives() -> Iterator[list[tuple[str, torch.dtype, int]]]:
    """Record (name, dtype, bytes) of every collective DeepSpeed or gradgate calls."""
    from deepspeed.comm import comm

    calls: list[tuple[str, torch.dtype, int]] = []
    targets = [(dist, name, name) for name in _PAYLOAD]
    targets += [(comm.cdb, attribute, name) for attribute, name in _BACKEND.items()]
    originals = [(owner, attribute, getattr(owner, attribute)) for owner, attribute, _ in targets]

    def counter(name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            for tensor in _payload(name, args, kwargs):
                calls.append((name, tensor.dtype, tensor.numel() * tensor.element_size()))
            return original(*args, **kwargs)

        return counted

    for (owner, attribute, name), (_, _, original) in zip(targets, originals, strict=True):
        setattr(owner, attribute, counter(name, original))
    try:
        yield calls
    finally:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)


def measure(
    *,
    blocks: int = 8,
    width: int = 128,
    steps: int = 3,
    depths: Sequence[int | None] = (1, 2, 4, None),
    stages: Sequence[int] = (1, 2, 3),
) -> dict[str, Any]:
    """Spawn two gloo processes; one row per stage and depth."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    settings = {"blocks": blocks, "width": width, "steps": steps, "depths": list(depths)}
    settings["stages"] = list(stages)
    with tempfile.TemporaryDirectory() as out:
        spawn(_rank, args=(port, out, settings), nprocs=WORLD, join=True)
        found = json.loads((Path(out) / "rows.json").read_text())
    return {
        "world_size": WORLD,
        "backend": "gloo",
        **settings,
        "rows": found["fixed"],
        "lisa_rows": found["lisa"],
    }


def _rank(rank: int, port: int, out: str, settings: dict[str, Any]) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed collectives
    # the plain-ZeRO method leaves step_learners_only out on purpose (the baseline it measures)
    warnings.filterwarnings("ignore", "DeepSpeed ZeRO stage", gg.GradgateWarning)
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {}  # no probing, no CPU shm all-reduce build
    deepspeed.utils.logger.setLevel(logging.WARNING)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        rows = [
            _row(rank, stage, depth, settings)
            for stage in settings["stages"]
            for depth in settings["depths"]
        ]
        rotating = [_rotating_row(rank, stage, settings) for stage in settings["stages"]]
        if rank == 0:
            (Path(out) / "rows.json").write_text(json.dumps({"fixed": rows, "lisa": rotating}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _row(rank: int, stage: int, depth: int | None, settings: dict[str, Any]) -> dict[str, Any]:
    import deepspeed

    from ...integrations.deepspeed import step_learners_only

    blocks, steps = settings["blocks"], settings["steps"]
    config = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": stage}}
    row: dict[str, Any] = {"stage": stage, "depth": depth}
    for method in METHODS:
        torch.manual_seed(0)
        model = _model(blocks, settings["width"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        handle = step_learners_only(engine) if method != "ZeRO" else None
        gate = gg.BackpropGate(engine.module, [str(i) for i in range(1, blocks + 1)], depth=depth)
        sent = agreed = 0
        for step in range(steps):
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            with counting_collectives() as calls:
                engine.backward(engine(x).pow(2).mean())
                engine.step()
            sent += sum(size for _, dtype, size in calls if dtype != torch.uint8)
            agreed += sum(size for _, dtype, size in calls if dtype == torch.uint8)
        base = engine.optimizer.optimizer
        state = [base.state[key] for key in list(base.state)]
        state_bytes = sum(
            value.numel() * value.element_size()
            for entry in state
            for value in entry.values()
            if torch.is_tensor(value)
        )
        most, total = torch.tensor([state_bytes]), torch.tensor([state_bytes])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        dist.all_reduce(total)
        row[f"{method}_state_bytes"] = int(most)
        row[f"{method}_state_bytes_all_ranks"] = int(total)
        row[f"{method}_bytes"] = sent // steps
        row[f"{method}_agreement_bytes"] = agreed // steps
        gate.remove()
        if handle is not None:
            handle.remove()
    row["state_ratio"] = row["step_learners_only_state_bytes"] / row["ZeRO_state_bytes"]
    row["state_ratio_all_ranks"] = (
        row["step_learners_only_state_bytes_all_ranks"] / row["ZeRO_state_bytes_all_ranks"]
    )
    return row


def _state_bytes(engine: Any) -> int:
    """AdamW state bytes summed over the ranks."""
    base = engine.optimizer.optimizer
    found = sum(
        value.numel() * value.element_size()
        for entry in list(base.state.values())
        for value in entry.values()
        if torch.is_tensor(value)
    )
    total = torch.tensor([found])
    dist.all_reduce(total)
    return int(total)


def _rotating_row(rank: int, stage: int, settings: dict[str, Any]) -> dict[str, Any]:
    """LISA with one block a step: state bytes after the steps, kept or dropped on switch."""
    import deepspeed

    from ...integrations.deepspeed import step_learners_only

    blocks, steps = settings["blocks"], 2 * settings["blocks"]
    schedule = gg.schedules.LISA(blocks, k=1, every=1, seed=0)
    config = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": stage}}
    row: dict[str, Any] = {"stage": stage, "steps": steps}
    for method, keep in (("ZeRO", None), ("keep_state", True), ("learners_state", False)):
        torch.manual_seed(0)
        model = _model(blocks, settings["width"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        handle = None if keep is None else step_learners_only(engine, keep_state=keep)
        gate = gg.BackpropGate(engine.module, [str(i) for i in range(1, blocks + 1)])
        for step in range(steps):
            schedule.apply(gate, step)
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        row[f"{method}_state_bytes"] = _state_bytes(engine)
        gate.remove()
        if handle is not None:
            handle.remove()
    return row


def table(section: dict[str, Any]) -> str:
    """The section as text: one line per stage and depth."""
    lines = [
        f"DeepSpeed ZeRO: AdamW state bytes on the fullest rank, bytes communicated per step "
        f"({section['world_size']} {section['backend']} ranks on the CPU, {section['blocks']} "
        f"residual MLP blocks of width {section['width']}, {section['steps']} steps per row)",
        f"{'stage':>5}  {'depth':>5}  {'ZeRO state':>10}  {'learners state':>14}  "
        f"{'ratio':>5}  {'all ranks':>9}  {'ZeRO comm':>10}  {'learners comm':>13}  "
        f"{'+ agreement':>11}",
    ]
    for row in section["rows"]:
        depth = "full" if row["depth"] is None else str(row["depth"])
        lines.append(
            f"{row['stage']:>5}  {depth:>5}  {row['ZeRO_state_bytes']:>10,}  "
            f"{row['step_learners_only_state_bytes']:>14,}  {row['state_ratio']:>5.3f}  "
            f"{row['state_ratio_all_ranks']:>9.3f}  "
            f"{row['ZeRO_bytes']:>10,}  {row['step_learners_only_bytes']:>13,}  "
            f"{row['step_learners_only_agreement_bytes']:>11,}"
        )
    if section.get("lisa_rows"):
        lines += [
            "",
            "LISA, one block learning per step (and the head after it): AdamW state "
            "bytes summed over the ranks after the steps",
            f"{'stage':>5}  {'steps':>5}  {'ZeRO':>10}  {'keep_state':>10}  "
            f"{'keep_state=False':>16}  {'ratio':>5}",
        ]
        for row in section["lisa_rows"]:
            lines.append(
                f"{row['stage']:>5}  {row['steps']:>5}  {row['ZeRO_state_bytes']:>10,}  "
                f"{row['keep_state_state_bytes']:>10,}  {row['learners_state_state_bytes']:>16,}  "
                f"{row['learners_state_state_bytes'] / row['ZeRO_state_bytes']:>5.3f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(measure()))
