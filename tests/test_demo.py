"""``gradgate demo`` end to end: its printed evidence, and its report opened in Chromium."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import gradgate as gg

SCREENSHOTS = Path(__file__).parent.parent / "gradgate-out" / "screenshots"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, float]:
    out = tmp_path_factory.mktemp("demo")
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "gradgate", "demo", "--out", str(out), "--epochs", "2"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return result.stdout, out / "gradgate-demo.html", time.perf_counter() - start


def test_demo_prints_the_seeds_numbers_and_the_answers(demo: tuple[str, Path, float]) -> None:
    stdout, report, seconds = demo
    for totals in ["10 wgrad, 9 dgrad", "1 wgrad, 0 dgrad", "2 wgrad, 1 dgrad", "2 wgrad, 2 dgrad"]:
        assert f"model totals: {totals}," in stdout
    assert re.search(r"wasted gradients: 1 \([\d,]+ FLOPs\)\n  0\.weight", stdout)
    assert "largest difference from torch.autograd.grad: 0.0e+00" in stdout
    assert "(grads None) they moved by 0.0e+00" in stdout
    assert "0 wgrad, 0 dgrad and 0 backward FLOPs in the actor" in stdout
    ratio = re.search(r"random depth: ([\d.]+)x the backward FLOPs", stdout)
    assert ratio is not None and float(ratio.group(1)) < 1.0
    assert f"report: {report.resolve()}" in stdout
    assert seconds < 120


def test_report_is_one_offline_file(demo: tuple[str, Path, float]) -> None:
    text = demo[1].read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", text)
    assert "<script" not in text
    assert text.count("<svg") >= 6  # five scenario graphs and the plot


def _chromium() -> tuple[object, ...]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("Chromium not installed (Debian packages chromium and chromium-driver)")
    return webdriver, chromium, driver


def open_in_chromium(page: Path, screenshot: Path, tmp_path: Path) -> tuple[list[dict], int]:
    """Load ``page`` headless; return the console log and the number of SVG clusters."""
    webdriver, chromium, driver_path = _chromium()
    options = webdriver.ChromeOptions()  # type: ignore[attr-defined]
    options.binary_location = chromium
    for flag in [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1200,2000",
    ]:  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=driver_path)  # type: ignore[attr-defined]
    browser = webdriver.Chrome(options=options, service=service)  # type: ignore[attr-defined]
    try:
        browser.get(page.resolve().as_uri())
        clusters = browser.execute_script(
            "return document.querySelectorAll('svg g.cluster').length"
        )
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(screenshot))
        return browser.get_log("browser"), int(clusters)
    finally:
        browser.quit()


def test_demo_report_loads_in_chromium_without_console_errors(
    demo: tuple[str, Path, float], tmp_path: Path
) -> None:
    log, clusters = open_in_chromium(demo[1], SCREENSHOTS / "demo.png", tmp_path)
    assert [entry for entry in log if entry["level"] in ("SEVERE", "WARNING")] == []
    assert clusters >= 5 * 2  # every scenario graph has the model and its layer clusters
    assert (SCREENSHOTS / "demo.png").stat().st_size > 10_000


def test_audit_html_escapes_names_and_loads_in_chromium(tmp_path: Path) -> None:
    model = nn.Sequential()
    model.add_module("<b>evil</b>", nn.Linear(2, 2))
    with gg.audit(model) as report:
        model(torch.randn(1, 2)).sum().backward()
    page = report.to_html(tmp_path / "audit.html")
    assert "<b>evil</b>" not in page.read_text() and "&lt;b&gt;evil&lt;/b&gt;" in page.read_text()
    log, _ = open_in_chromium(page, SCREENSHOTS / "audit.png", tmp_path)
    assert [entry for entry in log if entry["level"] == "SEVERE"] == []


def test_cli_help_lists_both_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gradgate", "--help"], capture_output=True, text=True, check=True
    )
    assert "demo" in result.stdout and "bench" in result.stdout
