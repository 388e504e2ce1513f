"""The plan across processes: every rank's plan must be the same, and DDP must be built to let
parameters go without a gradient. The cut checks both at a forward; ``gg.distributed`` offers
them to users too.

Outside a process group every check passes:

>>> check_same_plan((2, 3))   # no process group: nothing to compare
"""

from __future__ import annotations

import functools
import hashlib
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .._plumbing.errors import GradgateError, RankMismatchError
from .block_calls import distributed_running

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel


# -- rank agreement ---------------------------------------------------------------------------
def check_same_plan(
    plan_key: tuple[int, ...] | bytes,
    *,
    process_group: dist.ProcessGroup | None = None,
    timeout: float = 60.0,
    describe: str | None = None,
) -> None:
    """Raise :class:`~gradgate.RankMismatchError` on every rank unless all ranks pass the same key.

    Costs one all-reduce of two 64-bit integers (a hash of ``plan_key``: its maximum and, negated,
    its minimum over the ranks). On a mismatch every rank sees it at once, the ranks exchange
    their plans (``describe`` if given, else the key) and each raises naming all of them. A rank
    that does not reach the check within ``timeout`` seconds makes the waiting ranks raise
    instead of hanging. Without an initialized process group (one process) there is nothing to
    compare and the call returns.

    >>> check_same_plan((1, 2, -2))     # one process: returns at once
    >>> check_same_plan(b"depth=3")
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise GradgateError(f"timeout={timeout!r}; expected a number of seconds above 0.")
    fingerprint = _fingerprint(plan_key)
    if not distributed_running():
        return
    extremes = torch.tensor(
        [fingerprint, -fingerprint], dtype=torch.int64, device=_device(process_group)
    )
    work = dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=process_group, async_op=True)
    _wait(work, timeout, what="the plan check")
    highest, minus_lowest = extremes.tolist()
    if highest == -minus_lowest:
        return
    plans: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(
        plans, describe if describe is not None else plan_key, group=process_group
    )
    listed = "; ".join(f"rank {rank}: {plan!r}" for rank, plan in enumerate(plans))
    raise RankMismatchError(
        f"the ranks use different plans in this step ({listed}); expected one plan on every "
        "rank, else DDP averages gradients of blocks only some ranks trained. Drive the plan "
        "from a seeded schedule (gg.schedules.RandomDepth(n, seed=0).apply(gate, step)) or "
        "broadcast it from rank 0 before the forward."
    )


def _fingerprint(plan_key: tuple[int, ...] | bytes) -> int:
    if not isinstance(plan_key, (bytes, tuple)) or (
        isinstance(plan_key, tuple) and not all(isinstance(v, int) for v in plan_key)
    ):
        raise GradgateError(
            f"plan_key={plan_key!r}; expected a tuple of ints or bytes (e.g. the learning block "
            "indices). Pass tuple(sorted(indices))."
        )
    return _hash63(plan_key)


@functools.lru_cache(maxsize=256)  # a run repeats a few plans: hash each once
def _hash63(plan_key: tuple[int, ...] | bytes) -> int:
    data = plan_key if isinstance(plan_key, bytes) else repr(plan_key).encode()
    # 63 bits so that negating it can never overflow int64
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def _device(process_group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(process_group)).lower()
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _wait(work: Any, timeout: float, *, what: str) -> None:
    try:
        finished = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as error:  # gloo reports a timeout (or a peer's failure) by raising
        raise RankMismatchError(
            f"{what} did not finish on rank {dist.get_rank()} within timeout={timeout} s "
            f"({error}); expected every rank to run the same gated forward. A rank stopped, "
            "crashed or took another code path; look at the other ranks' errors."
        ) from error
    if finished is False:
        raise RankMismatchError(
            f"{what} did not finish on rank {dist.get_rank()} within timeout={timeout} s; "
            "expected every rank to run the same gated forward."
        )


# -- DDP set-up -------------------------------------------------------------------------------
def require_find_unused_parameters(model: nn.Module | None) -> None:
    """Raise a clear error if ``model`` is a DDP wrapper that cannot skip parameters.

    A cut gives the parameters before it no gradient. Plain DDP then waits for them forever and
    fails at the next step with "Expected to have finished reduction in the prior iteration".
    DDP cannot switch ``find_unused_parameters`` on after it was built, so this raises before
    the first step. A model that is not DDP passes, and so does ``None``, so that a gate on the
    inner model can pass ``calling_ddp()`` from its first forward.

    >>> require_find_unused_parameters(torch.nn.Linear(2, 2))   # not DDP: fine
    >>> require_find_unused_parameters(calling_ddp())          # not inside a DDP forward
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return
    if model.static_graph:
        raise GradgateError(
            "DistributedDataParallel(..., static_graph=True) assumes the same parameters get "
            "gradients every step, but a gate changes that per step; expected "
            "static_graph=False with find_unused_parameters=True. Build it as "
            "DistributedDataParallel(model, find_unused_parameters=True)."
        )
    if not model.find_unused_parameters:
        raise GradgateError(
            "DistributedDataParallel(..., find_unused_parameters=False) cannot train a gated "
            "model: parameters before the cut get no gradient and DDP fails at the next step "
            "('Expected to have finished reduction'). Expected find_unused_parameters=True: "
            "DistributedDataParallel(model, find_unused_parameters=True) (HF Trainer: "
            "ddp_find_unused_parameters=True; Lightning: "
            "strategy='ddp_find_unused_parameters_true'; accelerate: "
            "DistributedDataParallelKwargs(find_unused_parameters=True)); then "
            "gg.distributed.allreduce_trained(ddp_model) sends only what learns."
        )


def calling_ddp() -> DistributedDataParallel | None:
    """The DDP wrapper whose forward is running in this thread, if any.

    A gate is usually made on the inner model (``BackpropGate(ddp.module)``), which does not
    know its wrapper; from inside its forward this finds it (walks the Python stack: call it
    once per gate, not every step).

    >>> calling_ddp() is None
    True
    """
    from torch.nn.parallel import DistributedDataParallel

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if isinstance(owner, DistributedDataParallel):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None
