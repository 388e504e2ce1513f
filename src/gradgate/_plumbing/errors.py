"""The exceptions and warnings gradgate raises: one root, one subclass per kind of mistake."""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import warnings


class GradgateError(RuntimeError):
    """Root of every error gradgate raises on purpose."""


class UnknownModuleError(GradgateError):
    """A name or pattern matched no module (or parameter) of the model."""


class AmbiguousNameError(GradgateError):
    """An exact name matched more than one module."""


class NoBlocksError(GradgateError):
    """No repeated block sequence could be found in the model."""


class AmbiguousBlocksError(NoBlocksError):
    """Several block sequences are equally plausible; the message lists them and a ``blocks=``."""


class BlockCallError(GradgateError):
    """A block ran in a way the cut cannot follow (e.g. a skipped block with no residual path)."""


class RankMismatchError(GradgateError):
    """Distributed ranks disagree on the plan (depth / learn / skip) for one step."""


class InvalidDepthError(GradgateError):
    """A backprop depth that is not an integer in ``0..n`` or ``None``."""


class InvalidOptionError(GradgateError):
    """An option given a value outside its allowed set."""


class AlreadyFrozenError(GradgateError):
    """A parameter is already frozen by another live gradgate handle."""


class AlreadyGatedError(GradgateError):
    """A second gate on blocks that a live gate of the same model already plans over."""


class HandleUsedError(GradgateError):
    """A handle was entered (``with``) after it was undone, or while already entered."""


class NoTensorError(GradgateError):
    """A module that should carry a gradient produced (or received) no tensor at all."""


class UnknownCaptureError(UnknownModuleError, KeyError):
    """A captured gradient looked up by a name that was not captured (also a ``KeyError``)."""

    __str__ = BaseException.__str__  # the message as written, not KeyError's quoted repr


class GradientNotReadyError(GradgateError, KeyError):
    """A captured gradient was read before any backward reached it (also a ``KeyError``)."""

    __str__ = BaseException.__str__


class NoGraphError(GradgateError):
    """The tensor given to :func:`graph` has no autograd graph to draw."""


class EstimateError(GradgateError):
    """:func:`estimate` cannot plan the model as given: its step needs tensor values (the
    message names the phase: forward, backward or optimizer step), or no example batch was
    given."""


class ExplainedError(GradgateError):
    """A PyTorch autograd error, re-raised by :func:`explain` with its cause and fix."""


class SavedTensorModifiedError(ExplainedError):
    """A tensor saved for backward was modified in place before backward used it."""


class GraphFreedError(ExplainedError):
    """Backward ran through a graph whose saved tensors an earlier backward had freed."""


class InferenceTensorError(ExplainedError):
    """A tensor created under ``torch.inference_mode`` was used in autograd."""


class GraphvizError(GradgateError):
    """Graphviz's ``dot`` program failed to render a graph."""


class GraphvizNotFoundError(GraphvizError):
    """Graphviz's ``dot`` program is not installed (Debian package ``graphviz``)."""


class NoCudaError(GradgateError):
    """The kernel view needs a CUDA device and none is available."""


class AuditNotReadyError(GradgateError):
    """An audit's results were read before it ran (or while it runs), or it was reused."""


class TransformError(GradgateError):
    """A gradient transform was given a bad function, or its function failed."""


class MissingExtraError(GradgateError):
    """An optional package a feature needs is not installed; the message gives the pip command."""


class TorchVersionError(GradgateError):
    """The installed torch lacks what a feature needs; the message names the torch to use."""


class RowsError(GradgateError):
    """``learn_rows`` cannot learn rows of this module, or the module changed under it."""


class PrefixCacheError(GradgateError):
    """A prefix cache would serve what the model no longer computes (a checked hit differs, a
    key's input changed, a directory holds another model's entries); the message names why."""


class GradgateWarning(UserWarning):
    """Root of every warning gradgate emits."""


class SharedParameterWarning(GradgateWarning):
    """A parameter is used both before a cut and after it: only the later use gets a gradient."""


class CheckpointAfterCutWarning(GradgateWarning):
    """Reentrant checkpointing right after a cut silently produces no gradients."""


class BlockCallWarning(GradgateWarning):
    """A block ran in an unusual way (skipped, repeated, out of order); the cut followed it."""


class NoBackwardWarning(GradgateWarning):
    """Gradients were expected and none were read: an audit saw a forward that built a graph
    but no backward (its gradient counts are 0), or ``Importance`` saw a training window with
    no ``observe()`` (its scores do not follow the gradients)."""


class PlanNotAppliedWarning(GradgateWarning):
    """A plan cannot act where it was set: on a backward whose forward ran under another plan
    (or before the ``with`` block), inside a module whose input already carries a graph, or on
    rows that ``learn_rows`` learns in a module that runs before a depth's cut."""


class PrefixCacheWarning(GradgateWarning):
    """A prefix cache cannot be exact here (a stochastic prefix), or cannot serve a cut."""


class MissingGradientWarning(GradgateWarning):
    """A parameter the plan says learns got no gradient in a backward, though the gradient
    reached its module (or would have, but for a ``detach``, reentrant checkpointing or a
    ``requires_grad`` changed after the forward); the message names the module and the cause."""


for _cls in list(globals().values()):
    if isinstance(_cls, type) and issubclass(_cls, (GradgateError, GradgateWarning)):
        _cls.__module__ = "gradgate"  # shown as gradgate.X in tracebacks and docs
del _cls


def warn(message: str, category: type[GradgateWarning]) -> None:
    """Warn, attributed to the line the user wrote: the first caller outside gradgate, torch
    and installed packages (a model's library code between the user and gradgate, the standard
    library). Where every caller is library code (a thread a library started), the first
    caller outside gradgate and torch."""
    ours, torch_root, libraries = _roots()
    callers: list[str] = []
    frame = sys._getframe(1)
    while frame is not None:
        callers.append(frame.f_code.co_filename)
        frame = frame.f_back  # type: ignore[assignment]
    outside = [i for i, name in enumerate(callers) if not name.startswith(ours)]
    level = next(
        (i for i in outside if not _is_library(callers[i], torch_root, libraries)),
        next((i for i in outside if not callers[i].startswith(torch_root)), None),
    )
    if level is None:
        level = outside[0] if outside else 0
    warnings.warn(message, category, stacklevel=level + 2)  # 2: this function's caller


def _is_library(filename: str, torch_root: str, libraries: tuple[str, ...]) -> bool:
    """Code the user did not write: torch, an installed package, the standard library."""
    return (
        filename.startswith((torch_root, *libraries, "<frozen "))
        or f"{os.sep}site-packages{os.sep}" in filename
        or f"{os.sep}dist-packages{os.sep}" in filename
    )


@functools.lru_cache(maxsize=1)
def _roots() -> tuple[str, str, tuple[str, ...]]:
    """Folders (each ending in a separator) of gradgate's own code, of torch, and of the
    interpreter's libraries. gradgate's from its top package, wherever this module lies."""
    top = sys.modules[__name__.partition(".")[0]]
    ours = _folder(top.__file__)  # as code objects name their files: no abspath
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    torch_root = _folder(torch_file) if torch_file else ours
    paths = sysconfig.get_paths()
    found = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    libraries = tuple(os.path.join(os.path.abspath(path), "") for path in sorted(found))
    return ours, torch_root, libraries


def _folder(file: str | None) -> str:
    return os.path.join(os.path.dirname(str(file)), "")
