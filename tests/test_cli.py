"""The ``gradgate`` command line: help, version, and one-line errors that say the fix."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

import gradgate as gg
from gradgate import _demo, cli


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_bare_gradgate_prints_help_and_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys)
    assert (status, err) == (0, "")
    assert out.startswith("usage: gradgate")
    commands = out.split("commands:\n", 1)[1]
    assert commands.count("\n    demo ") == 1 and commands.count("\n    bench ") == 1
    assert 'Run "gradgate COMMAND --help"' in out


@pytest.mark.parametrize(
    "argv", [["--help"], ["demo", "--help"], ["bench", "--help"], ["plan", "--help"]]
)
def test_help_is_clean(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    status, out, _ = run(capsys, *argv)
    assert status == 0
    assert "``" not in out and "DESIGN" not in out and "§" not in out


def test_every_demo_option_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "demo", "--help")
    for option in ["--out FOLDER", "--epochs N", "--no-progress"]:
        (line,) = [line for line in out.splitlines() if line.strip().startswith(option)]
        assert len(line.strip()) > len(option) + 5, line


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "--version")
    assert status == 0
    assert out.startswith(f"gradgate {gg.__version__} (torch ")


def test_python_dash_m_runs_the_same_command_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["gradgate", "--version"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("gradgate", run_name="__main__")  # what `python -m gradgate` runs
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith(f"gradgate {gg.__version__} ")


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_bad_epochs_is_one_line_with_the_fix(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    status, out, err = run(capsys, "demo", "--epochs", value)
    assert (status, out) == (2, "")
    assert err.count("\n") == 1
    assert err.startswith(f"gradgate demo: error: argument --epochs: {value!r} is not a whole")
    assert "e.g. --epochs 6" in err and "gradgate demo --help" in err


def test_unknown_option_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "demo", "--fast", "2")
    assert status == 2 and err.count("\n") == 1
    assert "unrecognized arguments: --fast 2" in err


def test_unknown_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "demoo")
    assert status == 2 and err.count("\n") == 1
    assert "invalid choice: 'demoo'" in err


def test_unwritable_out_is_one_line_with_the_fix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_demo, "require_extras", lambda: None)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    status, out, err = run(capsys, "demo", "--out", str(blocker / "report"), "--no-progress")
    assert (status, out) == (1, "")
    assert err.count("\n") == 1
    assert err.startswith(f"gradgate demo: error: --out '{blocker / 'report'}': cannot write")
    assert "e.g. --out ./gradgate-out" in err


@pytest.mark.parametrize("missing", ["sklearn", "matplotlib"])
def test_missing_demo_packages_say_the_install_command(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    missing: str,
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # `import sklearn` now raises ImportError
    status, out, err = run(capsys, "demo", "--out", str(tmp_path), "--no-progress")
    assert (status, out) == (1, "")
    assert err.count("\n") == 1
    package = {"sklearn": "scikit-learn"}.get(missing, missing)
    assert f"the demo needs {package}, which is not installed" in err
    assert err.rstrip().endswith('install them with: pip install "gradgate[demo]"')
    assert list(tmp_path.iterdir()) == []  # failed before writing anything


def test_a_missing_optional_package_met_later_names_its_extra(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def needs_transformers() -> int:
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    assert cli._guarded("bench", needs_transformers) == 1
    err = capsys.readouterr().err
    assert err == (
        "gradgate bench: error: needs the optional package 'transformers', which is not "
        'installed; install it with: pip install "gradgate[bench]"\n'
    )


def test_other_import_errors_are_not_hidden() -> None:
    def broken() -> int:
        raise ModuleNotFoundError("No module named 'nonexistent_pkg'", name="nonexistent_pkg")

    with pytest.raises(ModuleNotFoundError):
        cli._guarded("demo", broken)


def test_demo_command_passes_its_options(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    monkeypatch.setattr(_demo, "run_demo", lambda **options: calls.append(options))
    status, _, _ = run(capsys, "demo", "--out", str(tmp_path), "--epochs", "3", "--no-progress")
    assert status == 0
    assert calls == [{"out": tmp_path, "epochs": 3, "progress": False}]


def test_bench_is_a_command_of_the_same_parser(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "bench", "--help")
    assert status == 0 and "usage: gradgate bench" in out and "--quick" in out


def test_bench_option_errors_are_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "bench", "--repeats", "0")
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("gradgate bench: error: argument --repeats")
