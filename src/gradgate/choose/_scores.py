"""Scores: a module name -> score mapping that knows the shapes it was computed on, in JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from numbers import Real
from pathlib import Path
from typing import Any

from torch import nn

from .._plumbing.errors import InvalidOptionError

SCHEMA = "gradgate.snr/1"


class Scores(dict[str, float]):
    """Module name -> score, in model order, as :func:`gradgate.choose.snr` returns it.

    Besides the dict: ``shapes`` (each weight's shape as stored), ``model`` (the class name of
    the scanned model), ``complete`` (every 2-D weight was scanned) and ``types`` (each name's
    module type, see :func:`gradgate.choose.top`). :meth:`to_json` and :meth:`from_json` (or
    :meth:`save` and :func:`gradgate.choose.load`) keep a scan for later; given ``model=``,
    loading checks that the scores were computed for that model.

    >>> scores = Scores({"layers.0.q": 2.0, "layers.1.q": float("inf")},
    ...                 shapes={"layers.0.q": (4, 4), "layers.1.q": (4, 4)}, model="Net")
    >>> Scores.from_json(scores.to_json()) == scores, scores.types["layers.1.q"]
    (True, 'q')
    """

    def __init__(
        self,
        scores: Mapping[str, float] | Iterable[tuple[str, float]] = (),
        *,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
        model: str | None = None,
        complete: bool = False,
    ) -> None:
        super().__init__(scores)
        self.shapes: dict[str, tuple[int, ...]] = {k: tuple(v) for k, v in (shapes or {}).items()}
        self.model = model
        self.complete = complete

    @property
    def types(self) -> dict[str, str]:
        """Each name's module type: the part after the layer index (``self_attn.q_proj``)."""
        return {name: module_type(name) for name in self}

    # -- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> str:
        """The scores as JSON text (strict JSON: ``inf`` and ``nan`` are written as strings)."""
        modules = {
            name: {"score": _encode(score), "shape": list(self.shapes.get(name, ())),
                   "type": module_type(name)}
            for name, score in self.items()
        }  # fmt: skip
        document = {
            "schema": SCHEMA,
            "method": "spectrum",
            "model": self.model,
            "complete": self.complete,
            "modules": modules,
        }
        return json.dumps(document, indent=1)

    @classmethod
    def from_json(cls, text: str, *, model: nn.Module | None = None) -> Scores:
        """Scores from ``to_json()``'s text (or from a Spectrum ``snr_results`` file); with
        ``model``, refuse scores computed for another model."""
        try:
            document = json.loads(text)
        except (TypeError, ValueError) as error:
            raise InvalidOptionError(
                f"the text is not JSON ({error}); expected what Scores.to_json() wrote."
            ) from None
        scores = _parse(document)
        if model is not None:
            scores.check(model)
        return scores

    def save(self, path: str | Path) -> Path:
        """Write ``to_json()`` to ``path``; returns the path."""
        path = Path(path)
        path.write_text(self.to_json() + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path, *, model: nn.Module | None = None) -> Scores:
        """Read a file ``save()`` wrote (see ``from_json()``)."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"), model=model)

    # -- belonging to a model --------------------------------------------------------------------
    def check(self, model: nn.Module) -> None:
        """Refuse scores computed for another model: a name it lacks, a weight of another shape,
        or (for complete scores) a 2-D weight they lack."""
        modules = dict(model.named_modules())
        for name in self:
            module = modules.get(name)
            weight = getattr(module, "weight", None) if module is not None else None
            shape = tuple(weight.shape) if weight is not None and hasattr(weight, "shape") else None
            recorded = self.shapes.get(name)
            if module is None or shape is None or (recorded and recorded != shape):
                found = "no such module" if module is None else f"shape {shape}"
                raise InvalidOptionError(
                    f"these scores were computed for another model: {name!r} (recorded shape "
                    f"{recorded}) has {found} in {type(model).__name__}; expected scores of this "
                    "model: re-run gg.choose.snr(model)."
                )
        if self.complete:
            lacking = [n for n in matrix_names(model) if n not in self]
            if lacking:
                raise InvalidOptionError(
                    f"these scores were computed for another model: {type(model).__name__} has "
                    f"{len(lacking)} 2-D weights they lack ({lacking[0]!r}, ...); expected "
                    "scores of this model: re-run gg.choose.snr(model)."
                )

    def __repr__(self) -> str:
        return f"Scores({dict(self)!r})"


def module_type(name: str) -> str:
    """Spectrum's module type: the parts after the first all-digit one.

    A name with no such part is its own type; a name that ends in one counts its index as
    ``*`` (all the layers of one list are one type).

    >>> module_type("model.layers.3.self_attn.q_proj"), module_type("lm_head")
    ('self_attn.q_proj', 'lm_head')
    >>> module_type("features.4"), module_type("3")
    ('features.*', '*')
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isascii() and part.isdigit():
            rest = parts[i + 1 :]
            return ".".join(rest) if rest else ".".join([*parts[:i], "*"])
    return name


def matrix_names(model: nn.Module) -> list[str]:
    """Names of the modules that own a 2-D ``weight``, in model order."""
    return [name for name, module in model.named_modules() if has_matrix(module)]


def has_matrix(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 2


def _encode(score: float) -> float | str:
    return score if math.isfinite(score) else str(score)  # "inf", "-inf", "nan"


def _decode(name: str, value: Any) -> float:
    if isinstance(value, str) and value in ("inf", "-inf", "nan", "Infinity", "NaN"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, Real):
        raise InvalidOptionError(
            f"the score of {name!r} is {value!r}; expected a number (or 'inf'/'nan')."
        )
    return float(value)


def _parse(document: Any) -> Scores:
    """gradgate's format, or Spectrum's ``{name: {"snr": x, "type": t}}`` (no shapes)."""
    if isinstance(document, dict) and document.get("schema") == SCHEMA:
        modules = document.get("modules")
        if not isinstance(modules, dict) or not all(isinstance(v, dict) for v in modules.values()):
            raise InvalidOptionError(
                f"the {SCHEMA} document has modules={modules!r:.60}; expected "
                "{name: {'score': ..., 'shape': [...]}} as Scores.to_json() writes it."
            )
        return Scores(
            {name: _decode(name, entry.get("score")) for name, entry in modules.items()},
            shapes={name: tuple(entry.get("shape") or ()) for name, entry in modules.items()},
            model=document.get("model"),
            complete=document.get("complete") is True,
        )
    if (
        isinstance(document, dict)
        and document
        and all(isinstance(v, dict) and "snr" in v for v in document.values())
    ):
        return Scores({name: _decode(name, entry["snr"]) for name, entry in document.items()})
    raise InvalidOptionError(
        f"the JSON document {document!r:.80} is not a score file; expected what "
        f"Scores.to_json() wrote (schema {SCHEMA!r}) or a Spectrum snr_results file."
    )
