"""Run gradgate's test suite on a list of torch releases and write docs/compatibility.md.

One virtual environment per torch release, under .torch-matrix/ (git-ignored): ``torch==X``
plus the requirements of this checkout's ``dev`` extra, with a transformers release that
supports that torch, then gradgate itself (editable, without its dependencies, so that releases
below the declared floor can be measured too). The suite runs in a copy of the checkout made
when the release's turn comes, so edits meanwhile do not change what it tests.
Each run adds or replaces its row in docs/compatibility.json and rewrites the table in
docs/compatibility.md from it, so releases can be run one at a time. A row records the commit
it ran on and a fingerprint of the files it tested, so rows run on other code stand out.

    python tools/torch_matrix.py 2.6.0 2.15.0            # non-slow suite, venvs deleted after
    python tools/torch_matrix.py 2.13.0 --whole-suite --keep
    python tools/torch_matrix.py --stale                 # rows not run on the checkout's code

Stdlib only (Python 3.11+ for tomllib): it runs before any dependency is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / ".torch-matrix"
RESULTS_JSON = ROOT / "docs" / "compatibility.json"
RESULTS_MD = ROOT / "docs" / "compatibility.md"
NON_SLOW = ["-m", "not slow"]
# what each run writes: not part of the code a row ran on
RESULTS = tuple(str(path.relative_to(ROOT)) for path in (RESULTS_JSON, RESULTS_MD))


def version_tuple(version: str) -> tuple[int, ...]:
    """'2.4.1' or '2.13.0+cpu' -> (2, 4, 1), for ordering and comparisons."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3])


def transformers_requirement(torch_version: str) -> str:
    """transformers 5 needs torch>=2.6 (it disables its torch models below that); 4.57 is
    the last 4.x release and supports torch 2.2 to 2.5."""
    if version_tuple(torch_version) < (2, 6):
        return "transformers>=4.45,<5"
    return "transformers>=5"


def run(cmd: list[str], log, *, cwd: Path, env: dict[str, str] | None = None) -> int:
    """Run `cmd` with stdout and stderr appended to `log`; return its exit status."""
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)


