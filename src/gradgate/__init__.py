"""gradgate: decide where gradients flow in a PyTorch model, and prove it.

>>> import torch, gradgate as gg
>>> net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
>>> gate = gg.BackpropGate(net)
>>> for depth in [1, 3]:
...     gate.depth = depth
...     net(torch.randn(2, 4)).sum().backward()
>>> gate.remove()
"""

from ._audit import AuditReport, audit
from ._capture import NoTensorError, capture_grads
from ._check import Finding, check
from ._compile import compile_blocks
from ._dot import GraphvizError, GraphvizNotFoundError
from ._errors import (
    AlreadyFrozenError,
    AmbiguousNameError,
    CheckpointAfterCutWarning,
    GradgateError,
    GradgateWarning,
    InvalidDepthError,
    InvalidOptionError,
    NoBlocksError,
    SharedParameterWarning,
    UnknownModuleError,
)
from ._explain import (
    ExplainedError,
    GraphFreedError,
    InferenceTensorError,
    SavedTensorModifiedError,
    explain,
)
from ._freeze import FreezeHandle, freeze, frozen, unfreeze
from ._gate import BackpropGate, StopGradient, backprop_depth, stop_gradient_at
from ._graph import Graph, NoGraphError, graph
from ._handles import Handle
from ._kernels import NoCudaError
from ._select import blocks, select
from ._transform import (
    TransformError,
    clip_grad,
    grad_transform,
    reverse_grad,
    scale_grad,
    zero_grad_of,
)

__version__ = "0.1.0"

__all__ = [
    "AlreadyFrozenError",
    "AmbiguousNameError",
    "AuditReport",
    "BackpropGate",
    "CheckpointAfterCutWarning",
    "ExplainedError",
    "Finding",
    "FreezeHandle",
    "GradgateError",
    "GradgateWarning",
    "Graph",
    "GraphFreedError",
    "GraphvizError",
    "GraphvizNotFoundError",
    "Handle",
    "InferenceTensorError",
    "InvalidDepthError",
    "InvalidOptionError",
    "NoBlocksError",
    "NoCudaError",
    "NoGraphError",
    "NoTensorError",
    "SavedTensorModifiedError",
    "SharedParameterWarning",
    "StopGradient",
    "TransformError",
    "UnknownModuleError",
    "__version__",
    "audit",
    "backprop_depth",
    "blocks",
    "capture_grads",
    "check",
    "clip_grad",
    "compile_blocks",
    "explain",
    "freeze",
    "frozen",
    "grad_transform",
    "graph",
    "reverse_grad",
    "scale_grad",
    "select",
    "stop_gradient_at",
    "unfreeze",
    "zero_grad_of",
]
