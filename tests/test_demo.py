"""``gradgate demo`` end to end: its printed evidence, and its report opened in Chromium at
800 and 1400 px (screenshots in gradgate-out/screenshots/, to look at)."""

from __future__ import annotations

import itertools
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
DOCS = Path(__file__).parent.parent / "docs"


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, float]:
    """``gradgate demo`` run once per test session, as a user runs it."""
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


@pytest.mark.slow
def test_demo_prints_the_numbers_and_the_answers(demo: tuple[str, Path, float]) -> None:
    stdout, report, seconds = demo
    for totals in ["10 wgrad, 9 dgrad", "1 wgrad, 0 dgrad", "2 wgrad, 1 dgrad", "2 wgrad, 2 dgrad"]:
        assert f"\n   {totals}, " in stdout
    assert re.search(r"3 wgrad, 2 dgrad, .*; wasted: 0\.weight \([\d.]+ [kM] FLOPs\)", stdout)
    assert "Largest difference from torch.autograd.grad: 0.0e+00." in stdout
    assert "gg.check named the cause: frozen-in-optimizer." in stdout
    assert "they moved by 0.0e+00, and gg.check found 0 problems." in stdout
    assert "computed 0 weight gradients, 0 input gradients and 0 backward FLOPs in the actor" in (
        stdout
    )
    assert re.search(r"the largest depth that fits in 16 GiB is \d+ \(", stdout)
    ratio = re.search(r"random depth: ([\d.]+)x the backward FLOPs", stdout)
    assert ratio is not None and float(ratio.group(1)) < 1.0
    last = stdout.rstrip().splitlines()[-1]
    assert re.fullmatch(rf"report written in \d+ s: {re.escape(str(report.resolve()))}", last)
    assert seconds < 120


@pytest.mark.slow
def test_report_is_one_offline_file(demo: tuple[str, Path, float]) -> None:
    text = demo[1].read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", text)
    assert "<script" not in text
    assert text.count("<svg") == 5 + 1  # five graphs and the plot (the legend is HTML)


@pytest.mark.slow
def test_report_speaks_to_a_newcomer(demo: tuple[str, Path, float]) -> None:
    text = demo[1].read_text()
    visible = re.sub(r"<svg.*?</svg>|<[^>]+>", " ", text, flags=re.DOTALL)
    for jargon in ["backward_flops", "saved_bytes", "seeds", "(seed", "(ms)"]:
        assert jargon not in visible, jargon
    assert "<dt>wgrad (weight gradient)</dt>" in text and "<dt>dgrad (input gradient)</dt>" in text
    assert text.count(">learning parameter</span>") == 1  # the graphs' legend, once
    assert text.count("<pre><code>") == 1 + 5 + 1 + 4  # set-up, questions, training, answers
    levels = [int(level) for level in re.findall(r"<h([1-6])", text)]
    assert levels[0] == 1 and levels.count(1) == 1
    assert all(b <= a + 1 for a, b in itertools.pairwise(levels)), levels  # no level skipped


@pytest.mark.slow
def test_report_names_docs_pages_that_exist(demo: tuple[str, Path, float]) -> None:
    text = demo[1].read_text()
    assert "file:" not in text  # a link to this machine's files breaks once the page is copied
    pages = re.findall(r"<code>docs/([\w/-]+\.md)</code>", text)
    assert len(pages) >= 10
    for page in pages:
        assert (DOCS / page).is_file(), page


def test_more_names_the_page_in_words_that_survive_a_copy() -> None:
    from gradgate._demo import _page

    more = _page._doc_link("questions/what-are-wgrad-and-dgrad.md")
    assert "href" not in more and "file:" not in more
    assert "<code>docs/questions/what-are-wgrad-and-dgrad.md</code>" in more
    assert "What are wgrad and dgrad?" in more  # the page's own title


def test_the_legend_is_a_row_of_keys_under_its_sentence() -> None:
    from gradgate._demo import _page, _scenarios

    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    gg.freeze(net, "0")
    picture = gg.graph(net(torch.randn(1, 2)).sum(), model=net)
    scenario = _scenarios.Scenario("q?", "code", "why", "index.md", gg.AuditReport(), picture)
    legend = _page._legend([scenario])
    assert "class='cols'" not in legend and "<svg" not in legend  # nothing floats beside it
    keys = re.findall(r"<span class='key'[^>]*>(.*?)</span>", legend)
    assert keys[:2] == ["learning parameter", "frozen parameter: no wgrad"]
    assert "frozen after the forward:<br>wgrad still computed" in keys
    assert legend.index("The colours:") < legend.index("<span class='key'")


