"""Tied weights under a freeze: one parameter, several modules, frozen for all of them."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .._plumbing.errors import SharedParameterWarning, warn
from .._select.names import Pattern, _match


def warn_tied_outside(
    model: nn.Module, patterns: Sequence[Pattern], params: list[tuple[str, nn.Parameter]]
) -> None:
    """Warn when a frozen parameter is also another, unmatched module's (``head.weight is
    emb.weight``): ``requires_grad`` belongs to the tensor, so that module stops learning too."""
    frozen = {id(param) for _, param in params}
    if not frozen:
        return
    wanted: set[str] = set()
    for pattern in patterns:
        wanted.update(_match(model, pattern, include_parameters=True))
    prefixes = tuple(f"{name}." for name in wanted)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in frozen:
            names.setdefault(id(param), []).append(name)
    for aliases in names.values():
        outside = [n for n in aliases if n not in wanted and not n.startswith(prefixes)]
        if "" not in wanted and outside and len(outside) < len(aliases):
            inside = next(n for n in aliases if n not in outside)
            warn(
                f"{inside!r} is tied to {outside[0]!r} (one tensor), so freezing it freezes "
                f"{outside[0]!r} too, which your patterns do not name. Name both to make it "
                f"explicit (gg.freeze(model, ..., {outside[0]!r}) silences this), or untie the "
                "weights if only one should stop learning.",
                SharedParameterWarning,
            )
