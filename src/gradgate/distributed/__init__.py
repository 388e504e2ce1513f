"""Scale out: DDP and FSDP2 with a plan that changes every step.

Three jobs:

* :func:`allreduce_trained` — a DDP communication hook that all-reduces only the parameters
  that got a gradient, so the bytes sent each step are proportional to what learns;
* :func:`check_same_plan` — every rank must use the same plan in a step, else
  :class:`~gradgate.RankMismatchError` on every rank (``BackpropGate(..., check_ranks=True)``);
* :func:`require_find_unused_parameters` and :func:`apply_plan_to_fsdp` — DDP and FSDP2 set up
  for parameters that get no gradient in some steps.

Outside a process group every check passes, so the same script runs on one process:

>>> import gradgate as gg
>>> gg.distributed.check_same_plan((2, 3))   # no process group: nothing to compare
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from .._cut.fsdp import apply_plan_to_fsdp
from .._cut.ranks import calling_ddp, check_same_plan, require_find_unused_parameters
from .._plumbing.errors import GradgateError, RankMismatchError
from .._plumbing.handles import Handle
from ._bucket_tag import digits_per_element, disagreeing, encode

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from .._plumbing.torch_internals import GradBucket

__all__ = [
    "TrainedAllReduce",
    "allreduce_trained",
    "apply_plan_to_fsdp",
    "calling_ddp",
    "check_same_plan",
    "require_find_unused_parameters",
]

_STATE_ATTRIBUTE = "_gradgate_trained_allreduce"


# -- DDP: all-reduce only what learns ---------------------------------------------------------
class TrainedAllReduce(Handle):
    """The handle of :func:`allreduce_trained`; counts the bytes it all-reduced.

    DDP cannot unregister a comm hook, so ``remove()`` switches the hook to all-reducing every
    bucket in full (DDP's default averaging) and removes the per-parameter hooks; calling
    :func:`allreduce_trained` again on the same model switches it back.
    """

    def __init__(
        self,
        ddp: DistributedDataParallel,
        process_group: dist.ProcessGroup | None,
        *,
        assume_same_plan: bool = False,
    ) -> None:
        super().__init__(
            self._deactivate, description=f"trained-only all-reduce of {type(ddp.module).__name__}"
        )
        self.group = process_group if process_group is not None else ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        self.bytes_reduced = 0  # bytes of gradient all-reduced by this hook so far
        self.bytes_full = 0  # bytes DDP's default hook would have all-reduced
        self.trained_only = True
        self._tagged = assume_same_plan  # no flag exchange: a layout tag checks agreement
        self._ddp = ddp
        self._fresh: set[int] = set()  # ids of parameters with a gradient not yet reduced
        self._hooks = self._watch(ddp)

    def _watch(self, ddp: DistributedDataParallel) -> list[Any]:
        """Hook every parameter that can get a gradient; one frozen now cannot be hooked, so it
        is always sent (it may be unfrozen later, and DDP still has it in its buckets)."""

        def mark(param: torch.Tensor) -> None:
            self._fresh.add(id(param))

        self._always = {id(p) for p in ddp.module.parameters() if not p.requires_grad}
        return [
            param.register_post_accumulate_grad_hook(mark)
            for param in ddp.module.parameters()
            if param.requires_grad
        ]

    def _deactivate(self) -> None:
        self.trained_only = False
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._fresh.clear()

    def _reduce(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        size = buffer.numel()
        self.bytes_full += size * buffer.element_size()
        tagged = self._can_tag(buffer.dtype) and self._tagged
        flags, stretches = self._stretches(bucket, agree=not tagged)
        if not stretches:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(buffer)
            return done
        sent = sum(end - start for start, end in stretches)
        self.bytes_reduced += sent * buffer.element_size()
        # Sending the whole bucket needs no tag: a rank sending less would fail on the size.
        tag = encode(flags, self.world_size, buffer.dtype) if tagged and sent < size else None
        width = 0 if tag is None else tag.numel()
        copy_back: list[tuple[int, int]] = []
        saved: torch.Tensor | None = None
        first, last = stretches[0][0], stretches[-1][1]
        if len(stretches) == 1 and last + width <= size:  # where it lies; the tag borrows after
            buffer[first:last].div_(self.world_size)
            packed = buffer[first : last + width]
            saved = buffer[last : last + width].clone() if width else None
        else:
            parts = [buffer[start:end] for start, end in stretches]
            packed = torch.cat([*parts, buffer.new_zeros(width)])
            packed[:sent].div_(self.world_size)
            copy_back = stretches
        if tag is not None:  # at the same offset on every rank that sends as much
            packed[sent:] = tag.to(buffer.device)
        work = dist.all_reduce(packed, group=self.group, async_op=True)

        def unpack(future: torch.futures.Future[Any]) -> torch.Tensor:
            future.wait()
            if tag is not None:
                summed = packed[sent:].to("cpu", copy=True)  # read before restoring
                if saved is not None:  # the borrowed elements get their values back
                    buffer[last : last + width] = saved
                self._check_layout(bucket, summed, len(flags))
            position = 0
            for start, end in copy_back:
                buffer[start:end].copy_(packed[position : position + end - start])
                position += end - start
            return buffer

        return cast("torch.futures.Future[torch.Tensor]", work.get_future().then(unpack))

    def _can_tag(self, dtype: torch.dtype) -> bool:
        """Tags need exact sums in the bucket's dtype, and ranks that all run backward: under
        DDP's ``join()`` a rank out of inputs sends zeros and must learn the layout."""
        joining = getattr(getattr(self._ddp, "_join_config", None), "enable", False)
        if joining and not getattr(self._ddp, "_divide_by_initial_world_size", True):
            raise GradgateError(
                "DDP's join(divide_by_initial_world_size=False) averages over the ranks still "
                "running, but allreduce_trained divides by the world size; expected "
                "ddp.join() with its default divide_by_initial_world_size=True. Use that, or "
                "handle.remove() for the uneven epoch."
            )
        return digits_per_element(self.world_size, dtype) > 0 and not joining

    def _check_layout(self, bucket: GradBucket, summed: torch.Tensor, count: int) -> None:
        differ = disagreeing(summed, count, self.world_size)
        if not differ:
            return
        names = {id(p): n for n, p in self._ddp.module.named_parameters()}
        params = bucket.parameters()
        listed = ", ".join(names.get(id(params[i]), "?") for i in differ[:5])
        raise RankMismatchError(
            f"bucket {bucket.index()}: the ranks all-reduced different parameters ({listed} "
            "got a gradient on some ranks only; allreduce_trained(..., assume_same_plan=True) "
            "read it from the layout tags); expected every rank's backward to reach the same "
            "parameters. Use the same plan on every rank (BackpropGate(..., check_ranks=True)) "
            "or assume_same_plan=False."
        )

    def _stretches(
        self, bucket: GradBucket, *, agree: bool
    ) -> tuple[list[bool], list[tuple[int, int]]]:
        """This rank's flag per parameter of the bucket (got a gradient since the last sync) and
        the runs to send: with ``agree``, those of the parameters flagged on any rank."""
        params = bucket.parameters()
        flags = [id(p) in self._fresh or id(p) in self._always for p in params]
        self._fresh.difference_update(id(p) for p in params)
        if not self.trained_only:
            return flags, [(0, bucket.buffer().numel())]
        if self.world_size > 1 and agree:  # same stretches on every rank: the union
            used = torch.tensor(flags, dtype=torch.uint8, device=bucket.buffer().device)
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group)
            flags = [bool(flag) for flag in used.tolist()]
        stretches: list[tuple[int, int]] = []
        offset = 0
        for param, flag in zip(params, flags, strict=True):
            end = offset + param.numel()
            if flag and stretches and stretches[-1][1] == offset:
                stretches[-1] = (stretches[-1][0], end)
            elif flag:
                stretches.append((offset, end))
            offset = end
        if offset != bucket.buffer().numel():  # a layout this hook does not know: send it all
            return flags, [(0, bucket.buffer().numel())]
        return flags, stretches

    def __repr__(self) -> str:
        share = self.bytes_reduced / self.bytes_full if self.bytes_full else 0.0
        mode = "trained only" if self.trained_only else "full (removed)"
        return (
            f"<gradgate.distributed.TrainedAllReduce {mode}: {self.bytes_reduced} of "
            f"{self.bytes_full} bytes ({share:.1%})>"
        )


