"""What did backward compute? Per-module wgrad, dgrad, backward FLOPs, saved bytes and time.

Counting rule (the seeds' kernel tables, per autograd node instead of per kernel):

* **wgrad** — one per autograd node that computes a gradient for at least one parameter
  (a conv's weight and bias come from one node: one wgrad);
* **dgrad** — one per autograd node that computes a gradient for an activation input (any
  input that is not a parameter), which autograd does only when something upstream needs it;
* layout-only nodes (views, transposes, reshapes, expands, casts) count as neither, and a
  gradient passing through them to a parameter still counts as that parameter's wgrad.

Layout: ``records`` (the figures and their columns), ``render`` (text, HTML, JSON),
``flops`` (FLOP formulas), ``kernels`` (the GPU kernel view), ``recorder`` (the hooks),
``report`` (:class:`AuditReport`, the public result).
"""

from __future__ import annotations

import torch
from torch import nn

from ..._plumbing.errors import InvalidOptionError
from ..._select.names import check_module
from .kernels import require_cuda
from .records import ModuleRecord, WastedGradient
from .report import AuditReport

__all__ = ["AuditReport", "ModuleRecord", "WastedGradient", "audit"]


def audit(
    model: nn.Module,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    kernels: bool = False,
) -> AuditReport:
    """Record what the backward passes run inside the block computed for ``model``.

    Returns an :class:`AuditReport`, to be used once as a context manager; read it after the
    block. Run the forward and the backward inside (everything is measured), or the backward
    only, with the forward run before (no saved bytes; nodes are attributed to the module whose
    parameters they use, the rest to ``report.outside``). With ``optimizer``, gradients of
    parameters it does not hold are listed as wasted. With ``kernels=True`` (CUDA only) the
    step also runs under ``torch.profiler`` and ``report.kernels`` gives the seeds' Nsight
    table. Every hook is removed on exit, also when the block raises.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Conv2d(3, 3, 3) for _ in range(10)])
    >>> with gg.audit(net) as report:
    ...     net(torch.randn(2, 3, 24, 24)).mean().backward()
    >>> report.totals["wgrad"], report.totals["dgrad"]
    (10, 9)
    """
    _check_arguments(model, optimizer, kernels)
    return AuditReport._recording(model, optimizer, kernels=kernels)


def _check_arguments(model: object, optimizer: object, kernels: object) -> None:
    if not isinstance(model, nn.Module):
        raise InvalidOptionError(
            f"gg.audit(model=...) got {type(model).__name__} {_short(model)}; expected a "
            "torch.nn.Module: pass the model whose backward you want to audit."
        )
    check_module(model)  # a lazy model: refused with the fix before any hook goes on
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidOptionError(
            f"gg.audit(optimizer=...) got {type(optimizer).__name__} {_short(optimizer)}; "
            "expected a torch.optim.Optimizer instance or None, e.g. "
            "gg.audit(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))."
        )
    if not isinstance(kernels, bool):
        raise InvalidOptionError(f"gg.audit(kernels=...) got {kernels!r}; expected True or False.")
    if kernels:
        require_cuda()


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
