"""gradgate bench: options, device selection, cycle-free measuring, gradgate = ideal, the JSON."""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import resource
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

import gradgate as gg
from gradgate import _bench
from gradgate._bench import device, measure, report, table
from gradgate._bench.catalog import FACTORIES
from gradgate._bench.methods import METHODS, Runner, configurations

SMALL = {"transformer": 3, "gpt2": 3, "llama": 3, "conv_stack": 4}
CPU = torch.device("cpu")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gradgate")
    _bench.add_command(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


# -- the command line ----------------------------------------------------------------------------
def test_add_command_sets_run_and_defaults() -> None:
    args = parse()
    assert args.run is _bench.run_command
    assert (args.device, args.amp, args.repeats, args.models) == ("cpu", "none", None, None)
    assert args.json == Path("gradgate-out/bench.json")


def test_models_are_the_catalog() -> None:
    assert tuple(FACTORIES) == _bench.MODELS


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--repeats", "0"],
            "argument --repeats: '0' is not allowed; expected an integer from 1 to 1000",
        ),
        (
            ["--repeats", "x"],
            "argument --repeats: 'x' is not allowed; expected an integer from 1 to 1000",
        ),
        (
            ["--warmup", "-1"],
            "argument --warmup: '-1' is not allowed; expected an integer from 0 to 100",
        ),
        (
            ["--device", "tpu"],
            "argument --device: 'tpu' is not allowed; expected cpu, cuda or cuda:N",
        ),
        (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
        (["--quick", "--tiny"], "argument --tiny: not allowed with argument --quick"),
    ],
)
def test_bad_options_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        parse(*argv)
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error


def test_help_names_every_option_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--help")
    text = capsys.readouterr().out
    for option in ("--device", "--amp", "--json", "--plot", "--markdown", "--from-json"):
        assert option in text
    assert "``" not in text and "DESIGN" not in text


def test_command_line_is_the_canonical_command() -> None:
    args = parse("--tiny", "--models", "llama", "--repeats", "2", "--no-compile", "--json", "x")
    assert (
        _bench.command_line(args) == "gradgate bench --tiny --models llama --repeats 2 --no-compile"
    )


@pytest.mark.slow  # a subprocess or a compile: seconds
def test_import_is_light() -> None:
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import gradgate._bench\n"
        "heavy = {'transformers', 'matplotlib', 'tqdm'} & (set(sys.modules) - before)\n"
        "print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_missing_optional_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _bench.importlib.util.find_spec
    monkeypatch.setattr(
        _bench.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    with pytest.raises(gg.GradgateError, match=r'pip install "gradgate\[bench\]"') as error:
        _bench.run_command(parse("--tiny", "--models", "llama", "--no-plot"))
    assert "'transformers'" in str(error.value)
    assert "--models transformer conv_stack" in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_cuda_without_a_gpu_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench.main(["--device", "cuda", "--tiny", "--no-plot"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--device cuda: CUDA is not available here" in err
    assert "use --device cpu" in err


# -- the device-specific part is small, and chosen by device ---------------------------------------
def test_meter_is_chosen_by_device() -> None:
    cpu, cuda = device.meter_for(CPU), device.meter_for(torch.device("cuda"))
    assert (cpu.seconds, cpu.peak_bytes) == (device.wall_seconds, device.rss_peak_bytes)
    assert (cuda.seconds, cuda.peak_bytes) == (device.cuda_seconds, device.cuda_peak_bytes)
    assert "CUDA events" in cuda.timing and "max_memory_allocated" in cuda.peak


def test_resolve_gives_cuda_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.resolve("cuda:1") == torch.device("cuda:1")
    assert device.resolve("cpu") == CPU


def test_cuda_peak_is_the_step_peak_above_what_was_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = {"allocated": 1000, "peak": 1000}

    def step() -> None:
        state["peak"] = 1000 + 4096

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: state.update(peak=1000))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["peak"])
    assert device.cuda_peak_bytes(step) == 4096


def test_rss_peak_belongs_to_the_step() -> None:
    size = device.rss_peak_bytes(lambda: torch.ones(8_000_000).add_(1).sum().item())
    assert size is None or size > 30_000_000
    small = device.rss_peak_bytes(lambda: None)
    assert small is None or small < 8_000_000


def test_wall_seconds_times_the_step() -> None:
    assert 0.04 < device.wall_seconds(lambda: time.sleep(0.05)) < 1.0


# -- measuring keeps nothing alive ---------------------------------------------------------------
@pytest.mark.parametrize("op", [torch.sigmoid, torch.tanh, lambda t: t.softmax(-1)])
def test_saved_bytes_keeps_no_saved_output_alive(op) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(256, requires_grad=True)
    refs = []

    def forward() -> None:
        out = op(x)  # saves its own output for backward; no backward runs
        refs.append(weakref.ref(out))

    assert measure.saved_bytes_during(forward) == 256 * 4
    gc.collect()
    assert refs[0]() is None


def test_saved_bytes_counts_each_storage_once_and_skips_excluded() -> None:
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64)

    def forward() -> None:
        h = x @ w  # saves x (and w, excluded)
        (h * h).sum()  # saves h once, though twice as an input

    assert measure.saved_bytes_during(forward, exclude=[w]) == (8 * 64 + 8 * 64) * 4


