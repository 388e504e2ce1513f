"""Choose what learns: Spectrum's signal-to-noise scan of the weights, and its top fraction.

:func:`snr` scores every 2-D weight as Spectrum does (Hartford et al. 2024): the singular values
above the Marchenko-Pastur edge against those below it, over the largest singular value.
:func:`top` keeps the best fraction of each module type; the names it returns feed
``gate.learn``, :func:`gradgate.freeze`, ``gg.optim.LearnerMasters`` and
``gg.estimate(learn=...)``. :class:`gradgate.schedules.Importance` draws modules by their
gradients during training instead.

>>> import torch, gradgate as gg
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
>>> scores = gg.choose.snr(net, progress=False)
>>> list(scores) == ["0", "1", "2", "3"], all(s > 0 for s in scores.values())
(True, True)
>>> len(gg.choose.top(scores, 0.5))  # the 4 layers are one type, "*"
2
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from numbers import Real
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from .._plumbing.errors import InvalidOptionError
from .._plumbing.progress import Progress
from .._plumbing.validate import check_choice, fraction_option
from .._select.names import check_module, resolve_modules
from ._scores import Scores, has_matrix, module_type

__all__ = ["Scores", "load", "save", "snr", "top"]


def snr(
    model: nn.Module, modules: Iterable[str | int] | str | None = None, *, progress: bool = True
) -> Scores:
    """Spectrum's score of each 2-D weight: (sum of the singular values above the
    Marchenko-Pastur edge / sum of the others) / the largest singular value.

    ``modules=None`` scans every module that owns a 2-D ``weight`` (Linear, Embedding, GPT-2's
    Conv1D); names, globs or blocks scan those (a block stands for the 2-D weights inside it).
    One matrix at a time, in float32 whatever the weights' dtype, on the weights' device: the
    extra memory is one matrix and the SVD's workspace. Tied weights are scanned once. The
    singular values are ``S`` (descending) of the weight, taken tall (same values, faster);
    ``sigma = IQR(S) / 1.349``, ``beta = min(rows, cols) / max(rows, cols)``, and the edge is
    ``sigma * (1 + sqrt(beta))``. A weight with no singular value at or below the edge scores
    ``inf`` (common for elongated matrices), an all-zero weight ``0.0``. Scores compare well
    within a module type (same shape, similar scale), as :func:`top` uses them.
    """
    check_module(model)
    if not isinstance(progress, bool):
        raise InvalidOptionError(f"progress={progress!r}; expected True or False.")
    targets = _targets(model, modules)
    for name, weight in targets:
        _check_weight(name, weight)
    distinct = {id(weight): name for name, weight in reversed(targets)}
    bar = Progress(total=len(distinct), description="gg.choose.snr", enabled=progress)
    computed: dict[int, float] = {}
    try:
        for name, weight in targets:
            if id(weight) not in computed:
                computed[id(weight)] = spectrum_score(weight)
                bar.advance(name)
    finally:
        bar.close()
    return Scores(
        {name: computed[id(weight)] for name, weight in targets},
        shapes={name: tuple(weight.shape) for name, weight in targets},
        model=type(model).__name__,
        complete=modules is None,
    )


def spectrum_score(weight: torch.Tensor) -> float:
    """Spectrum's score of one matrix (see :func:`snr`), computed in float32 on its device."""
    with torch.no_grad():
        matrix = weight.detach().float()
        if matrix.shape[0] < matrix.shape[1]:
            matrix = matrix.T  # the same singular values; LAPACK is several times faster tall
        values = torch.linalg.svdvals(matrix)
        rows, cols = matrix.shape
        spread = (torch.quantile(values, 0.75) - torch.quantile(values, 0.25)) / 1.349
        edge = spread * (1 + math.sqrt(min(rows, cols) / max(rows, cols)))
        signal = values[values > edge].sum()
        noise = values[values <= edge].sum()
        largest = values[0]
        if largest.item() == 0:
            return 0.0
        if noise.item() == 0:
            return math.inf
        return float((signal / noise / largest).item())