def git(*args: str) -> str:
    """The output of a git command that only reads (no index refresh either)."""
    cmd = ["git", "--no-optional-locks", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout.strip()


def checkout_files() -> list[str]:
    """The checkout's files, tracked and untracked but not ignored, sorted."""
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    return sorted(name for name in set(listed) if name and (ROOT / name).is_file())


def fingerprint(tree: Path, names: list[str]) -> str:
    """A short hash of the files' names and contents, the results this tool writes aside:
    equal for the same code, committed or not (``-dirty`` says only that there were edits)."""
    digest = hashlib.sha256()
    for name in names:
        if name not in RESULTS:
            digest.update(name.encode() + b"\0" + (tree / name).read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def current_commit() -> str:
    """The checkout's commit, ``-dirty`` when the files tested are not those of the commit
    (uncommitted edits, untracked files), the results this tool writes aside: so that a
    release run after another in one call is not marked dirty by the row written before it."""
    head = git("rev-parse", "--short", "HEAD") or "?"
    outside = [f":(exclude){name}" for name in RESULTS]
    edits = git("status", "--porcelain", "--untracked-files=all", "--", ".", *outside)
    return f"{head}-dirty" if edits else head


def snapshot(target: Path) -> tuple[str, str]:
    """Copy the checkout's files to `target`, so that edits made while a release is tested do
    not change what it tests; returns the commit and the fingerprint of the copy."""
    shutil.rmtree(target, ignore_errors=True)
    commit, names = current_commit(), checkout_files()
    for name in names:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)
    return commit, fingerprint(target, names)


def install_env(venv: Path) -> dict[str, str]:
    """pip settings for the install: no cache (each torch is gigabytes) and an empty
    constraint file, so that a machine-wide cap on torch cannot override the pinned release."""
    empty = VENVS / "no-constraints.txt"
    empty.write_text("")
    env = dict(os.environ, PIP_CONSTRAINT=str(empty), PIP_NO_CACHE_DIR="1")
    env.pop("PYTHONPATH", None)
    env["VIRTUAL_ENV"] = str(venv)
    return env


def dev_requirements(tree: Path) -> list[str]:
    """The requirements of the project's ``dev`` extra, its own extras expanded, torch left
    out (each run pins it)."""
    project = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def expand(extra: str) -> list[str]:
        found = []
        for requirement in extras[extra]:
            name, _, rest = requirement.partition("[")
            if name == project["name"]:
                for inner in rest.rstrip("]").split(","):
                    found += expand(inner.strip())
            else:
                found.append(requirement)
        return found

    return sorted(set(expand("dev")))


def make_venv(torch_version: str, python: str, tree: Path, log) -> Path:
    """A fresh venv with torch==`torch_version` and the dev extra of `tree` installed."""
    venv = VENVS / f"torch-{torch_version}"
    shutil.rmtree(venv, ignore_errors=True)  # a venv records its path: made here, used here
    if run([python, "-m", "venv", str(venv)], log, cwd=ROOT) != 0:
        raise RuntimeError(f"could not create {venv}")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-cache-dir"]
    # gradgate itself without its dependencies: a release below the declared floor installs too
    packages = [
        f"torch=={torch_version}",
        *dev_requirements(tree),
        transformers_requirement(torch_version),
    ]
    env = install_env(venv)
    if run(pip + packages, log, cwd=tree, env=env) or run(
        [*pip, "--no-deps", "-e", "."], log, cwd=tree, env=env
    ):
        raise RuntimeError(f"pip install of torch=={torch_version} failed (see the log)")
    return venv


def installed_version(venv: Path, package: str) -> str:
    out = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            f"import importlib.metadata as m; print(m.version({package!r}))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "?"


def count_junit(path: Path) -> dict[str, object]:
    """passed / failed / skipped counts and the failing test ids from a pytest junit file."""
    suites = ET.parse(path).getroot()
    failed_ids, passed, skipped = [], 0, 0
    for case in suites.iter("testcase"):
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            failed_ids.append(f"{case.get('classname')}::{case.get('name')}")
        elif "skipped" in outcome:
            skipped += 1
        else:
            passed += 1
    return {"passed": passed, "failed": len(failed_ids), "skipped": skipped, "failures": failed_ids}


def test_command(whole_suite: bool) -> list[str]:
    return ["python", "-m", "pytest", "-q", *([] if whole_suite else NON_SLOW)]


def run_suite(venv: Path, tree: Path, whole_suite: bool, timeout_s: int, log) -> dict[str, object]:
    junit = venv / "junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [str(venv / "bin" / "python"), *test_command(whole_suite)[1:], f"--junitxml={junit}"]
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    env.pop("PIP_CONSTRAINT", None)
    try:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return {
            "passed": 0,
            "failed": 0,
            "skipped": 0,
            "failures": [f"timed out after {timeout_s} s"],
        }
    if not junit.exists():
        return {"passed": 0, "failed": 0, "skipped": 0, "failures": ["pytest wrote no report"]}
    return count_junit(junit)


@contextlib.contextmanager
def results_lock() -> Iterator[None]:
    """Held while the results are read and rewritten: several runs may share them."""
    VENVS.mkdir(exist_ok=True)
    with (VENVS / "results.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load_results() -> dict[str, dict[str, object]]:
    if RESULTS_JSON.exists():
        return json.loads(RESULTS_JSON.read_text())
    return {}


def save_results(results: dict[str, dict[str, object]]) -> None:
    ordered = dict(sorted(results.items(), key=lambda item: version_tuple(item[0])))
    RESULTS_JSON.write_text(json.dumps(ordered, indent=1) + "\n")
    RESULTS_MD.write_text(render(ordered))


def render(results: dict[str, dict[str, object]]) -> str:
    lines = [
        "# Compatibility: torch releases",
        "",
        "The test suite run on each torch release, one fresh virtual environment each, written by",
        "`tools/torch_matrix.py` (do not edit the table by hand; run the script). The command,",
        "from the repository root (CPU; torch is PyPI's default build of each release):",
        "",
        "```bash",
        "python3 tools/torch_matrix.py 2.6.0 2.7.1 2.8.0 2.9.1 2.10.0 2.11.0 2.12.1 2.13.0 \\",
        "    2.14.1 2.15.0",
        "```",
        "",
        "Each environment gets `torch==X` with the requirements of the `dev` extra and a",
        "transformers release for that torch (5.x from torch 2.6, the last 4.x below it:",
        "transformers 5 needs torch 2.6), then gradgate itself (`pip install --no-deps -e .`), and",
        "runs the suite shown in the *suite* column in a copy of the checkout at *commit*.",
        "`pyproject.toml` declares the oldest release on which it all passes as the floor.",
        "",
        "*commit* is the commit the row ran on, `-dirty` where the checkout had changes not yet",
        "committed (then only *code* identifies them): *code* is a fingerprint of the files",
        "tested, so rows with the same *code* ran on the same code. A row is current when its",
        "*code* is the checkout's; `python3 tools/torch_matrix.py --stale` lists the rows that",
        "are not (run at least the floor's row again after a change).",
        "",
        "What differs by release (the tests say so where they run):",
        "",
        "- torch 2.6 and 2.7: under `torch.compile(model)` the gated forward runs eagerly (one",
        "  graph break at the gate, blocks uncompiled, gradients exact). 2.6 cannot tell dynamo to",
        "  skip the gate's frames; 2.7 can, but compiling again after such a compile segfaults it.",
        "- torch 2.6 and 2.7: `gg.compile_blocks` applied after the gate breaks each block's",
        "  graph at the gate's hooks (gradients exact); apply it before the gate.",
        "- torch 2.6: FSDP2 does not run on the CPU (torch calls `Stream.record_event`), so the",
        "  FSDP2 tests skip there; on CUDA it is untested.",
        "- torch 2.6 and 2.7: `gg.estimate` of a transformers model called without an attention",
        "  mask saves a little less in the fake attention than a real step (12 kB on the tiny",
        "  Llama of the tests); with a mask, or from torch 2.8 on, it equals `gg.audit`.",
        "",
        "| torch | transformers | passed | failed | skipped | suite | date | Python | commit "
        "| code |",
        "| --- | --- | ---: | ---: | ---: | --- | --- | --- | --- | --- |",
    ]
    for version, row in results.items():
        lines.append(
            f"| {version} | {row['transformers']} | {row['passed']} | {row['failed']} | "
            f"{row['skipped']} | `{row['command']}` | {row['date']} | {row['python']} | "
            f"{row.get('commit', '?')} | {row.get('code', '?')} |"
        )
    failing = {v: row for v, row in results.items() if row["failures"]}
    if failing:
        lines += ["", "## Failures", ""]
        for version, row in failing.items():
            lines.append(f"torch {version}:")
            lines.append("")
            lines += [f"- `{test_id}`" for test_id in row["failures"]]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def run_one(torch_version: str, args: argparse.Namespace) -> dict[str, object]:
    VENVS.mkdir(exist_ok=True)
    log_path = VENVS / f"torch-{torch_version}.log"
    tree = Path(tempfile.gettempdir()) / "gradgate-torch-matrix" / torch_version
    commit, code = snapshot(tree)
    with log_path.open("w") as log:
        venv = make_venv(torch_version, args.python, tree, log)
        try:
            row = run_suite(venv, tree, args.whole_suite, args.timeout, log)
            row["transformers"] = installed_version(venv, "transformers")
            row["torch"] = installed_version(venv, "torch")
        finally:
            if not args.keep:
                shutil.rmtree(venv, ignore_errors=True)
                shutil.rmtree(tree, ignore_errors=True)
    row["commit"], row["code"] = commit, code
    row["command"] = " ".join(test_command(args.whole_suite))
    row["date"] = datetime.date.today().isoformat()
    row["python"] = platform.python_version()
    return row


def stale_rows() -> list[str]:
    """One line per recorded row that did not run on the checkout's code as it is now."""
    code, commit = fingerprint(ROOT, checkout_files()), current_commit()
    return [
        f"torch {version}: ran on {row.get('commit', '?')} (code {row.get('code', '?')}); "
        f"the checkout is {commit} (code {code})"
        for version, row in load_results().items()
        if row.get("code") != code
    ]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("versions", nargs="*", help="torch releases, e.g. 2.6.0 2.15.0")
    parser.add_argument(
        "--stale", action="store_true", help="list the rows not run on the checkout's code"
    )
    parser.add_argument("--whole-suite", action="store_true", help="slow tests too")
    parser.add_argument("--keep", action="store_true", help="keep each venv after its run")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the venvs")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per suite run")
    args = parser.parse_args(argv)
    if bool(args.versions) == args.stale:
        parser.error("give torch releases to run, or --stale alone")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.stale:
        stale = stale_rows()
        print("\n".join(stale) if stale else "every row ran on the checkout's code")
        return 1 if stale else 0
    worst = 0
    for version in args.versions:
        print(f"torch {version}: installing and testing (log: .torch-matrix/torch-{version}.log)")
        try:
            row = run_one(version, args)
        except RuntimeError as error:
            print(f"torch {version}: {error}")
            worst = 2
            continue
        with results_lock():
            results = load_results()
            results[version] = row
            save_results(results)
        print(
            f"torch {version}: {row['passed']} passed, {row['failed']} failed, "
            f"{row['skipped']} skipped"
        )
        worst = max(worst, 1 if row["failed"] else 0)
    stale = stale_rows()
    if stale:
        print("rows run on other code than the checkout holds now:\n" + "\n".join(stale))
    return worst


if __name__ == "__main__":
    sys.exit(main())