# -- the methods: gradgate equals the ideal, and each trains exactly the suffix ------------------
@pytest.mark.parametrize("name", list(FACTORIES))
def test_every_depth_gradgate_flops_and_saved_bytes_equal_ideal(name: str) -> None:
    workload = FACTORIES[name](size="tiny", n=SMALL[name])
    runner = Runner(workload)
    try:
        full = measure.backward_flops(runner, "full", None)
        for depth in [*range(SMALL[name] + 1), None]:
            gate, ideal = (
                measure.counts(runner, "gradgate", depth),
                measure.counts(runner, "ideal", depth),
            )
            assert gate == ideal, depth
            assert gate["saved_bytes"] == measure.saved_bytes(runner, "ideal", depth)
            if depth is not None and depth < SMALL[name]:
                assert measure.backward_flops(runner, "gradgate", depth) < full
    finally:
        runner.close()


@pytest.mark.parametrize(("name", "amp"), [(n, None) for n in FACTORIES] + [("llama", "bf16")])
def test_methods_train_exactly_the_suffix(name: str, amp: str | None) -> None:
    runner = Runner(FACTORIES[name](size="tiny", n=SMALL[name]), amp=amp)
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


def test_gradgate_gradients_equal_the_ideal_under_bf16_autocast() -> None:
    runner = Runner(FACTORIES["transformer"](size="tiny", n=3), amp="bf16")
    try:
        ideal = runner.model_for("ideal")
        runner.gated.load_state_dict(ideal.state_dict())
        runner.step("gradgate", 1, keep_grads=True)
        runner.step("ideal", 1, keep_grads=True)
        gated = dict(runner.gated.named_parameters())
        for name, param in ideal.named_parameters():
            if param.grad is None:
                assert gated[name].grad is None, name
            else:
                torch.testing.assert_close(gated[name].grad, param.grad, msg=name)
    finally:
        runner.close()


def test_every_method_trains_a_copy_of_its_own() -> None:
    """The rounds interleave the methods: one that shared a copy would find its weights in the
    cache, warmed by another method's step."""
    runner = Runner(FACTORIES["conv_stack"](size="tiny", n=2))
    try:
        for method in METHODS:
            before = {m: [p.clone() for p in runner.model_for(m).parameters()] for m in METHODS}
            runner.step(method, 0)
            for other in METHODS:
                after = zip(runner.model_for(other).parameters(), before[other], strict=True)
                changed = any(not torch.equal(a, b) for a, b in after)
                assert changed == (other == method), (method, other)
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


def test_no_configuration_always_follows_the_same_one() -> None:
    """A step's time depends on the step before it: the timed rounds vary who runs before whom
    (a rotated fixed order put toggle before gradgate and gradgate before the ideal at every
    depth, in every round)."""
    from gradgate._bench.run import round_order

    configs = configurations([0, 3, None])
    before: dict[tuple[str, object], set[tuple[str, object]]] = {c: set() for c in configs}
    for round_ in range(9):  # gradgate bench --quick's repeats
        order = round_order(configs, round_)
        assert sorted(order, key=str) == sorted(configs, key=str)
        for previous, config in itertools.pairwise(order):
            before[config].add(previous)
    assert all(len(previous) >= 3 for previous in before.values()), before
    assert round_order(configs, 4) == round_order(configs, 4)  # the same at every run


