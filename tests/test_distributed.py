"""Real DDP and FSDP2 processes (gloo on CPU, 2 ranks) with a per-step plan.

Spawning processes costs seconds, so one spawned job with one process group runs every
scenario below in turn; each rank records per scenario "ok" or the failure's traceback, plus the
numbers measured, and the tests here read that record. Each scenario compares gradients with a
single-process reference: autograd on an unmodified copy, the loss averaged over the ranks'
batches, as DDP averages.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradgate as gg
from gradgate._bench.distributed import counting_all_reduce
from gradgate._fsdp import _fsdp_param_groups

pytestmark = pytest.mark.slow

WORLD = 2
TIMEOUT = timedelta(seconds=120)  # a stuck rendezvous or collective fails instead of hanging
N_BLOCKS = 4
BLOCK_BYTES = (16 + 4) * 4  # Linear(4, 4): weight and bias, float32
# ~100 bytes: each bucket holds about a block and a half, so buckets cut across blocks
SMALL_BUCKET_MB = 100 / 2**20


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(N_BLOCKS)])


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def learning_params(depth: int | None) -> int:
    """Index of the first parameter that learns at this depth (2 parameters per block)."""
    return 0 if depth is None else 2 * (N_BLOCKS - depth)


def reference(steps: list[tuple[int, int | None]]) -> list[torch.Tensor | None]:
    """Gradients of one optimizer step made of micro-batches ``(step, depth)``, rank-averaged."""
    model = make_model()
    params = list(model.parameters())
    total: list[torch.Tensor | None] = [None] * len(params)
    for step, depth in steps:
        first = learning_params(depth)
        loss = sum(model(batch(r, step)).pow(2).sum() for r in range(WORLD)) / WORLD
        grads = torch.autograd.grad(loss, params[first:])
        for i, grad in enumerate(grads, start=first):
            total[i] = grad if total[i] is None else total[i] + grad
    return total


def assert_grads(model: nn.Module, expected: list[torch.Tensor | None], where: str) -> None:
    for i, (param, want) in enumerate(zip(model.parameters(), expected, strict=True)):
        if want is None:
            assert param.grad is None, f"{where}: parameter {i} has a gradient, expected None"
        else:
            assert param.grad is not None, f"{where}: parameter {i} has no gradient"
            torch.testing.assert_close(param.grad, want, rtol=1e-5, atol=1e-6, msg=where)


def gradient_bytes(calls: list[tuple[torch.dtype, int]], *, tags: int = 0) -> int:
    """Bytes of gradient all-reduced, less ``tags`` 4-byte layout tags (assume_same_plan)."""
    return sum(size for dtype, size in calls if dtype == torch.float32) - 4 * tags


@contextmanager
def counting_tags() -> Iterator[list[int]]:
    """Record each layout tag allreduce_trained(..., assume_same_plan=True) adds to a bucket."""
    tags: list[int] = []
    original = gg.distributed.TrainedAllReduce._layout_tag

    def counted(self: Any, *args: Any) -> int:
        tags.append(original(self, *args))
        return tags[-1]

    gg.distributed.TrainedAllReduce._layout_tag = counted  # type: ignore[method-assign]
    try:
        yield tags
    finally:
        gg.distributed.TrainedAllReduce._layout_tag = original  # type: ignore[method-assign]


def flag_exchanges(calls: list[tuple[torch.dtype, int]]) -> int:
    return sum(dtype == torch.uint8 for dtype, _ in calls)


# -- scenarios, run on every rank of one process group ---------------------------------------
def ddp_with_find_unused_is_exact(rank: int, record: dict[str, Any]) -> None:
    model = make_model()
    ddp = DDP(model, find_unused_parameters=True)
    gate = gg.BackpropGate(model)
    for step, depth in enumerate([1, 3, None, 2]):
        ddp.zero_grad(set_to_none=True)
        gate.depth = depth
        ddp(batch(rank, step)).pow(2).sum().backward()
        assert_grads(model, reference([(step, depth)]), f"step {step}")
    gate.remove()


def allreduce_trained_sends_the_trained_share(rank: int, record: dict[str, Any]) -> None:
    for as_view, assume in [(False, False), (True, False), (False, True), (True, True)]:
        model = make_model()
        ddp = DDP(
            model,
            find_unused_parameters=True,
            bucket_cap_mb=SMALL_BUCKET_MB,
            gradient_as_bucket_view=as_view,
        )
        handle = gg.distributed.allreduce_trained(ddp, assume_same_plan=assume)
        gate = gg.BackpropGate(model)
        shares = {}
        for step, depth in enumerate([1, 3, None, 2, 1]):
            ddp.zero_grad(set_to_none=True)
            gate.depth = depth
            with counting_all_reduce() as calls, counting_tags() as tags:
                ddp(batch(rank, step)).pow(2).sum().backward()
            trained = N_BLOCKS if depth is None else depth
            sent = gradient_bytes(calls, tags=len(tags))
            # a tag in each bucket sent in part, none where the whole bucket is sent
            assert (len(tags) > 0) == (assume and depth is not None), tags
            assert sent == trained * BLOCK_BYTES, (as_view, assume, depth, calls)
            assert (flag_exchanges(calls) == 0) == assume, calls
            shares[depth] = sent / (N_BLOCKS * BLOCK_BYTES)
            assert_grads(model, reference([(step, depth)]), f"view={as_view} step {step}")
        assert handle.bytes_full == 5 * N_BLOCKS * BLOCK_BYTES
        assert handle.bytes_reduced == (1 + 3 + 4 + 2 + 1) * BLOCK_BYTES
        record["shares"] = shares
        gate.remove()
        handle.remove()


def allreduce_trained_buckets_cut_across_blocks(rank: int, record: dict[str, Any]) -> None:
    model = make_model()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=SMALL_BUCKET_MB)
    gg.distributed.allreduce_trained(ddp)
    seen: list[list[int]] = []
    original = gg.distributed.TrainedAllReduce._stretches

    def spy(self: Any, bucket: dist.GradBucket) -> list[tuple[int, int]]:
        seen.append([p.numel() for p in bucket.parameters()])
        return original(self, bucket)

    gg.distributed.TrainedAllReduce._stretches = spy  # type: ignore[method-assign]
    try:
        ddp(batch(rank, 0)).pow(2).sum().backward()
    finally:
        gg.distributed.TrainedAllReduce._stretches = original  # type: ignore[method-assign]
    # a weight (16) and a bias (4) of one block never alone make a whole bucket
    assert len(seen) > 1 and any(sizes not in ([16, 4], [4, 16]) for sizes in seen), seen


def allreduce_trained_leaves_unsent_stretches_alone(rank: int, record: dict[str, Any]) -> None:
    """What is not sent keeps its value, also the element a layout tag borrows for a while.

    Every bucket is filled with 7 before the hook runs: the stretches sent average to 7 over
    the ranks, the others must keep it, so any other value is a leak (a tag left behind)."""
    original = gg.distributed.TrainedAllReduce._reduce
    results: list[Any] = []

    def spy(self: Any, bucket: dist.GradBucket) -> Any:
        bucket.buffer().fill_(7.0)
        results.append(original(self, bucket))
        return results[-1]

    for assume in (False, True):
        model = make_model()
        ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=SMALL_BUCKET_MB)
        handle = gg.distributed.allreduce_trained(ddp, assume_same_plan=assume)
        gate = gg.BackpropGate(model)
        gg.distributed.TrainedAllReduce._reduce = spy  # type: ignore[method-assign]
        try:
            for step, depth in enumerate([1, 2, 3]):
                gate.depth = depth
                results.clear()
                with counting_tags() as tags:
                    ddp(batch(rank, step)).pow(2).sum().backward()
                assert len(tags) > 0 if assume else not tags
                for future in results:
                    assert bool((future.wait() == 7.0).all()), (assume, depth, future.wait())
        finally:
            gg.distributed.TrainedAllReduce._reduce = original  # type: ignore[method-assign]
        gate.remove()
        handle.remove()


def allreduce_trained_accumulates_different_plans(rank: int, record: dict[str, Any]) -> None:
    for as_view, assume in [(False, False), (True, False), (True, True)]:
        model = make_model()
        ddp = DDP(
            model,
            find_unused_parameters=True,
            bucket_cap_mb=SMALL_BUCKET_MB,
            gradient_as_bucket_view=as_view,
        )
        handle = gg.distributed.allreduce_trained(ddp, assume_same_plan=assume)
        gate = gg.BackpropGate(model)
        # optimizer steps made of micro-batches with a depth each; the last one syncs
        plans = [[(0, 3), (1, 1)], [(2, 1), (3, 2)], [(4, 1), (5, 3), (6, 1)], [(7, 2)]]
        for plan in plans:
            ddp.zero_grad(set_to_none=True)
            with counting_all_reduce() as calls, counting_tags() as tags:
                for i, (step, depth) in enumerate(plan):
                    gate.depth = depth
                    sync = i == len(plan) - 1
                    with nullcontext() if sync else ddp.no_sync():
                        ddp(batch(rank, step)).pow(2).sum().backward()
            deepest = max(depth for _, depth in plan)
            sent = gradient_bytes(calls, tags=len(tags))
            assert sent == deepest * BLOCK_BYTES, (as_view, plan, calls)
            assert_grads(model, reference(plan), f"view={as_view} plan {plan}")
        gate.remove()
        handle.remove()


def allreduce_trained_matches_ddp_when_ranks_differ(rank: int, record: dict[str, Any]) -> None:
    """Ranks that train different blocks (a data-dependent graph, or no check_ranks) get
    exactly what plain DDP gives: each rank's gradient, zero where it has none, averaged."""
    depths = {0: 1, 1: 3}
    model = make_model()
    params = list(model.parameters())
    expected: list[torch.Tensor | None] = [None] * len(params)
    for r, depth in depths.items():
        first = learning_params(depth)
        grads = torch.autograd.grad(model(batch(r, 0)).pow(2).sum() / WORLD, params[first:])
        for i, grad in enumerate(grads, start=first):
            expected[i] = grad if expected[i] is None else expected[i] + grad
    for trained_only in (False, True):
        model = make_model()
        ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=SMALL_BUCKET_MB)
        handle = gg.distributed.allreduce_trained(ddp) if trained_only else None
        gate = gg.BackpropGate(model, depth=depths[rank])
        with counting_all_reduce() as calls:
            ddp(batch(rank, 0)).pow(2).sum().backward()
        assert_grads(model, expected, f"trained_only={trained_only}")
        if handle is not None:
            assert gradient_bytes(calls) == max(depths.values()) * BLOCK_BYTES
            handle.remove()
        gate.remove()


