"""DeepSpeed ZeRO 1, 2 and 3 with bf16 weights: the fp32 bytes each rank's optimizer holds at
a step, plain ZeRO against ``gg.optim.LearnerMasters``, next to the learners' share.

Two gloo processes on the CPU (DeepSpeed's CPU accelerator) train the residual MLP stack of the
schedules section in bf16 through ``deepspeed.initialize`` under three plans (depth 1, LISA
with two blocks, BAdam with one block; the plan changes at every step) and three set-ups:

* ``ZeRO``: ``"bf16": {"enabled": true}`` and ``torch.optim.AdamW``: ZeRO's fp32 master
  partition of every parameter and AdamW's state for all of it;
* ``AdamW, learners' state``: the same with ``step_learners_only(engine, keep_state=False)``:
  ZeRO's masters of every parameter, AdamW state only for the current learners;
* ``LearnerMasters``: DeepSpeed's ``bf16_master_weights_and_grads`` and
  ``bf16_optimizer_states`` and ``LearnerMasters(torch.optim.AdamW)`` with
  ``step_learners_only``: masters and state only for the learners.

Counted per rank after the last step: the bytes of every fp32 tensor the optimizer keeps
(ZeRO's flat fp32 partitions, the optimizer's state: masters, moments, step counts), each
storage once. "share" is 12 bytes times the last step's learners' elements over the ranks.

Run: ``python -m gradgate._bench.sections.zero_masters`` (needs ``pip install
gradgate[deepspeed]``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

import gradgate as gg

from .schedules import _model

WORLD = 2
METHODS = ("ZeRO", "AdamW, learners' state", "LearnerMasters")
PLANS = ("depth 1", "LISA k=2", "BAdam")
_KNOBS = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def measure(*, blocks: int = 8, width: int = 128, steps: int = 3) -> dict[str, Any]:
    """Spawn two gloo processes; one row per stage, plan and rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    settings = {"blocks": blocks, "width": width, "steps": steps}
    with tempfile.TemporaryDirectory() as out:
        spawn(_rank, args=(port, out, settings), nprocs=WORLD, join=True)
        found = json.loads((Path(out) / "rows.json").read_text())
    return {"world_size": WORLD, "backend": "gloo", **settings, **found}


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
    warnings.filterwarnings("ignore", "DeepSpeed ZeRO stage", gg.GradgateWarning)  # the baseline
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {}  # no probing, no CPU shm all-reduce build
    deepspeed.utils.logger.setLevel(logging.WARNING)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        rows: list[dict[str, Any]] = []
        for stage in (1, 2, 3):
            for plan in PLANS:
                found = {method: _bytes(rank, stage, plan, method, settings) for method in METHODS}
                share = found["LearnerMasters"][1]
                gathered: list[Any] = [None] * WORLD
                dist.all_gather_object(gathered, {m: b for m, (b, _) in found.items()})
                if rank == 0:
                    for held_by, held in enumerate(gathered):
                        rows.append(
                            {"stage": stage, "plan": plan, "rank": held_by, **held, "share": share}
                        )
        if rank == 0:
            result = {"rows": rows, "beside": settings.get("beside", {})}
            (Path(out) / "rows.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _plan(plan: str, blocks: int, step: int) -> gg.schedules.Plan:
    if plan == "depth 1":
        return gg.schedules.Plan(depth=1)
    if plan == "LISA k=2":
        return gg.schedules.LISA(blocks, k=2, every=1, seed=0).plan(step)
    return gg.schedules.BAdam(blocks, 1, order="descending").plan(step)


def _bytes(
    rank: int, stage: int, plan: str, method: str, settings: dict[str, Any]
) -> tuple[int, int]:
    """(this rank's fp32 optimizer bytes, the learners' share) after the steps."""
    import deepspeed

    from ...integrations.deepspeed import step_learners_only

    blocks = settings["blocks"]
    torch.manual_seed(0)
    model = _model(blocks, settings["width"]).bfloat16()
    options: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.1}
    if method == "LearnerMasters":
        optimizer: Any = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **options)
        bf16: dict[str, Any] = {"enabled": True, **_KNOBS}
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **options)
        bf16 = {"enabled": True}
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": bf16,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    handle = None if method == "ZeRO" else step_learners_only(engine, keep_state=False)
    gate = gg.BackpropGate(engine.module, [str(i) for i in range(1, blocks + 1)])
    for step in range(settings["steps"]):
        _plan(plan, blocks, step).apply(gate)
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        engine.backward(engine(x.bfloat16()).float().pow(2).mean())
        if method == "LearnerMasters" and rank == 0:
            _beside(engine.optimizer, stage, settings)  # the gradients live until the step
        engine.step()
    outer = engine.optimizer
    flats = (
        outer.fp32_partitioned_groups_flat if stage == 3 else outer.single_partition_of_fp32_groups
    )
    tensors = [*flats, *(v for entry in outer.optimizer.state.values() for v in entry.values())]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32
    }
    share = 0
    if handle is not None:
        learners = [handle.params[i] for i in handle.stepped]
        share = 12 * sum(int(getattr(p, "ds_numel", p.numel())) for p in learners) // WORLD
        handle.remove()
    gate.remove()
    return sum(storages.values()), share


