"""Every page under docs/ runs, and prints exactly what it shows.

The convention (stated at the top of docs/index.md):

* every ```python block of a page runs, in page order, in one namespace per page;
* a ```text block that directly follows a ```python block (blank lines between are allowed)
  is that block's expected standard output, compared exactly after stripping trailing
  whitespace from each line and blank lines at both ends;
* a ```python block with no ```text block after it must print nothing;
* other fences (```bash, ```dot, ...) are not run;
* a ```python block whose fence names modules after the language (```python deepspeed) runs
  only where they are installed; where one is missing the block and its output are left out,
  the rest of the page runs, and the test reports itself skipped, naming the module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gradgate._plumbing.torch_internals import TORCH_RELEASE

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
# Pages written before this convention, to be converted by their owner. Strict: the test fails
# as soon as the page passes, so the entry must then be removed.
FENCE = re.compile(r"^```([\w-]*)([^\n]*)\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


@dataclass
class Block:
    code: str
    line: int  # 1-based line of the block's first code line in the page
    expected: str | None
    needs: tuple[str, ...] = ()  # modules named after the language on the fence line


def parse(text: str) -> list[Block]:
    """The page's python blocks, each with the text block that follows it, if any."""
    fences = [
        (m.group(1), m.group(2), m.group(3), text.count("\n", 0, m.start()) + 2, m.start(), m.end())
        for m in FENCE.finditer(text)
    ]
    blocks = []
    for i, (lang, info, body, line, _, end) in enumerate(fences):
        if lang != "python":
            continue
        expected = None
        if i + 1 < len(fences):
            next_lang, _, next_body, _, next_start, _ = fences[i + 1]
            if next_lang == "text" and not text[end:next_start].strip():
                expected = next_body
        blocks.append(Block(body, line, expected, tuple(info.split())))
    return blocks


@contextlib.contextmanager
def prepared(needs: tuple[str, ...]):
    """What a block that needs an optional package runs under in this test."""
    with warnings.catch_warnings():
        # A page is code people copy: a deprecation that it triggers fails, whatever package
        # raises it (transformers attributes its own warnings to itself), so the pages use what
        # the installed (in CI, the newest) releases want.
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("error", category=category)
        # accelerate imports deepspeed where it is installed: its logger must come first too
        if "deepspeed" in needs or (
            "accelerate" in needs and importlib.util.find_spec("deepspeed")
        ):
            # deepspeed imports torch modules that warn of their own deprecation, and calls
            # collectives torch deprecates
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category, module=r"torch(\.|$)")
            import deepspeed.ops  # before stdout is redirected: its logger keeps the stream

            # it would JIT-compile a CPU shared-memory all-reduce (80 s on a fresh machine)
            # that one process never uses
            deepspeed.ops.__compatible_ops__ = {}
        # What a page sets for the process stays out of later tests: its launch environment
        # (a Trainer would then look for a process group) and the torch.nn.functional.linear
        # that ZeRO-3 replaces for good.
        environment, linear = dict(os.environ), torch.nn.functional.linear
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(environment)
            torch.nn.functional.linear = linear


def normalise(output: str) -> str:
    return "\n".join(line.rstrip() for line in output.strip("\n").splitlines()).strip("\n")


def test_there_are_pages() -> None:
    names = {page.relative_to(DOCS).as_posix() for page in PAGES}
    assert {"index.md", "concepts.md", "audit.md", "gradient-tools.md", "api.md"} <= names
    assert len([n for n in names if n.startswith("questions/")]) >= 10


def test_index_links_every_page() -> None:
    index = (DOCS / "index.md").read_text()
    links = set(re.findall(r"\]\(([^)#]+\.md)", index))
    pages = {page.relative_to(DOCS).as_posix() for page in PAGES} - {"index.md"}
    assert pages <= links, f"pages missing from docs/index.md: {sorted(pages - links)}"
    assert links <= pages, f"docs/index.md links to missing pages: {sorted(links - pages)}"


def test_parser_pairs_blocks_with_output() -> None:
    page = (
        "x\n```python\nprint(1)\n```\n\n```text\n1\n```\n```python\na = 2\n```\n```bash\nls\n```\n"
    )
    first, second = parse(page)
    assert (first.code, first.line, first.expected) == ("print(1)\n", 3, "1\n")
    assert (second.code, second.expected, second.needs) == ("a = 2\n", None, ())
    (third,) = parse("```python deepspeed\nimport deepspeed\n```\n")
    assert third.needs == ("deepspeed",)


# Pages whose code takes seconds (torch.compile, DDP, the audit tour, Lightning): run by CI,
# skipped by the quick run `python -m pytest -m "not slow"`.
SLOW_PAGES = {
    "audit.md",
    "distributed.md",
    "performance.md",
    "questions/backprop-last-k-layers.md",
    "schedules.md",
}


# Before torch 2.8 a fake forward of transformers' attention without a mask saves a little less
# than the real one, so the page's unmasked numbers differ there (tests/test_estimate.py).
_OLD_TORCH = TORCH_RELEASE < (2, 8)
NEEDS_TORCH_2_8 = {"depth-fits.md"}


def _param(page: Path) -> object:
    name = page.relative_to(DOCS).as_posix()
    marks = [pytest.mark.slow] if name in SLOW_PAGES else []
    if name in NEEDS_TORCH_2_8:
        marks.append(pytest.mark.skipif(_OLD_TORCH, reason="its numbers are torch 2.8's and on"))
    return pytest.param(page, id=name, marks=marks)


def test_slow_pages_exist() -> None:
    assert {page.relative_to(DOCS).as_posix() for page in PAGES} >= SLOW_PAGES


@pytest.mark.parametrize("page", [_param(page) for page in PAGES])
def test_page_runs_and_prints_what_it_shows(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # pages that write files write them here
    name = page.relative_to(DOCS).as_posix()
    namespace: dict[str, object] = {"__name__": f"docs.{name}"}
    missing = set()
    for block in parse(page.read_text()):
        absent = {m for m in block.needs if importlib.util.find_spec(m) is None}
        if absent:
            missing |= absent
            continue
        # pad with newlines so tracebacks give the line number in the .md page
        code = compile("\n" * (block.line - 1) + block.code, str(page), "exec")
        buffer = io.StringIO()
        with prepared(block.needs), contextlib.redirect_stdout(buffer):
            exec(code, namespace)
        printed = normalise(buffer.getvalue())
        expected = normalise(block.expected or "")
        assert printed == expected, (
            f"{name}, block at line {block.line}: printed output differs from the page\n"
            f"--- page shows\n{expected}\n--- code printed\n{printed}"
        )
    if missing:
        pytest.skip(
            f"{name}: the blocks that need {', '.join(sorted(missing))} did not run (not "
            "installed); the rest of the page ran and printed what it shows"
        )
