"""gradgate: decide where gradients flow in a PyTorch model, and prove it.

>>> import torch, gradgate as gg
>>> net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
>>> gate = gg.BackpropGate(net)
>>> for depth in [1, 3]:
...     gate.depth = depth
...     net(torch.randn(2, 4)).sum().backward()
>>> gate.remove()
"""

# ruff: noqa: I001  (imports are grouped by concern, in the order data flows, not sorted)

from importlib import import_module as _import_module
from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _version
from typing import Any as _Any

# select: which modules?
from ._select.names import blocks, select

# gate: where does the graph start?
from ._cut.gate import BackpropGate, StopGradient, backprop_depth, stop_gradient_at
from ._cut.compile import compile_blocks

# skip the frozen prefix: later epochs read the first learner's input
from ._cut.prefix_cache import PrefixCache

# freeze: which parameters learn?
from ._tools.freeze import FreezeHandle, UnfreezeHandle, freeze, frozen, unfreeze
from ._tools.learning import Learning, learning
from ._plumbing.handles import Handle

# learn rows: only some rows of an embedding or a head learn (new tokens)
from ._tools.rows import RowsHandle, learn_rows

# transform: how are gradients changed?
from ._tools.transform import (
    TransformHandle,
    clip_grad,
    grad_transform,
    reverse_grad,
    scale_grad,
    zero_grad_of,
)

# capture: what are the inner gradients?
from ._tools.capture import CaptureHandle, capture_grads

# audit: what did backward compute?
from ._observe.audit import AuditReport, audit

# estimate: how deep can I afford? memory per depth, planned on fake tensors
from ._memory.estimate import estimate
from ._memory.memory_plan import MemoryPlan, MemoryRow

# graph: what does the graph look like?
from ._observe.graph import Graph, graph

# check and explain: which classic mistakes are present?
from ._observe.check import Finding, check
from ._observe.explain import explain

# errors and warnings
from ._plumbing.errors import (
    AlreadyFrozenError,
    AlreadyGatedError,
    AmbiguousBlocksError,
    AmbiguousNameError,
    AuditNotReadyError,
    BlockCallError,
    BlockCallWarning,
    CheckpointAfterCutWarning,
    EstimateError,
    ExplainedError,
    GradgateError,
    GradgateWarning,
    GradientNotReadyError,
    GraphFreedError,
    GraphvizError,
    GraphvizNotFoundError,
    HandleUsedError,
    InferenceTensorError,
    InvalidDepthError,
    InvalidOptionError,
    MissingExtraError,
    MissingGradientWarning,
    NoBackwardWarning,
    NoBlocksError,
    NoCudaError,
    NoGraphError,
    NoTensorError,
    PlanNotAppliedWarning,
    PrefixCacheError,
    PrefixCacheWarning,
    RankMismatchError,
    RowsError,
    SavedTensorModifiedError,
    SharedParameterWarning,
    TorchVersionError,
    TransformError,
    UnknownCaptureError,
    UnknownModuleError,
)

try:
    __version__ = _version("gradgate")
except _NotInstalled:  # a source tree that was never installed
    __version__ = "0+unknown"

# Submodules with optional or heavier parts load on first attribute access (light import).
_SUBMODULES = ("choose", "distributed", "integrations", "optim", "schedules")


def __getattr__(name: str) -> _Any:
    if name in _SUBMODULES:
        return _import_module(f".{name}", __name__)
    raise AttributeError(f"module 'gradgate' has no attribute {name!r}")


__all__ = [
    "AlreadyFrozenError",
    "AlreadyGatedError",
    "AmbiguousBlocksError",
    "AmbiguousNameError",
    "AuditNotReadyError",
    "AuditReport",
    "BackpropGate",
    "BlockCallError",
    "BlockCallWarning",
    "CaptureHandle",
    "CheckpointAfterCutWarning",
    "EstimateError",
    "ExplainedError",
    "Finding",
    "FreezeHandle",
    "GradgateError",
    "GradgateWarning",
    "GradientNotReadyError",
    "Graph",
    "GraphFreedError",
    "GraphvizError",
    "GraphvizNotFoundError",
    "Handle",
    "HandleUsedError",
    "InferenceTensorError",
    "InvalidDepthError",
    "InvalidOptionError",
    "Learning",
    "MemoryPlan",
    "MemoryRow",
    "MissingExtraError",
    "MissingGradientWarning",
    "NoBackwardWarning",
    "NoBlocksError",
    "NoCudaError",
    "NoGraphError",
    "NoTensorError",
    "PlanNotAppliedWarning",
    "PrefixCache",
    "PrefixCacheError",
    "PrefixCacheWarning",
    "RankMismatchError",
    "RowsError",
    "RowsHandle",
    "SavedTensorModifiedError",
    "SharedParameterWarning",
    "StopGradient",
    "TorchVersionError",
    "TransformError",
    "TransformHandle",
    "UnfreezeHandle",
    "UnknownCaptureError",
    "UnknownModuleError",
    "__version__",
    "audit",
    "backprop_depth",
    "blocks",
    "capture_grads",
    "check",
    "clip_grad",
    "compile_blocks",
    "estimate",
    "explain",
    "freeze",
    "frozen",
    "grad_transform",
    "graph",
    "learn_rows",
    "learning",
    "reverse_grad",
    "scale_grad",
    "select",
    "stop_gradient_at",
    "unfreeze",
    "zero_grad_of",
]