# -- the table and the JSON ----------------------------------------------------------------------
def _document() -> dict:
    row = dict.fromkeys(report.RESULT_KEYS)
    full = {**row, "model": "m", "method": "full", "step_seconds": 0.2, "backward_flops": 100,
            "saved_bytes": 2**20, "peak_bytes": 2**21}  # fmt: skip
    rows = [full]
    for method, seconds, flops, peak in [
        ("late-freeze", 0.2, 100, 2**21),
        ("toggle", 0.11, 40, 2**20),
        ("gradgate", 0.1, 40, 2**19),
        ("ideal", 0.1, 40, 2**19),
    ]:
        rows.append({**full, "method": method, "depth": 1, "step_seconds": seconds,
                     "backward_flops": flops, "peak_bytes": peak})  # fmt: skip
    machine = {"command": "gradgate bench --device cuda --amp bf16", "device_name": "cuda (H100)",
               "amp": "bf16"}  # fmt: skip
    return {"machine": machine, "results": rows, "compile": []}


def test_table_names_device_amp_and_command_in_both_formats() -> None:
    document = _document()
    text, markdown = table.render(document), table.render(document, fmt="markdown")
    first = "gradgate bench on cuda (H100), bf16 autocast (float32 weights) "
    first += "(command: gradgate bench --device cuda --amp bf16)"
    assert text.splitlines()[0] == markdown.splitlines()[0] == first
    cells = ["1", "1.000", "0.50", "1.10", "2.00", "1 (=)", "0.40", "1.00", "1 (=)", "1.00"]
    cells += ["1.000", "0.500"]
    assert "| " + " | ".join(cells) + " |" in markdown
    assert " ".join(text.splitlines()[-1].split()) == " ".join(cells)


def test_validate_rejects_other_schemas() -> None:
    with pytest.raises(ValueError, match="top-level keys"):
        report.validate({"machine": {}, "results": []})
    row = dict.fromkeys(report.RESULT_KEYS, 1)
    row["depth"] = 1.5
    with pytest.raises(ValueError, match=r"depth 1\.5"):
        report.validate({"machine": {}, "results": [row], "compile": []})


def test_from_json_prints_a_saved_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bench.json"
    report.write_json(_document(), path)
    assert _bench.run_command(parse("--from-json", str(path), "--no-plot", "--markdown")) == 0
    assert capsys.readouterr().out.strip() == table.render(_document(), fmt="markdown")


def test_from_json_rejects_another_file(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"results": []}')
    with pytest.raises(gg.InvalidOptionError, match="not a gradgate bench JSON file"):
        _bench.run_command(parse("--from-json", str(path), "--no-plot"))