def allreduce_trained_assuming_one_plan_detects_two(rank: int, record: dict[str, Any]) -> None:
    """Same bytes, different parameters: the layout tag tells, on every rank."""
    model = make_model()
    ddp = DDP(model, find_unused_parameters=True)  # one bucket
    gg.distributed.allreduce_trained(ddp, assume_same_plan=True)
    gate = gg.BackpropGate(model)
    gate.learn = {1 + rank}  # block 1 on rank 0, block 2 on rank 1: 80 bytes each
    with pytest.raises(RuntimeError, match="the ranks all-reduced different parameters"):
        ddp(batch(rank, 0)).pow(2).sum().backward()
    gate.remove()
    with pytest.raises(gg.GradgateError, match="assume_same_plan='yes'"):
        gg.distributed.allreduce_trained(
            DDP(make_model(), find_unused_parameters=True),
            assume_same_plan="yes",  # type: ignore[arg-type]
        )


def allreduce_trained_remove_restores_full_averaging(rank: int, record: dict[str, Any]) -> None:
    model = make_model()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=SMALL_BUCKET_MB)
    handle = gg.distributed.allreduce_trained(ddp)
    with pytest.raises(gg.GradgateError, match="already active"):
        gg.distributed.allreduce_trained(ddp)
    gate = gg.BackpropGate(model, depth=1)
    handle.remove()
    with counting_all_reduce() as calls:
        ddp(batch(rank, 0)).pow(2).sum().backward()
    assert gradient_bytes(calls) == N_BLOCKS * BLOCK_BYTES  # every bucket, in full
    assert_grads(model, reference([(0, 1)]), "after remove")
    again = gg.distributed.allreduce_trained(ddp)  # the same comm hook switches back on
    ddp.zero_grad(set_to_none=True)
    with counting_all_reduce() as calls:
        ddp(batch(rank, 1)).pow(2).sum().backward()
    assert gradient_bytes(calls) == BLOCK_BYTES
    assert again.bytes_reduced == BLOCK_BYTES
    assert_grads(model, reference([(1, 1)]), "after allreduce_trained again")
    gate.remove()
    again.remove()


