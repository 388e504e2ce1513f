"""DeepSpeed ZeRO refuses LearnerMasters, with the reason and what works instead.

ZeRO keeps its own fp32 master of every parameter and writes its flat fp32 partitions into the
client optimizer's groups, so LearnerMasters would never see the model's bf16 weights. One
spawned gloo process builds the engines (deepspeed needs a process group).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gradgate as gg

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
    ),
]
REFUSAL = r"LearnerMasters under DeepSpeed.*fp32 master.*step_learners_only\(engine, keep_state"


def engine(stage: int, **config):
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), lr=1e-2)
    settings = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        **config,
    }
    return deepspeed.initialize(model=model, optimizer=opt, config=settings)[0]


def scenarios() -> None:
    from gradgate.integrations.deepspeed import step_learners_only

    for stage, config in [(1, {"bf16": {"enabled": True}}), (2, {}), (0, {})]:
        built = engine(stage, **config)
        with pytest.raises(gg.InvalidOptionError, match=REFUSAL):
            step_learners_only(built)
    built = engine(1, bf16={"enabled": True})  # without gradgate's handle: the step refuses
    built.backward(built(torch.randn(2, 4, dtype=torch.bfloat16)).sum())
    with pytest.raises(gg.InvalidOptionError, match=r"DeepSpeed ZeRO replaces the groups"):
        built.step()


def run(rank: int, port: int, out: str) -> None:
    import logging

    os.environ.update(
        DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {}  # no op probing nor the CPU shm all-reduce build
    deepspeed.utils.logger.setLevel(logging.WARNING)
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        scenarios()
        outcome = "ok"
    except (Exception, pytest.fail.Exception):
        outcome = traceback.format_exc()
    Path(out).write_text(outcome)
    dist.destroy_process_group()


def test_zero_refuses_learner_masters_with_the_reason_and_the_alternative(tmp_path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    out = tmp_path / "outcome"
    mp.spawn(run, args=(port, str(out)), nprocs=1, join=True)
    assert out.read_text() == "ok"