def _chromium() -> tuple[object, ...]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("Chromium not installed (Debian packages chromium and chromium-driver)")
    return webdriver, chromium, driver


def open_in_chromium(
    page: Path, screenshot: Path, tmp_path: Path, *, width: int = 1200
) -> tuple[list[dict], dict[str, float]]:
    """Load ``page`` headless at ``width`` px; save a full-page screenshot; return the console
    log and measurements: SVG clusters, the smallest graph text height and page overflow."""
    webdriver, chromium, driver_path = _chromium()
    options = webdriver.ChromeOptions()  # type: ignore[attr-defined]
    options.binary_location = chromium
    for flag in [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--window-size={width},1000",
    ]:  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=driver_path)  # type: ignore[attr-defined]
    browser = webdriver.Chrome(options=options, service=service)  # type: ignore[attr-defined]
    try:
        browser.get(page.resolve().as_uri())
        measured = browser.execute_script(
            """
            const heights = [...document.querySelectorAll('.graph svg text')]
                .map(t => t.getBoundingClientRect().height).filter(h => h > 0);
            return {
                clusters: document.querySelectorAll('svg g.cluster').length,
                smallest_graph_text: heights.length ? Math.min(...heights) : 0,
                overflow: document.documentElement.scrollWidth - window.innerWidth,
                height: document.body.scrollHeight,
            };
            """
        )
        browser.set_window_size(width, min(int(measured["height"]) + 200, 20_000))
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(screenshot))
        return browser.get_log("browser"), measured
    finally:
        browser.quit()


@pytest.mark.slow
@pytest.mark.parametrize("width", [800, 1400])
def test_demo_report_reads_well_in_chromium(
    demo: tuple[str, Path, float], tmp_path: Path, width: int
) -> None:
    shot = SCREENSHOTS / f"demo-{width}.png"
    log, measured = open_in_chromium(demo[1], shot, tmp_path, width=width)
    assert [entry for entry in log if entry["level"] in ("SEVERE", "WARNING")] == []
    assert measured["clusters"] >= 5 * 2  # every graph has the model and its layer clusters
    assert measured["smallest_graph_text"] >= 9, measured  # legible: px on screen
    assert measured["overflow"] <= 0, measured  # no sideways scrolling of the page
    assert shot.stat().st_size > 50_000


@pytest.mark.slow
def test_audit_html_escapes_names_and_loads_in_chromium(tmp_path: Path) -> None:
    model = nn.Sequential()
    model.add_module("<b>evil</b>", nn.Linear(2, 2))
    with gg.audit(model) as report:
        model(torch.randn(1, 2)).sum().backward()
    page = report.to_html(tmp_path / "audit.html")
    assert "<b>evil</b>" not in page.read_text() and "&lt;b&gt;evil&lt;/b&gt;" in page.read_text()
    log, _ = open_in_chromium(page, SCREENSHOTS / "audit.png", tmp_path)
    assert [entry for entry in log if entry["level"] == "SEVERE"] == []


def test_report_without_graphviz_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradgate._demo import _page, _scenarios

    net = nn.Sequential(nn.Linear(2, 2))
    picture = gg.graph(net(torch.randn(1, 2)).sum(), model=net)
    scenario = _scenarios.Scenario("q?", "code", "why", "index.md", gg.AuditReport(), picture)
    monkeypatch.setenv("PATH", "")  # no `dot` program to be found
    assert "apt-get install graphviz" in _page._graph_svg(picture)
    assert _page._legend([scenario]) == ""  # no graphs drawn: no legend for them


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (0, "", "0"),
        (999, "", "999"),
        (1000, "", "1.00 k"),
        (2048, "B", "2.05 kB"),
        (12_345, "", "12.3 k"),
        (999_499, "", "999 k"),
        (999_500, "", "1.00 M"),  # not "1e+03 k"
        (1_234_567, "", "1.23 M"),
        (999_999_999, "", "1.00 G"),  # not "1e+03 M"
        (123_456_789_012, "", "123 G"),
        (4.56e12, "", "4.56 T"),
        (-2_500_000, "B", "-2.50 MB"),
    ],
)
def test_the_demos_numbers_take_the_prefix_their_rounded_value_needs(
    value: float, unit: str, text: str
) -> None:
    from gradgate._demo._tables import human_count

    assert human_count(value, unit) == text
