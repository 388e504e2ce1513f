"""BAdam steps with LearnerMasters on a ``fully_shard``-ed Llama (FSDP2), memory per rank.

A Llama-shaped model (``transformers.LlamaConfig``, random init, bf16) is made on the ``meta``
device, each decoder layer and then the root ``fully_shard``-ed over all ranks, and only then
given memory (``to_empty``): no rank ever holds more than its shards. ``gg.schedules.BAdam``
(one decoder layer a block, ``lm_head`` frozen) drives a ``BackpropGate``;
``gg.optim.LearnerMasters(torch.optim.AdamW)`` keeps fp32 masters and moments for the learners'
local shards only; ``gg.optim.clip_grad_norm_`` clips across ranks. Each rank reports, gathered
on rank 0 and printed as one JSON document: its ``torch.cuda.max_memory_allocated`` (and
reserved), ``master_bytes()`` after each step, the learners' local elements, the losses and the
median step time::

    torchrun --nproc-per-node 4 tools/fsdp2_badam_step.py                  # Llama-3-8B, NCCL
    torchrun --nproc-per-node 4 tools/fsdp2_badam_step.py --size 70b       # Llama-3-70B
    python tools/fsdp2_badam_step.py --size 70b --layers 4                 # 1 GPU: 4 layers
    torchrun --nproc-per-node 2 tools/fsdp2_badam_step.py --tiny           # CPU, gloo

Without ``torchrun`` it runs as a world of one. ``--tiny`` is a 4-layer model on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import gradgate as gg

SHAPES: dict[str, dict[str, Any]] = {
    "8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "70b": {
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    },
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="4 small layers on the CPU (gloo)")
    parser.add_argument("--size", choices=("8b", "70b"), default="8b")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers")
    parser.add_argument("--batch", type=int, default=1, help="sequences a rank")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--switch-every", type=int, default=2)
    parser.add_argument("--order", default="descending")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--clip", type=float, default=1.0, help="0: no clipping")
    parser.add_argument("--offload", choices=("cpu",), default=None)
    parser.add_argument("--checkpointing", action="store_true", help="HF, non-reentrant")
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq = min(args.seq, 32)
    return args


def start_group(cuda: bool) -> tuple[int, int, torch.device]:
    """Join torchrun's process group, or make a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def build(args: argparse.Namespace, device: torch.device, world: int) -> torch.nn.Module:
    """The sharded bf16 model: shapes on ``meta``, ``fully_shard``, then this rank's memory."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape = dict(SHAPES["tiny" if args.tiny else args.size])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    config = transformers.LlamaConfig(**shape, use_cache=False, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(dist.get_rank())
    with torch.no_grad():
        for name, param in model.named_parameters():
            part = param.to_local()
            if name.endswith("norm.weight"):
                part.fill_(1.0)
            else:
                part.normal_(0.0, 0.02, generator=generator)
        rotary = model.model.rotary_emb  # its buffers were made on meta
        model.model.rotary_emb = type(rotary)(config).to(device)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.lm_head.requires_grad_(False)  # BAdam's default: the layers learn, not the head
    model.train()
    return model


def step_all(args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> dict:
    layers = list(model.model.layers)
    gate = gg.BackpropGate(model)
    sched = gg.schedules.BAdam(len(layers), args.switch_every, order=args.order, seed=0)
    options = {"lr": args.lr, "weight_decay": 0.0}
    opt = gg.optim.LearnerMasters(
        torch.optim.AdamW, model.parameters(), offload=args.offload, **options
    )
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
    found: dict[str, list] = {"losses": [], "active": [], "master_bytes": [], "elements": []}
    times = []
    for step in range(args.steps):
        sync(device)
        start = time.perf_counter()
        sched.apply(gate, step)
        held = hold(layers, sched.active(step)) if args.checkpointing else []
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        learners = [p for p in model.parameters() if p.grad is not None]
        if args.clip:
            gg.optim.clip_grad_norm_(learners, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for p in held:
            p.requires_grad_(True)
        found["master_bytes"].append(opt.master_bytes())
        found["elements"].append(sum(p.to_local().numel() for p in learners))
        gg.optim.drop_finished(opt, gate, sched, step + 1)
        sync(device)
        times.append(time.perf_counter() - start)
        found["losses"].append(loss.item())
        found["active"].append(sched.active(step))
    gate.remove()
    found["learner_tensors"] = len(learners)
    found["median_step_s"] = statistics.median(times)
    return found


def hold(layers: list[torch.nn.Module], active: int) -> list[torch.nn.Parameter]:
    """Checkpointing recomputes a layer outside the gate's forward: the layers not learning are
    frozen for the step, so that the recomputation records no graph for them."""
    held = [p for i, layer in enumerate(layers) if i != active for p in layer.parameters()]
    for p in held:
        p.requires_grad_(False)
    return held


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    rank, world, device = start_group(cuda)
    try:
        model = build(args, device, world)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        row: dict[str, Any] = {"rank": rank, **step_all(args, model, device)}
        row["local_param_bytes"] = sum(
            p.to_local().numel() * p.element_size() for p in model.parameters()
        )
        row["max_memory_allocated"] = torch.cuda.max_memory_allocated(device) if cuda else None
        row["max_memory_reserved"] = torch.cuda.max_memory_reserved(device) if cuda else None
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, row)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    report = {
        "world": world,
        "backend": "nccl" if cuda else "gloo",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "shape": "tiny" if args.tiny else args.size,
        "layers": len(model.model.layers),
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": args.batch,
        "seq": args.seq,
        "offload": args.offload,
        "checkpointing": args.checkpointing,
        "torch": torch.__version__,
        "ranks": rows,
    }
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
