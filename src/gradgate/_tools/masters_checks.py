"""What LearnerMasters refuses, named exactly: options its inner optimizer does not take or
refuses, and a plain torch optimizer's state dict."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

import torch

from .._plumbing.errors import InvalidOptionError


def refuse_plain(
    index: object, param: torch.Tensor, entry: dict[str, Any], *, low: tuple[torch.dtype, ...]
) -> None:
    """A bf16/fp16 parameter's saved state with moments in its own dtype and no master is a
    plain torch optimizer's (LearnerMasters keeps them in fp32), loaded by mistake, or on
    purpose once upcast."""
    if param.dtype not in low or not isinstance(entry, dict) or "master" in entry:
        return
    kept = [k for k, v in entry.items()
            if k != "step" and isinstance(v, torch.Tensor) and v.dtype == param.dtype]  # fmt: skip
    if kept:
        raise InvalidOptionError(
            f"the state_dict's entry {index!r}, for a {tuple(param.shape)} {param.dtype} "
            f"parameter, holds {kept[0]} in {param.dtype} and no fp32 master: a plain torch "
            "optimizer's state, not LearnerMasters'; expected what LearnerMasters.state_dict() "
            "returned. To start from a plain optimizer's moments on purpose (masters are then "
            "made from the weights), upcast its moments to float32 first: for e in "
            "state['state'].values(): e.update({k: v.float() for k, v in e.items() if k != "
            "'step'})."
        )


def refused(
    optimizer_class: type[torch.optim.Optimizer],
    holders: list[dict[str, Any]],
    options: dict[str, Any],
    error: Exception,
) -> InvalidOptionError:
    """The error naming only the options ``optimizer_class`` refuses: those it does not take
    (with a close match), else those it refuses alone, else what torch said."""
    name = optimizer_class.__name__
    taken = inspect.signature(optimizer_class).parameters.values()
    known = None if any(p.kind is p.VAR_KEYWORD for p in taken) else [
        p.name for p in taken if p.name != "params"
    ]  # fmt: skip
    bad = []
    for key, value in options.items():
        if known is not None and key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]}=?)" if close else ""
            bad.append(f"{key}={value!r}, which {name} does not take{hint}")
    for key, value in options.items() if not bad else ():
        try:
            optimizer_class([{"params": h["params"]} for h in holders], **{key: value})
        except (TypeError, ValueError, RuntimeError) as alone:
            bad.append(f"{key}={value!r}: {str(alone).rstrip('.')}")
    listed = "; ".join(bad) if bad else str(error).rstrip(".")  # group options, or together
    takes = f": {', '.join(known)}" if known is not None else ""
    return InvalidOptionError(
        f"{name} refused the options it was given: {listed}; expected options that "
        f"{name}(params, ...) takes{takes}."
    )