def allreduce_trained_sees_parameters_unfrozen_later(rank: int, record: dict[str, Any]) -> None:
    """A parameter frozen when the hook was installed and unfrozen after is still averaged."""
    model = make_model()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=SMALL_BUCKET_MB)
    frozen = gg.freeze(model, "0")
    handle = gg.distributed.allreduce_trained(ddp)
    frozen.undo()
    ddp(batch(rank, 0)).pow(2).sum().backward()
    assert_grads(model, reference([(0, None)]), "unfrozen after allreduce_trained")
    handle.remove()


def plain_ddp_gets_a_clear_error(rank: int, record: dict[str, Any]) -> None:
    model = make_model()
    plain = DDP(model)
    with pytest.raises(gg.GradgateError, match="find_unused_parameters=True") as error:
        gg.distributed.require_find_unused_parameters(plain)
    assert "allreduce_trained" in str(error.value)
    with pytest.raises(gg.GradgateError, match="find_unused_parameters=True"):
        gg.distributed.allreduce_trained(plain)
    with warnings.catch_warnings():  # DDP notes that static_graph finds unused parameters
        warnings.simplefilter("ignore", UserWarning)
        static = DDP(make_model(), find_unused_parameters=True, static_graph=True)
    with pytest.raises(gg.GradgateError, match="static_graph=True"):
        gg.distributed.require_find_unused_parameters(static)
    gg.distributed.require_find_unused_parameters(DDP(make_model(), find_unused_parameters=True))
    gg.distributed.require_find_unused_parameters(model)  # not DDP
    # the gate sees the DDP wrapper whose forward calls it
    found: list[Any] = []
    hook = model.register_forward_pre_hook(lambda *_: found.append(gg.distributed.calling_ddp()))
    plain(batch(rank, 0))
    model(batch(rank, 0))
    hook.remove()
    assert found[0] is plain and found[1] is None


