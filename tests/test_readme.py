"""README's first example runs, and its two set-up commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def test_first_example_runs_and_is_short() -> None:
    example = re.search(r"```python\n(.*?)```", README, re.DOTALL)
    assert example is not None
    code = example.group(1)
    assert len(code.strip().splitlines()) <= 10
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)
    model = namespace["model"]
    assert not model._forward_pre_hooks  # type: ignore[attr-defined]  # gate.remove() ran


def test_exactly_two_setup_commands_and_ci_runs_the_test_one() -> None:
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.DOTALL)
    assert len(commands) == 2
    demo, tests = commands
    assert demo.endswith("gradgate demo") and "torch==2.13.0" in demo
    assert tests.endswith("python -m pytest") and "torch==2.13.0" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()