@pytest.mark.slow
def test_tiny_bench_writes_the_schema_and_gradgate_equals_ideal(tmp_path: Path) -> None:
    argv = ["--tiny", "--repeats", "1", "--no-progress", "--no-overheads"]
    argv += ["--models", "transformer", "llama", "--no-compile"]
    argv += ["--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    assert _bench.main(argv) == 0
    document = json.loads((tmp_path / "b.json").read_text())
    assert document["machine"]["command"] == (
        "gradgate bench --tiny --models transformer llama --repeats 1 --no-compile --no-overheads"
    )
    assert document["machine"]["device"] == "cpu"
    assert {row["model"] for row in document["results"]} == {"transformer", "llama"}
    rows = {(r["model"], r["method"], r["depth"]): r for r in document["results"]}
    for (model, method, depth), row in rows.items():
        assert list(row) == list(report.RESULT_KEYS)
        assert row["step_seconds"] > 0
        if method == "gradgate":
            ideal = rows[model, "ideal", depth]
            assert row["backward_flops"] == ideal["backward_flops"]
            assert row["saved_bytes"] == ideal["saved_bytes"]
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_bench_stays_quick(tmp_path: Path) -> None:
    """Under a minute of CPU time on one thread: the wall time on a quiet 2-core machine (CPU
    time, not wall time, so that other processes on a shared machine do not fail it)."""
    argv = ["--quick", "--threads", "1", "--no-progress", "--no-plot"]
    argv += ["--json", str(tmp_path / "q.json")]
    code = f"import sys; from gradgate._bench import main; sys.exit(main({argv!r}))"
    start = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    end = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = end.ru_utime + end.ru_stime - start.ru_utime - start.ru_stime
    assert cpu_seconds < 60
    document = json.loads((tmp_path / "q.json").read_text())
    assert len({row["model"] for row in document["results"]}) == 4


def test_attention_backward_is_counted_on_the_cpu_too() -> None:
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    counter = measure.flop_counter()
    with counter:
        out.sum().backward()
    attention = 2 * 2 * 4 * 5 * (8 * 16 * 8)  # five batched matmuls over (batch x heads)
    assert counter.get_total_flops() >= attention


def test_a_failing_torch_formula_falls_back() -> None:
    def broken(*args: object, out_val: object = None) -> int:
        raise AssertionError("mismatch")

    formula = measure._first_that_counts(broken, lambda *args, out_val=None: 7)
    assert formula(1, 2, out_val=None) == 7 and formula._get_raw is True


def test_schedules_section_compares_every_schedule_on_the_same_steps() -> None:
    from gradgate._bench.sections import schedules
    from gradgate.schedules import _REGISTRY

    rows = {row["method"]: row for row in schedules.measure(blocks=3, width=8, steps=4)}
    compared = [kind.__name__ for kind in _REGISTRY if kind not in schedules.EXCLUDED]
    assert list(rows) == ["full backprop", *compared]
    assert set(schedules.EXCLUDED) <= set(_REGISTRY)
    assert all(isinstance(reason, str) and reason for reason in schedules.EXCLUDED.values())
    assert rows["full backprop"]["flops_ratio"] == rows["full backprop"]["saved_ratio"] == 1.0
    for name in compared:  # each trains less than everything at some step
        assert rows[name]["backward_flops"] < rows["full backprop"]["backward_flops"], name
    # AdamW keeps two moments per learning parameter; FreezeOut drops finished blocks' state
    assert rows["full backprop"]["state_ratio"] > 1.9
    assert (
        rows["FreezeOut"]["optimizer_state_bytes"] < rows["full backprop"]["optimizer_state_bytes"]
    )
    assert "FreezeOut" in schedules.table(list(rows.values()))


def test_a_new_schedule_joins_the_schedules_section(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradgate._bench.sections import schedules
    from gradgate.schedules import _REGISTRY, Plan, Schedule

    class LastBlockOnly(Schedule):
        def _plan(self, step: int) -> Plan:
            return Plan(depth=1)

        def _config(self) -> dict[str, int]:
            return {"n": self.n}

    monkeypatch.setitem(_REGISTRY, LastBlockOnly, lambda n, steps, seed: LastBlockOnly(n))
    rows = {row["method"]: row for row in schedules.measure(blocks=3, width=8, steps=2)}
    assert list(rows)[-1] == "LastBlockOnly"
    assert 0 < rows["LastBlockOnly"]["flops_ratio"] < rows["FreezeOut"]["flops_ratio"]
    assert "LastBlockOnly" in schedules.table(list(rows.values()))


@pytest.mark.slow  # two spawned processes: about 8 s here
def test_distributed_section_sends_the_trained_share() -> None:
    from gradgate._bench.sections import distributed

    section = distributed.measure(blocks=3, width=8, steps=2, depths=(1, 2, None))
    rows = {row["depth"]: row for row in section["rows"]}
    assert list(rows) == [1, 2, None]
    full = rows[None]["DDP_bytes"]
    assert full > 0 and rows[None]["allreduce_trained_bytes"] == full
    for depth in (1, 2):
        row = rows[depth]
        assert row["DDP_bytes"] == full  # plain DDP sends every gradient at every depth
        assert 0 < row["allreduce_trained_bytes"] < full
        assert row["ratio"] == pytest.approx(row["trained_share"], abs=1e-9)
        assert row["max_grad_difference"] == 0.0
    assert rows[1]["allreduce_trained_bytes"] < rows[2]["allreduce_trained_bytes"]
    n_params = 2 + 3 * 6 + 2  # input Linear, 3 blocks (LayerNorm + 2 Linear), head
    assert rows[1]["allreduce_trained_agreement_bytes"] == n_params  # one byte each
    text = distributed.table(section)
    assert "allreduce_trained" in text and "full" in text


def test_json_may_carry_the_optional_sections(tmp_path: Path) -> None:
    document = {"machine": {}, "results": [], "compile": [], "schedules": [], "distributed": {}}
    report.write_json(document, tmp_path / "bench.json")
    assert report.read_json(tmp_path / "bench.json") == document
    with pytest.raises(ValueError, match="top-level keys"):
        report.validate({**document, "other": 1})


def test_the_prefix_cache_section_measures_its_ratios() -> None:
    from gradgate._bench.sections import prefix_cache

    rows = prefix_cache.measure(size="tiny", models=("conv_stack",), batches=2, repeats=1)
    assert [row["model"] for row in rows] == ["conv_stack"]
    row = rows[0]
    assert row["bytes_per_sample"] == 4 * 8 * 8 * 4  # channels x side x side x float32
    assert all(row[key] > 0 for key in ("gate_step_seconds", "memory", "disk", "first_epoch"))
    text = prefix_cache.table(rows)
    assert "| conv_stack |" in text and "depth 1 of 12" in text