def _beside(outer: Any, stage: int, settings: dict[str, Any]) -> None:
    """ZeRO's own bf16 bytes per rank beside the weights before a step, in the LearnerMasters
    set-up: its copy of the partition (shared with the partition at stage 3) and, at stage 3,
    its gradient partitions (stages 1 and 2 keep their gradients in buffers that change
    between DeepSpeed releases: not counted)."""
    if stage == 3:
        flats, own = outer.fp32_partitioned_groups_flat, outer.fp16_partitioned_groups_flat
        grads = outer.grad_partitions_flat_buffer.untyped_storage().nbytes()
    else:
        flats, own, grads = outer.single_partition_of_fp32_groups, [], None
    shared = {p.untyped_storage().data_ptr() for p in own}
    copy = sum(f.untyped_storage().nbytes() for f in flats
               if f.untyped_storage().data_ptr() not in shared)  # fmt: skip
    settings.setdefault("beside", {})[str(stage)] = {"copy": copy, "gradients": grads}


def table(section: dict[str, Any]) -> str:
    """The section as text: one line per stage, plan and rank."""
    lines = [
        f"DeepSpeed ZeRO, bf16 weights: fp32 bytes the optimizer holds on each rank after a step "
        f"({section['world_size']} {section['backend']} ranks on the CPU, {section['blocks']} "
        f"residual MLP blocks of width {section['width']}, {section['steps']} steps, the plan "
        "changing at each)",
        f"{'stage':>5}  {'plan':<8}  {'rank':>4}  {'ZeRO':>10}  {'AdamW, learners state':>21}  "
        f"{'LearnerMasters':>14}  {'share':>9}",
    ]
    for row in section["rows"]:
        lines.append(
            f"{row['stage']:>5}  {row['plan']:<8}  {row['rank']:>4}  {row['ZeRO']:>10,}  "
            f"{row[METHODS[1]]:>21,}  {row['LearnerMasters']:>14,}  {row['share']:>9,}"
        )
    if section.get("beside"):
        lines += [
            "",
            "ZeRO's own bf16 bytes beside the weights on rank 0 before the last step "
            "(LearnerMasters set-up, BAdam)",
            f"{'stage':>5}  {'copy of its partition':>21}  {'gradient partitions':>19}",
        ]
        for stage, found in section["beside"].items():
            grads = "-" if found["gradients"] is None else f"{found['gradients']:,}"
            lines.append(f"{stage:>5}  {found['copy']:>21,}  {grads:>19}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(measure()))
