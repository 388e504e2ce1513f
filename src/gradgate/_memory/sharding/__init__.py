"""Per-rank plans: how DDP, FSDP2 and DeepSpeed ZeRO divide a step among ranks.

``engine`` (:class:`Engine`: one device, and what a planned step asks of an engine),
``ddp`` (replicas and the reducer's buckets), ``fsdp2`` (dim-0 shards, each unit all-gathered
and reduce-scattered around its forward and backward), ``zero`` (DeepSpeed ZeRO's settings and
what its stages share), ``zero12`` (one flat buffer in equal partitions) and ``zero3``
(per-parameter partitions gathered module by module), and ``flags`` (``gradgate plan --gpus
--shard --deepspeed``). The step (``_memory/step``) runs on the
fake twin with the engine's hooks on it, so every row is one rank's bytes.
"""

from __future__ import annotations

from .ddp import Ddp
from .engine import Engine
from .fsdp2 import Fsdp2
from .zero import zero_knobs
from .zero3 import Zero3
from .zero12 import Zero12


def engine_for(
    shard: str | None,
    world: int,
    device: str,
    deepspeed: object = None,
    hidden: int | None = None,
    optimizer: str = "adamw",
    masters: bool = False,
) -> Engine:
    """The engine ``shard`` names, over ``world`` ranks, following ``device``'s rules
    (``deepspeed``: a DeepSpeed config for ZeRO's buckets; ``hidden``: the model's hidden
    size, for its ``"auto"`` values; ``masters``: LearnerMasters steps)."""
    if shard == "ddp":
        return Ddp(world, device)
    if shard == "fsdp2":
        return Fsdp2(world, device)
    if shard is not None and shard.startswith("zero"):
        stage = int(shard[-1])
        knobs = zero_knobs(deepspeed, stage, hidden)
        zero: Zero3 | Zero12 = (
            Zero3(world, knobs, optimizer, masters)
            if stage == 3
            else Zero12(stage, world, knobs, optimizer, masters)
        )
        zero.gloo = device == "cpu"
        return zero
    return Engine()