def allreduce_trained(
    ddp_model: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    assume_same_plan: bool = False,
) -> TrainedAllReduce:
    """Make DDP all-reduce only the parameters that got a gradient since the last sync.

    Registers a DDP communication hook. Each bucket sends the stretches whose parameters
    received a gradient on any rank (a one-byte-per-parameter all-reduce agrees on them), so
    the bytes per step are proportional to the trained share; gradients are the same average
    DDP computes, also when ranks train different parameters (data-dependent graphs).

    ``assume_same_plan=True`` skips that agreement (one small blocking all-reduce per bucket,
    which on a GPU also waits for the stream): every rank's backward must then reach the same
    parameters, as with one plan per step (``BackpropGate(..., check_ranks=True)``) and no
    data-dependent branches. A few extra elements in each bucket sent in part, a tag of its
    layout (one digit per parameter), turn a disagreement into an error raised by
    ``backward()`` on every rank (its message that of :class:`~gradgate.RankMismatchError`)
    rather than a wrong average. Under DDP's ``join()`` the flags are exchanged anyway.

    Accumulation under ``no_sync`` with a different plan per micro-batch,
    ``gradient_as_bucket_view=True`` and buckets that cut across blocks are handled. Needs
    ``find_unused_parameters=True``. ``handle.bytes_reduced`` / ``handle.bytes_full`` count
    what was sent against what plain DDP sends; ``handle.remove()`` restores full averaging.

    >>> ddp = DistributedDataParallel(model, find_unused_parameters=True)  # doctest: +SKIP
    >>> handle = gg.distributed.allreduce_trained(ddp)                     # doctest: +SKIP
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise GradgateError(
            f"allreduce_trained got a {type(ddp_model).__name__}; expected a "
            "torch.nn.parallel.DistributedDataParallel. Wrap the model first: "
            "ddp = DistributedDataParallel(model, find_unused_parameters=True)."
        )
    require_find_unused_parameters(ddp_model)
    previous: TrainedAllReduce | None = getattr(ddp_model, _STATE_ATTRIBUTE, None)
    if previous is not None and previous.active:
        raise GradgateError(
            f"allreduce_trained is already active on this model ({previous!r}); expected "
            "one per model. Keep the first handle, or call handle.remove() first."
        )
    if not isinstance(assume_same_plan, bool):
        raise GradgateError(f"assume_same_plan={assume_same_plan!r}; expected True or False.")
    handle = TrainedAllReduce(ddp_model, process_group, assume_same_plan=assume_same_plan)
    setattr(ddp_model, _STATE_ATTRIBUTE, handle)
    if previous is None:  # DDP takes one comm hook for its lifetime; later handles reuse it
        ddp_model.register_comm_hook(ddp_model, _reduce_bucket)
    return handle


def _reduce_bucket(ddp_model: nn.Module, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    handle: TrainedAllReduce = getattr(ddp_model, _STATE_ATTRIBUTE)
    return handle._reduce(bucket)


# DDP checks the hook's annotations as objects; postponed evaluation made them strings.
_reduce_bucket.__annotations__ = {
    "ddp_model": nn.Module,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}
