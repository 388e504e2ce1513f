"""CONTRIBUTING.md stays true to the tree: every file, folder and test it names exists, every
recipe names the tests to run, and its set-up installs the dev tools with a pinned torch."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
GUIDE = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
RECIPES = ("a schedule", "a planner optimizer", "a logged metric", "an integration")
RECIPES += ("a block-discovery rule",)


def _named_paths() -> set[str]:
    """Repository paths in backticks or links: a folder or a file with a suffix, with no
    placeholder (``<framework>``)."""
    quoted = re.findall(r"`([^`\s]+)`", GUIDE) + re.findall(r"\]\(([^)\s#]+)\)", GUIDE)
    return {
        path.split("::")[0]
        for path in quoted
        if ("/" in path or path.endswith((".py", ".md", ".toml")))
        and "<" not in path
        and not path.startswith(("http", "."))
    }


def test_every_path_the_guide_names_exists() -> None:
    paths = _named_paths()
    assert len(paths) > 20  # the parse found the recipes' files
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == []


def test_every_test_named_in_a_guide_exists_in_its_file() -> None:
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", GUIDE)
    assert named
    for path, test in named:
        assert f"def {test}(" in (ROOT / path).read_text(encoding="utf-8"), (path, test)


def test_each_recipe_lists_files_and_the_tests_to_run() -> None:
    sections = re.split(r"^### ", GUIDE, flags=re.MULTILINE)[1:]
    titles = [section.splitlines()[0] for section in sections]
    assert titles == [f"Add {recipe}" for recipe in RECIPES]
    for section in sections:
        assert "`src/gradgate/" in section, section.splitlines()[0]
        assert re.search(r"python -m pytest [^`]*tests/test_\w+\.py", section), section[:40]


def test_the_setup_installs_the_dev_tools_with_a_pinned_torch() -> None:
    (setup,) = re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", GUIDE)
    assert "pip install torch==" in setup and '-e ".[dev]"' in setup
    pyproject = (ROOT / "pyproject.toml").read_text()
    dev = pyproject.split("\ndev = [", 1)[1].split("\n]", 1)[0]  # the dev extra's list
    tools = set(re.findall(r'^\s*"([\w-]+)', dev, flags=re.MULTILINE))
    assert {"ruff", "mypy", "pytest", "hypothesis"} <= tools
    for command in ("ruff format src tests", "ruff check src tests", "mypy src"):
        assert command in GUIDE
    assert "python tests/test_api_reference.py" in GUIDE