def top(
    scores: Mapping[str, float], fraction: float = 0.25, per: Literal["type"] | None = "type"
) -> list[str]:
    """The module names with the best scores: the top ``fraction`` of each module type.

    A module's type is the part of its name after the layer index (``model.layers.3.mlp.up_proj``
    -> ``mlp.up_proj``); a name with no index is its own type, so ``lm_head`` or
    ``model.embed_tokens`` (one member) is picked only at ``fraction=1`` (add such names by hand,
    as Spectrum does). Each type keeps ``floor(members * fraction)``; ties keep the scores'
    order, NaN ranks last. ``per=None`` ranks all names together (scores compare badly across
    shapes). The names come back in the scores' (model) order.

    >>> top({"h.0.q": 3.0, "h.1.q": 1.0, "h.0.v": 0.5, "h.1.v": 2.0}, 0.5)
    ['h.0.q', 'h.1.v']
    """
    fraction = fraction_option("fraction", fraction, meaning="the share of each type to keep")
    check_choice("per", per, ("type", None))
    items = _score_items(scores)
    groups: dict[str, list[tuple[int, str, float]]] = {}
    for index, (name, score) in enumerate(items):
        key = module_type(name) if per == "type" else ""
        groups.setdefault(key, []).append((index, name, score))
    chosen: set[int] = set()
    for members in groups.values():
        count = math.floor(len(members) * fraction + 1e-9)
        ranked = sorted(members, key=lambda m: (math.isnan(m[2]), -m[2] if m[2] == m[2] else 0))
        chosen.update(index for index, _, _ in ranked[:count])
    if not chosen:
        largest = max(len(m) for m in groups.values())
        raise InvalidOptionError(
            f"top(fraction={fraction}) picks no module: each type has at most {largest} "
            f"member(s), and floor({largest} * {fraction}) = 0; expected a fraction of at "
            f"least {1 / largest:.4g}, or per=None to rank all {len(items)} names together."
        )
    return [items[i][0] for i in sorted(chosen)]


def save(scores: Mapping[str, float], path: str | Path) -> Path:
    """Write scores (from :func:`gradgate.choose.snr`) to a JSON file;
    :func:`gradgate.choose.load` reads it back."""
    found = scores if isinstance(scores, Scores) else Scores(_score_items(scores))
    return found.save(path)


def load(path: str | Path, *, model: nn.Module | None = None) -> Scores:
    """Read scores :func:`gradgate.choose.save` wrote; with ``model``, refuse scores of another
    model."""
    return Scores.load(path, model=model)


# -- helpers -------------------------------------------------------------------------------
def _targets(
    model: nn.Module, modules: Iterable[str | int] | str | None
) -> list[tuple[str, torch.Tensor]]:
    """(name, 2-D weight) to scan, in model order; named modules without one expand to the
    2-D weights inside them, or are refused."""
    if modules is None:
        found = [(name, m.weight) for name, m in model.named_modules() if has_matrix(m)]
        if not found:
            raise InvalidOptionError(
                f"{type(model).__name__} has no module with a 2-D weight; expected a model "
                "with Linear or Embedding layers."
            )
        return found
    items = [modules] if isinstance(modules, str) else list(modules)
    if not items:
        raise InvalidOptionError(
            "modules=[] is empty; expected module names or globs to scan (e.g. "
            "'model.layers.*.mlp.*_proj'), or modules=None for every 2-D weight."
        )
    picked: dict[str, torch.Tensor] = {}
    for item in items:
        found = resolve_modules(model, [item])
        matrices = [
            (f"{name}.{inner}" if inner else name, m.weight)
            for name, module in found
            for inner, m in module.named_modules()
            if has_matrix(m)
        ]
        if not matrices:  # a glob may match activations too; it must reach some matrix
            name, module = found[0]
            raise InvalidOptionError(
                f"the module {name!r} ({type(module).__name__}) has {_weight_of(module)} and "
                "no 2-D weight inside it; expected modules with a 2-D weight, e.g. Linear "
                "layers ('model.layers.*.mlp.*_proj')."
            )
        picked.update(matrices)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(picked.items(), key=lambda item: order[item[0]])


def _weight_of(module: nn.Module) -> str:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return f"a {weight.dim()}-D weight of shape {tuple(weight.shape)}"
    return "no weight"


def _check_weight(name: str, weight: torch.Tensor) -> None:
    if weight.is_meta:
        raise InvalidOptionError(
            f"the weight of {name!r} is on the meta device (no values); expected real weights: "
            "load them first (e.g. from_pretrained without device_map='meta')."
        )
    if not weight.is_floating_point():
        raise InvalidOptionError(
            f"the weight of {name!r} has dtype {weight.dtype} (quantised?); expected a "
            "floating-point weight: scan the unquantised model."
        )
    if weight.numel() == 0:
        raise InvalidOptionError(
            f"the weight of {name!r} has shape {tuple(weight.shape)}, with no entries; expected "
            "a matrix with rows and columns."
        )


def _score_items(scores: object) -> list[tuple[str, float]]:
    if not isinstance(scores, Mapping):
        raise InvalidOptionError(
            f"scores={scores!r:.60} ({type(scores).__name__}); expected a mapping of module "
            "names to scores, as gg.choose.snr(model) returns."
        )
    if not scores:
        raise InvalidOptionError(
            "scores={} is empty; expected the scores of at least one module, as "
            "gg.choose.snr(model) returns."
        )
    items = []
    for name, score in scores.items():
        if not isinstance(name, str) or isinstance(score, bool) or not isinstance(score, Real):
            raise InvalidOptionError(
                f"scores[{name!r}] = {score!r}; expected module names mapped to numbers."
            )
        items.append((name, float(score)))
    return items
