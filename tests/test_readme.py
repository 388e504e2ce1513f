"""README's first screen: the example runs on a plain install and prints what it shows, the two
set-up commands are the ones CI runs, and what it says about the demo and license is true."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

from gradgate import _demo
from gradgate._demo._page import REPORT_NAME

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
FIRST_EXAMPLE = re.search(r"```python\n(.*?)```\n\n```text\n(.*?)```", README, re.DOTALL)


def test_first_example_is_short_and_needs_only_torch() -> None:
    assert FIRST_EXAMPLE is not None
    code = FIRST_EXAMPLE.group(1)
    assert len(code.strip().splitlines()) <= 10
    imported = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported == {"torch", "gradgate"}
    before = README[: FIRST_EXAMPLE.start()]
    assert "`pip install torch==2.13.0 -e .`" in before  # the install it runs with


def test_first_example_prints_what_it_shows_and_warns_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert FIRST_EXAMPLE is not None
    code, shown = FIRST_EXAMPLE.groups()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the example
        exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr()
    assert (printed.out, printed.err) == (shown, "")


def test_exactly_two_setup_commands_and_ci_runs_the_test_one() -> None:
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.DOTALL)
    assert len(commands) == 2
    demo, tests = commands
    assert demo.endswith("gradgate demo") and "torch==2.13.0" in demo
    assert tests.endswith("python -m pytest") and "torch==2.13.0" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci
    # CI runs it as users do: in a clone named gradgate, with its .venv inside
    assert 'clone="$(mktemp -d)/gradgate"' in ci and 'cd "$clone"' in ci


def test_readme_says_where_the_demo_writes_its_report() -> None:
    assert f"`{_demo.DEFAULT_OUT / REPORT_NAME}`" in README
    assert "--out" in README


def test_license_is_the_one_pyproject_declares() -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License\n\nCopyright (c) 2026 the gradgate authors\n")
    assert 'license = { text = "MIT" }' in (ROOT / "pyproject.toml").read_text()
    assert "[LICENSE](LICENSE)" in README