def check_same_plan_agrees_and_disagrees(rank: int, record: dict[str, Any]) -> None:
    gg.distributed.check_same_plan((3, -2, 1))
    gg.distributed.check_same_plan(b"same bytes")
    with pytest.raises(gg.RankMismatchError) as error:
        gg.distributed.check_same_plan((rank, -2))
    assert "rank 0: (0, -2)" in str(error.value) and "rank 1: (1, -2)" in str(error.value)
    with pytest.raises(gg.RankMismatchError, match="rank 1: 'depth=2'"):
        gg.distributed.check_same_plan((rank,), describe=f"depth={rank + 1}")
    with pytest.raises(gg.GradgateError, match="plan_key="):
        gg.distributed.check_same_plan([1, 2])  # type: ignore[arg-type]
    calls = 300
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        gg.distributed.check_same_plan((1, 2, 3, -2, -3, 0))
    record["check_us"] = (time.perf_counter() - start) / calls * 1e6


def check_same_plan_does_not_hang(rank: int, record: dict[str, Any]) -> None:
    if rank == 1:
        time.sleep(3.0)  # late: rank 0 gives up first, then this call completes the collective
        gg.distributed.check_same_plan((1,))
        return
    start = time.perf_counter()
    with pytest.raises(gg.RankMismatchError, match=r"within timeout=1\.0 s"):
        gg.distributed.check_same_plan((1,), timeout=1.0)
    record["waited"] = time.perf_counter() - start


