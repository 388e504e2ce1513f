"""docs/api.md documents every public name of ``gradgate.__all__``, from its signature and
docstring; it is generated, and this test fails when it is out of date.

Regenerate it after changing a public name, signature or docstring summary::

    python tests/test_api_reference.py
"""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import gradgate as gg

PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
REGENERATE = "python tests/test_api_reference.py"

# Where a name is defined (a part of its module's name) -> its section, in this order.
SECTIONS = [
    ("select", "Which modules: blocks and selection"),
    ("gate", "Where the graph starts: cuts and depth"),
    ("compile", "Where the graph starts: cuts and depth"),
    ("prefix_cache", "Skip the frozen prefix: the prefix cache"),
    ("freeze", "Which parameters learn: freezing"),
    ("handles", "Which parameters learn: freezing"),
    ("rows", "Which rows learn: new tokens"),
    ("transform", "How gradients are changed: transforms"),
    ("capture", "Inner gradients: capture"),
    ("audit", "What backward computed: audit"),
    ("estimate", "How deep can I afford: memory plans"),
    ("memory_plan", "How deep can I afford: memory plans"),
    ("graph", "What the graph looks like: graph"),
    ("check", "Classic mistakes: check and explain"),
    ("explain", "Classic mistakes: check and explain"),
    ("choose", "Choosing what learns: choose"),
    ("schedules", "Plans per step: schedules"),
    ("optim", "Optimizers"),
    ("distributed", "Scale out: distributed"),
    ("integrations", "Training frameworks: integrations"),
]
ERRORS = "Errors and warnings"
OTHER = "Other names"

HEADER = f"""\
# API reference

Every public name of `gradgate` (`import gradgate as gg`), grouped by what it answers, with its
signature and the summary from its docstring; `help(gg.name)` shows the whole docstring with
runnable examples. Options after `*` are keyword-only. Optional packages (matplotlib,
transformers, lightning, Graphviz's `dot`) load only when a feature that needs them is used.

This page is generated from `gradgate.__all__` and the docstrings (`{REGENERATE}`);
`tests/test_api_reference.py` fails when it is out of date. The guides explain the ideas:
[concepts](concepts.md), [audit](audit.md), [gradient tools](gradient-tools.md),
[graph](graph.md), [performance](performance.md).
"""


# The public submodules (DESIGN section 2b); they load on first use, so they may be absent from
# ``__all__``; documented either way.
SUBMODULES = ("choose", "distributed", "integrations", "optim", "schedules")


def public_names() -> list[str]:
    names = {name for name in gg.__all__ if name != "__version__"}
    return sorted(names | {name for name in SUBMODULES if hasattr(gg, name)})


def summary(obj: Any) -> str:
    """The first paragraph of the docstring, on one line, or an empty string."""
    doc = inspect.getdoc(obj) or ""
    first = doc.split("\n\n")[0].strip()
    if first.startswith(">>>"):
        return ""
    first = re.sub(r":(?:func|class|meth|mod|attr):`~?(?:gradgate\.)?([\w.]+)`", r"`gg.\1`", first)
    return " ".join(first.replace("``", "`").split())


