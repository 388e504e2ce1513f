"""gradgate bench: the JSON schema, and gradgate's counts equal the hand-written ideal."""

from __future__ import annotations

import json

import pytest
import torch

import gradgate as gg
from gradgate import bench
from gradgate._bench import measure, report
from gradgate._bench.methods import METHODS, Runner, configurations
from gradgate._bench.workloads import FACTORIES

SMALL = {"transformer": 3, "gpt2": 3, "conv_stack": 4}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    folder = tmp_path_factory.mktemp("bench")
    argv = ["--tiny", "--repeats", "1", "--no-progress", "--no-overheads"]
    argv += ["--json", str(folder / "bench.json"), "--plot", str(folder / "bench.png")]
    assert bench.main(argv) == 0
    return json.loads((folder / "bench.json").read_text()), str(folder / "bench.png")


def test_tiny_bench_writes_the_exact_schema(tiny_run: tuple[dict, str]) -> None:
    document, plot = tiny_run
    assert set(document) == {"machine", "results", "compile"}
    assert {row["model"] for row in document["results"]} == set(FACTORIES)
    for row in document["results"]:
        assert list(row) == list(report.RESULT_KEYS)
        assert row["depth"] is None or type(row["depth"]) is int
        assert row["method"] in METHODS
        assert row["step_seconds"] > 0
        assert isinstance(row["backward_flops"], int)
        assert isinstance(row["saved_bytes"], int)
        assert row["peak_rss_bytes"] is None or row["peak_rss_bytes"] > 0
    assert [row["method"] for row in document["compile"]] == ["toggle+compile", "gradgate+compile"]
    for row in document["compile"]:
        assert list(row) == list(report.COMPILE_KEYS)
    with open(plot, "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"


def test_tiny_bench_gradgate_counts_equal_ideal(tiny_run: tuple[dict, str]) -> None:
    rows = {(r["model"], r["method"], r["depth"]): r for r in tiny_run[0]["results"]}
    for (model, method, depth), row in rows.items():
        if method == "gradgate":
            ideal = rows[model, "ideal", depth]
            assert row["backward_flops"] == ideal["backward_flops"]
            assert row["saved_bytes"] == ideal["saved_bytes"]


@pytest.mark.parametrize("name", list(FACTORIES))
def test_every_depth_gradgate_flops_and_saved_bytes_equal_ideal(name: str) -> None:
    workload = FACTORIES[name](size="tiny", n=SMALL[name])
    runner = Runner(workload)
    try:
        for depth in [*range(SMALL[name] + 1), None]:
            for figure in (measure.backward_flops, measure.saved_bytes):
                gate, ideal = figure(runner, "gradgate", depth), figure(runner, "ideal", depth)
                assert gate == ideal, (figure.__name__, depth)
            if depth is not None and depth < SMALL[name]:
                full = measure.backward_flops(runner, "full", None)
                assert measure.backward_flops(runner, "gradgate", depth) < full
    finally:
        runner.close()


@pytest.mark.parametrize("name", list(FACTORIES))
def test_methods_train_exactly_the_suffix(name: str) -> None:
    workload = FACTORIES[name](size="tiny", n=SMALL[name])
    runner = Runner(workload)
    try:
        for depth in [0, 1, None]:
            frozen = {id(p) for p in runner.prefix(depth)}
            expected = [n for n, p in runner.model.named_parameters() if id(p) not in frozen]
            for method in METHODS:
                if method == "full" and depth is not None:
                    continue
                runner.step(method, depth, keep_grads=True)
                model = runner.model_for(method)
                learned = [n for n, p in model.named_parameters() if p.grad is not None]
                assert learned == expected, (method, depth)
                assert all(p.requires_grad for p in model.parameters())
                model.zero_grad(set_to_none=True)
    finally:
        runner.close()


def test_late_freeze_still_computes_the_prefix_gradients() -> None:
    runner = Runner(FACTORIES["conv_stack"](size="tiny", n=4))
    try:
        full = measure.backward_flops(runner, "full", None)
        assert measure.backward_flops(runner, "late-freeze", 1) == full
        assert measure.backward_flops(runner, "toggle", 1) < full
    finally:
        runner.close()


def test_configurations_measure_full_once() -> None:
    pairs = configurations([0, 2, None])
    assert pairs.count(("full", None)) == 1
    assert ("toggle", None) not in pairs
    assert ("gradgate", None) in pairs


def test_validate_rejects_other_schemas() -> None:
    with pytest.raises(ValueError, match="top-level keys"):
        report.validate({"machine": {}, "results": []})
    row = dict.fromkeys(report.RESULT_KEYS, 1)
    row["depth"] = 1.5
    with pytest.raises(ValueError, match=r"depth 1\.5"):
        report.validate({"machine": {}, "results": [row], "compile": []})


def test_bad_repeats_is_a_clear_error() -> None:
    with pytest.raises(gg.InvalidOptionError, match="--repeats 0; expected an integer >= 1"):
        bench.main(["--repeats", "0"])


def test_peak_rss_is_measured_per_step() -> None:
    size = measure.peak_rss_bytes(lambda: torch.ones(4_000_000).sum().item())
    assert size is None or size > 16_000_000
