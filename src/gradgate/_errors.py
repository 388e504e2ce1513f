"""The exceptions and warnings gradgate raises: one root, one subclass per kind of mistake."""

from __future__ import annotations

import os
import sys
import warnings


class GradgateError(RuntimeError):
    """Root of every error gradgate raises on purpose."""


class UnknownModuleError(GradgateError):
    """A name or pattern matched no module (or parameter) of the model."""


class AmbiguousNameError(GradgateError):
    """An exact name matched more than one module."""


class NoBlocksError(GradgateError):
    """No repeated block sequence could be found in the model."""


class InvalidDepthError(GradgateError):
    """A backprop depth that is not an integer in ``0..n`` or ``None``."""


class InvalidOptionError(GradgateError):
    """An option given a value outside its allowed set."""


class AlreadyFrozenError(GradgateError):
    """A parameter is already frozen by another live gradgate handle."""


class GradgateWarning(UserWarning):
    """Root of every warning gradgate emits."""


class SharedParameterWarning(GradgateWarning):
    """A parameter is used both before a cut and after it: only the later use gets a gradient."""


class CheckpointAfterCutWarning(GradgateWarning):
    """Reentrant checkpointing right after a cut silently produces no gradients."""


def warn(message: str, category: type[GradgateWarning]) -> None:
    """Warn, attributed to the first caller outside gradgate (the line the user wrote)."""
    package = os.path.dirname(__file__)
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    warnings.warn(message, category, stacklevel=level)
