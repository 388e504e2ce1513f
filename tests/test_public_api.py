"""The public surface: ``__all__`` is pinned, the import is light, errors share one root."""

from __future__ import annotations

import subprocess
import sys

import gradgate as gg

PUBLIC = [
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


def test_all_is_pinned() -> None:
    assert sorted(gg.__all__) == sorted(PUBLIC)
    for name in gg.__all__:
        assert hasattr(gg, name), name


def test_every_error_derives_from_the_root() -> None:
    errors = [getattr(gg, n) for n in gg.__all__ if n.endswith("Error")]
    assert issubclass(gg.GradgateError, RuntimeError)
    assert all(issubclass(e, gg.GradgateError) for e in errors)
    warnings = [getattr(gg, n) for n in gg.__all__ if n.endswith("Warning")]
    assert all(issubclass(w, gg.GradgateWarning) for w in warnings)


def test_import_is_light() -> None:
    heavy = ["transformers", "graphviz", "matplotlib", "lightning", "rich", "sklearn", "tqdm"]
    heavy += ["torch._dynamo"]  # about a second to import; only torch.compile needs it
    # Compared with what ``import torch`` alone loads (torch itself may pull in tqdm).
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import gradgate\n"
        f"print(','.join(m for m in {heavy!r} if m in set(sys.modules) - before))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def test_public_submodules_load_on_first_use() -> None:
    code = (
        "import sys, gradgate as gg\n"
        "names = ('choose', 'distributed', 'integrations', 'optim', 'schedules')\n"
        "print([n for n in names if 'gradgate.' + n in sys.modules])\n"
        "print([getattr(gg, n).__name__ for n in names])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    loaded, modules = result.stdout.splitlines()
    assert loaded == "[]"
    assert modules == str([f"gradgate.{n}" for n in ("choose", "distributed", "integrations",
                                                     "optim", "schedules")])  # fmt: skip


def test_errors_and_warnings_live_in_one_module_named_gradgate() -> None:
    kinds = [getattr(gg, n) for n in gg.__all__ if n.endswith(("Error", "Warning"))]
    assert kinds
    assert {k.__module__ for k in kinds} == {"gradgate"}
    assert all(k is getattr(gg._plumbing.errors, k.__name__) for k in kinds)


def test_version_comes_from_package_metadata() -> None:
    from importlib.metadata import version

    assert gg.__version__ == version("gradgate")