def signature(obj: Callable[..., Any], name: str) -> str:
    """``name(arg, *, option=default)``: the call as written, without type annotations."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{name}(...)"
    bare = sig.replace(
        parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
        return_annotation=sig.empty,
    )
    return f"{name}{bare}"


def section_of(name: str, obj: Any) -> str:
    if isinstance(obj, type) and issubclass(obj, (gg.GradgateError, gg.GradgateWarning)):
        return ERRORS
    module = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "")
    parts = [part.lstrip("_") for part in module.split(".")]  # _gate and _cut.gate alike
    for key, title in SECTIONS:
        if key in parts:
            return title
    return OTHER


def members(cls: type) -> Iterator[tuple[str, Any]]:
    """Public methods and properties a class defines itself (not inherited from builtins)."""
    for name, value in vars(cls).items():
        if name.startswith("_") or name in getattr(cls, "__dataclass_fields__", {}):
            continue
        if isinstance(value, (property, classmethod, staticmethod)) or inspect.isfunction(value):
            yield name, value


def entry(name: str, obj: Any, prefix: str = "gg.", level: int = 3) -> list[str]:
    """The Markdown of one public name (a submodule: its public names, one level down)."""
    qualified = f"{prefix}{name}"
    lines = [f"{'#' * level} `{qualified}`", ""]
    if isinstance(obj, types.ModuleType):
        lines += [summary(obj) or f"The `{qualified}` submodule.", ""]
        for member in sorted(getattr(obj, "__all__", [])):
            lines += entry(member, getattr(obj, member), f"{qualified}.", level + 1)
        for module in submodules(obj):
            lines += entry(module.__name__.rpartition(".")[2], module, f"{qualified}.", level + 1)
        return lines
    if isinstance(obj, type) and issubclass(obj, BaseException):
        base = obj.__mro__[1].__name__
        return [*lines, f"*{'warning' if issubclass(obj, Warning) else 'error'}, a `{base}`*: "
                f"{summary(obj)}", ""]  # fmt: skip
    if callable(obj) and not (isinstance(obj, type) and issubclass(obj, enum.Enum)):
        lines += [f"`{signature(obj, qualified)}`", ""]
    lines += [summary(obj), ""]
    if isinstance(obj, type) and any(members(obj)):
        for member, value in members(obj):
            function = value.fget if isinstance(value, property) else value
            function = getattr(function, "__func__", function)
            if isinstance(value, property):
                shown = f"`.{member}`"
            else:
                call = signature(function, member)
                call = re.sub(r"\((self|cls)(, )?", "(", call, count=1)
                shown = f"`.{call}`"
            lines.append(f"- {shown}: {summary(function)}".rstrip(": "))
        lines.append("")
    return lines


def submodules(package: types.ModuleType) -> list[types.ModuleType]:
    """The public modules of a package that exports no names itself (``gg.integrations``)."""
    if getattr(package, "__all__", None) or not hasattr(package, "__path__"):
        return []
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name[0] != "_")
    return [importlib.import_module(f"{package.__name__}.{name}") for name in names]


def render() -> str:
    """The whole page, from ``gradgate.__all__`` and the docstrings."""
    grouped: dict[str, list[str]] = {}
    for name in public_names():
        obj = getattr(gg, name)
        grouped.setdefault(section_of(name, obj), []).append(name)
    order = [*list(dict.fromkeys(title for _, title in SECTIONS)), ERRORS, OTHER]
    lines = [HEADER]
    for title in order:
        if title not in grouped:
            continue
        lines += [f"## {title}", ""]
        for name in grouped[title]:
            lines += entry(name, getattr(gg, name))
    lines += ["## Version", "", "`gg.__version__`: the installed version, from the package "
              "metadata.", ""]  # fmt: skip
    return "\n".join(lines).rstrip("\n") + "\n"


def test_every_public_name_has_an_entry() -> None:
    text = PAGE.read_text()
    documented = set(re.findall(r"^### `gg\.([\w.]+)`$", text, re.MULTILINE))
    missing = sorted(set(public_names()) - documented)
    assert not missing, f"docs/api.md lacks {missing}; regenerate it: {REGENERATE}"
    stale = sorted(documented - set(public_names()))
    assert not stale, f"docs/api.md documents names that are not public: {stale}; {REGENERATE}"


def test_every_public_name_has_a_docstring_summary() -> None:
    lacking = [name for name in public_names() if not summary(getattr(gg, name))]
    for module in SUBMODULES:
        if hasattr(gg, module):
            names = getattr(getattr(gg, module), "__all__", [])
            lacking += [
                f"{module}.{n}" for n in names if not summary(getattr(getattr(gg, module), n))
            ]
    assert lacking == []


@pytest.mark.slow  # imports the integrations (transformers, Lightning): seconds
def test_page_is_up_to_date_with_signatures_and_docstrings() -> None:
    assert PAGE.read_text() == render(), f"docs/api.md is out of date; regenerate it: {REGENERATE}"


def test_signature_drops_annotations_and_keeps_keyword_only_options() -> None:
    def example(model: object, depth: int | None, *, blocks: list[str] | None = None) -> None:
        """Example."""

    assert signature(example, "gg.example") == "gg.example(model, depth, *, blocks=None)"


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE} ({len(public_names())} public names)", file=sys.stderr)