def gate_with_check_ranks(rank: int, record: dict[str, Any]) -> None:
    model = make_model()
    ddp = DDP(model, find_unused_parameters=True)
    gate = gg.BackpropGate(model, check_ranks=True)
    gate.depth = 2
    ddp(batch(rank, 0)).pow(2).sum().backward()
    assert_grads(model, reference([(0, 2)]), "same plan")
    ddp.zero_grad(set_to_none=True)
    gate.depth = 1 + rank  # ranks disagree: both raise before DDP averages anything
    with pytest.raises(gg.RankMismatchError):
        ddp(batch(rank, 1))
    gate.remove()


def check_ranks_sees_which_modules_learn(rank: int, record: dict[str, Any]) -> None:
    """Plans that differ only in a module named in learn (same count) are a mismatch too."""
    model = make_model()
    ddp = DDP(model, find_unused_parameters=True)
    gate = gg.BackpropGate(model, check_ranks=True)
    gate.learn = {3, "2.0"}
    ddp(batch(rank, 0)).pow(2).sum().backward()  # the same modules on both ranks: fine
    ddp.zero_grad(set_to_none=True)
    gate.learn = {3, ["1.0", "2.0"][rank]}  # the same count, different modules
    with pytest.raises(gg.RankMismatchError):
        ddp(batch(rank, 1))
    gate.remove()


def gate_made_before_the_process_group_checks_ddp(rank: int, record: dict[str, Any]) -> None:
    """A gate made before init_process_group (a LightningModule's __init__) still sees plain
    DDP at its first forward and raises gradgate's error, not DDP's at the next step."""
    dist.destroy_process_group()
    model = make_model()
    gate = gg.BackpropGate(model, depth=2)  # no process group yet
    # a fresh port: the old store's port may still be held, and a rank that reaches it would
    # wait on a store that is gone
    port = os.environ["GRADGATE_TEST_SECOND_PORT"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=TIMEOUT
    )
    plain = DDP(model)
    with pytest.raises(gg.GradgateError, match="find_unused_parameters=True"):
        plain(batch(rank, 0))
    gate.remove()


