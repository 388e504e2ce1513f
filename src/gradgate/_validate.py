"""Validation of user options, with messages that name the value and the allowed ones."""

from __future__ import annotations

from collections.abc import Iterable

from ._errors import InvalidOptionError


def check_choice(option: str, value: object, allowed: Iterable[object]) -> None:
    """Raise :class:`InvalidOptionError` unless ``value`` is one of ``allowed``."""
    allowed = tuple(allowed)
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise InvalidOptionError(f"{option}={value!r} is not allowed; expected one of {choices}.")
