"""tools/fsdp2_badam_step.py, the GPU check of issue 46, in its --tiny mode: torchrun, 2 gloo
ranks on the CPU. Each rank holds masters and AdamW state for its shard of the active layer and
the final norm only (12 bytes an element, 4 for each step count)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import needs_fsdp2_on_cpu

pytestmark = [pytest.mark.slow, needs_fsdp2_on_cpu]  # torchrun starts two processes: seconds
ROOT = Path(__file__).resolve().parents[1]


def test_each_rank_holds_its_share_of_the_learners() -> None:
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from fsdp2_badam_step import SHAPES
    finally:
        sys.path.pop(0)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(ROOT / "tools/fsdp2_badam_step.py"), "--tiny"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{") :])

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES["tiny"]))
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    norm = model.model.norm.weight.numel()
    assert report["world"] == 2 and report["backend"] == "gloo"
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    ranks = report["ranks"]
    assert [r["active"] for r in ranks] == [[3, 3, 2, 2]] * 2  # BAdam, descending, switch every 2
    for step in range(4):
        assert sum(r["elements"][step] for r in ranks) == layer + norm
        for r in ranks:
            assert r["master_bytes"][step] == 12 * r["elements"][step] + 4 * r["learner_tensors"]
    assert all(r["max_memory_allocated"] is None for r in ranks)  # no CUDA here