def fsdp2_all_gathers_only_learning_blocks(rank: int, record: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    mesh = init_device_mesh("cpu", (WORLD,))
    model = make_model()
    blocks = list(model)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gate = gg.BackpropGate(model)
    gathers: list[int] = []
    original = _fsdp_param_group.foreach_all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers.append(1)
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted

    def unshard_flags() -> list[bool]:
        groups = [g for b in blocks for g in _fsdp_param_groups(b)]
        return [g.unshard_in_backward for g in groups]

    def set_fsdp_default() -> None:
        for block in blocks:
            block.set_unshard_in_backward(True)  # type: ignore[operator]

    counts: dict[str, int] = {}
    try:
        for step, depth in enumerate([1, 2, 3, 4]):
            # "gate": the gate applies the plan itself; "default": FSDP2 as it comes;
            # "plan": apply_plan_to_fsdp called by hand on the default
            for arm in ("gate", "default", "plan"):
                model.zero_grad(set_to_none=True)
                gate.depth = depth
                restore = None
                if arm != "gate":
                    set_fsdp_default()
                if arm == "plan":
                    in_backward = [i >= N_BLOCKS - depth for i in range(N_BLOCKS)]
                    restore = gg.distributed.apply_plan_to_fsdp(blocks, in_backward)
                    assert unshard_flags() == in_backward
                loss = model(batch(rank, step)).pow(2).sum()
                gathers.clear()
                loss.backward()
                if restore is not None:
                    restore()
                    assert all(unshard_flags())
                counts[f"depth {depth} {arm}"] = len(gathers)
                grads = [
                    None if p.grad is None else p.grad.full_tensor() for p in model.parameters()
                ]
                want = reference([(step, depth)])
                for i, (got, expected) in enumerate(zip(grads, want, strict=True)):
                    if expected is None:
                        assert got is None, (depth, i)
                    else:
                        # FSDP2 averages; reference() averages the summed losses the same way
                        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    finally:
        _fsdp_param_group.foreach_all_gather = original
    record["fsdp_gathers"] = counts
    gate.remove()


SCENARIOS: list[Callable[[int, dict[str, Any]], None]] = [
    ddp_with_find_unused_is_exact,
    allreduce_trained_sends_the_trained_share,
    allreduce_trained_buckets_cut_across_blocks,
    allreduce_trained_leaves_unsent_stretches_alone,
    allreduce_trained_accumulates_different_plans,
    allreduce_trained_matches_ddp_when_ranks_differ,
    allreduce_trained_assuming_one_plan_detects_two,
    allreduce_trained_remove_restores_full_averaging,
    allreduce_trained_sees_parameters_unfrozen_later,
    plain_ddp_gets_a_clear_error,
    check_same_plan_agrees_and_disagrees,
    check_same_plan_does_not_hang,
    gate_with_check_ranks,
    check_ranks_sees_which_modules_learn,
    gate_made_before_the_process_group_checks_ddp,
    fsdp2_all_gathers_only_learning_blocks,
]


def run_rank(rank: int, ports: tuple[int, int], out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(ports[0])
    os.environ["GRADGATE_TEST_SECOND_PORT"] = str(ports[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=TIMEOUT)
    results: dict[str, Any] = {}
    for scenario in SCENARIOS:
        record: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            scenario(rank, record)
            record["outcome"] = "ok"
        except (Exception, pytest.fail.Exception):  # a failed pytest.raises is no Exception
            record["outcome"] = traceback.format_exc()
        record["seconds"] = time.perf_counter() - start
        results[scenario.__name__] = record
        dist.barrier()  # a failed scenario leaves no collective behind for the next one
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ranks")
    ports = (free_port(), free_port())
    mp.spawn(run_rank, args=(ports, str(out)), nprocs=WORLD, join=True)
    loaded = [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]
    if os.environ.get("GRADGATE_SHOW_DISTRIBUTED"):
        print(loaded[0])
    return loaded


@pytest.mark.parametrize("scenario", [s.__name__ for s in SCENARIOS])
def test_scenario(results: list[dict[str, Any]], scenario: str) -> None:
    for rank, result in enumerate(results):
        outcome = result[scenario]["outcome"]
        assert outcome == "ok", f"rank {rank}:\n{outcome}"


def test_bytes_all_reduced_are_the_trained_share(results: list[dict[str, Any]]) -> None:
    shares = results[0]["allreduce_trained_sends_the_trained_share"]["shares"]
    assert shares == {1: 0.25, 3: 0.75, None: 1.0, 2: 0.5}


def test_fsdp2_gathers_one_more_block_without_the_plan(results: list[dict[str, Any]]) -> None:
    counts = results[0]["fsdp2_all_gathers_only_learning_blocks"]["fsdp_gathers"]
    for depth in (1, 2, 3):
        assert counts[f"depth {depth} plan"] == counts[f"depth {depth} gate"] == depth
        assert counts[f"depth {depth} default"] == depth + 1  # FSDP2's prefetch
    assert counts["depth 4 plan"] == counts["depth 4 default"] == counts["depth 4 gate"] == 4


def test_check_same_plan_costs_little(results: list[dict[str, Any]]) -> None:
    assert results[0]["check_same_plan_agrees_and_disagrees"]["check_us"] < 20_000


def test_a_missing_rank_raises_after_the_timeout(results: list[dict[str, Any]]) -> None:
    assert 1.0 <= results[0]["check_same_plan_does_not_hang"]["waited"] < 2.5


def test_outside_a_process_group_checks_pass() -> None:
    gg.distributed.check_same_plan((1, 2))
    with pytest.raises(gg.GradgateError, match="plan_key=\\[1\\]"):
        gg.distributed.check_same_plan([1])  # type: ignore[arg-type]
    with pytest.raises(gg.GradgateError, match="timeout=0; expected a number of seconds"):
        gg.distributed.check_same_plan((1,), timeout=0)
    gg.distributed.require_find_unused_parameters(make_model())
    assert gg.distributed.calling_ddp() is None
    restore = gg.distributed.apply_plan_to_fsdp([nn.Linear(2, 2)], [False])
    restore()
    with pytest.raises(gg.GradgateError, match="2 blocks and 1 in_backward"):
        gg.distributed.apply_plan_to_fsdp([nn.Linear(2, 2)] * 2, [True])
    with pytest.raises(gg.GradgateError, match=r"expected a torch\.nn\.parallel"):
        gg.distributed.allreduce_trained(make_model())
