"""The package's structure: one private package per layer and a lower layer never imports a
higher one, no import circle, a tree anyone can scan, no source file over 450 lines, and the
audit and graph's plumbing comes from the shared modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gradgate"
LAYERS = ("_observe/audit", "_observe/graph")
SHARED = (
    "_plumbing/autograd.py",
    "_plumbing/tagging.py",
    "_plumbing/html.py",
    "_observe/check.py",
    "_observe/explain.py",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (SRC / relative).with_suffix(".py").exists() or (SRC / relative / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """The gradgate modules ``path`` imports (relative imports resolved)."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            target = ".".join([*base, node.module] if node.module else base)
            names = {f"{target}.{alias.name}" for alias in node.names}
            found.update(names)
            submodules = {n for n in names if _is_module(n)}
            if node.module or names - submodules:  # `from . import sub` needs no __init__
                found.add(target)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradgate"):
            found.add(str(node.module))
    return found


def _files() -> list[Path]:
    files = [p for layer in LAYERS for p in sorted((SRC / layer).glob("*.py"))]
    return files + [SRC / name for name in SHARED]


def _all_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in _all_files()}
    return {name: _imports(path) & set(modules) for name, path in modules.items()}


def test_no_import_circle() -> None:
    edges = _graph()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for target in edges.get(name, ()):
            visit(target, (*path, name))
        done.add(name)

    for name in edges:
        visit(name, ())


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_imports_its_own_package(layer: str) -> None:
    package = "gradgate." + layer.replace("/", ".")
    for path in (SRC / layer).glob("*.py"):
        if path.name != "__init__.py":
            assert package not in _imports(path), f"{path.name} imports {package} above it"


def test_no_source_file_over_450_lines() -> None:
    for path in _all_files():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= 450, f"{path.relative_to(SRC)} has {lines} lines"


def test_one_node_walk_and_one_saved_tensor_reader() -> None:
    for path in _files():
        if path == SRC / "_plumbing" / "autograd.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert "for fn, _ in node.next_functions if fn is not None" not in text, path
        assert 'startswith("_saved_")' not in text, path
        assert "saved_tensors_hooks(" not in text, path


def _dotted(node: ast.expr) -> str:
    """``torch._C._autograd`` for that attribute chain, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _private_torch(node: ast.AST) -> str:
    """The private torch name ``node`` uses, else ''."""
    if isinstance(node, ast.ImportFrom | ast.Import):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [alias.name for alias in node.names]
    elif isinstance(node, ast.Attribute):
        names = [_dotted(node)] if node.attr.startswith("_") else []
    else:
        return ""
    private = re.compile(r"^torch(\.\w+)*\._(?!_)|^\w+\._sequence_nr$")
    return next((name for name in names if private.search(name)), "")


def test_private_torch_apis_only_in_torch_internals() -> None:
    """Every private torch API is used in _plumbing/torch_internals, behind a feature check (the
    benchmarks may still reset dynamo and read its counters)."""
    for path in _all_files():
        parts = path.relative_to(SRC).parts
        if parts[:2] == ("_plumbing", "torch_internals") or "_bench" in parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = _private_torch(node)
            assert not name, f"{path.relative_to(SRC)}:{getattr(node, 'lineno', '?')}: {name}"


# -- the tree shows the layers ----------------------------------------------------------------
# Each private package is one layer; a module imports only from its own layer or lower ones.
# `_hooks` stays at the top for pickles (what a copied gated model names) and is plumbing.
LAYER_OF = {
    "_plumbing": 1,
    "_hooks": 1,
    "_select": 2,
    "_cut": 3,
    "_tools": 4,
    "_observe": 5,
    "_memory": 5,
}
TOP = 6  # the public modules, the command line, the demo and the bench


def _room(module: str) -> str:
    """The top-level entry of gradgate a module lies in ('' for gradgate itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int:
    return LAYER_OF.get(_room(module), TOP)


def test_a_lower_layer_never_imports_a_higher_one() -> None:
    upward = [
        f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
        for name, targets in _graph().items()
        for target in targets
        if _layer(target) > _layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_the_two_layers_of_layer_5_do_not_import_each_other() -> None:
    crossing = [
        f"{name} imports {target}"
        for name, targets in _graph().items()
        for target in targets
        if {_room(name), _room(target)} == {"_observe", "_memory"}
    ]
    assert not crossing, crossing


def test_every_private_package_is_a_layer_that_says_what_it_may_import() -> None:
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and p.name.startswith("_")}
    assert packages - {"_demo", "_bench", "__pycache__"} == set(LAYER_OF) - {"_hooks"}
    for name in set(LAYER_OF) - {"_hooks"}:
        doc = ast.get_docstring(ast.parse((SRC / name / "__init__.py").read_text()))
        assert doc and "May import" in doc, name


def test_a_tree_anyone_can_scan() -> None:
    """At most 18 entries at the top, at most about 12 modules in any folder (the layers', the
    demo's and the benchmark's, and each one's sub-folders)."""
    top = [p.name for p in SRC.iterdir() if p.name != "__pycache__"]
    assert len(top) <= 18, sorted(top)
    folders = [SRC / name for name in [*LAYER_OF, "_demo", "_bench"] if (SRC / name).is_dir()]
    for folder in folders:
        subs = [p for p in folder.rglob("*") if p.is_dir() and p.name != "__pycache__"]
        for sub in [folder, *subs]:
            modules = [p for p in sub.glob("*.py") if p.name != "__init__.py"]
            assert len(modules) <= 12, (sub.relative_to(SRC), len(modules))


# -- a gate's fields stay inside the cut ---------------------------------------------------
GATE_CLASSES = ("_cut/cut.py", "_cut/gate.py", "_cut/cut_blocks.py")


def _own_fields(path: Path) -> set[str]:
    """The private attributes a module's classes set on ``self`` (or annotate)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        targets = node.targets if isinstance(node, ast.Assign) else [target] if target else []
        for item in targets:
            for leaf in ast.walk(item):
                if isinstance(leaf, ast.Attribute) and _dotted(leaf.value) == "self":
                    found.add(leaf.attr)
                elif isinstance(leaf, ast.Name) and isinstance(node, ast.AnnAssign):
                    found.add(leaf.id)
    return {name for name in found if name.startswith("_") and not name.startswith("__")}


def _gate_field_reads(path: Path, fields: set[str]) -> list[str]:
    """``gate._points``, ``self.gate._model``, ``getattr(gate, "_keep")``: any private attribute
    read through a name that says gate, and the gate's own fields read through anything."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            owner = ast.unparse(node.value)
            if owner in ("self", "cls") or node.attr.startswith("__"):
                continue
            if "gate" in owner.lower() or node.attr in fields:
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {owner}.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and _dotted(node.func) in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            name, owner = str(node.args[1].value), ast.unparse(node.args[0])
            if name.startswith("_") and ("gate" in owner.lower() or name in fields):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {owner}.{name}")
    return found


def test_no_module_outside_the_cut_reads_a_gate_s_fields() -> None:
    """Layers above the cut ask it (``gg.learning``, ``_cut.gate.gate_points``, ...) instead of
    reading a gate's private fields, which change with the mechanism."""
    outside = [p for p in _all_files() if "_cut" not in p.relative_to(SRC).parts]
    theirs = set().union(*(_own_fields(p) for p in outside))
    fields = set().union(*(_own_fields(SRC / name) for name in GATE_CLASSES)) - theirs
    reads = [read for path in outside for read in _gate_field_reads(path, fields)]
    assert not reads, "\n".join(reads)
