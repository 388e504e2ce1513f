"""Rendering an audit: text table by content, JSON round trip, escaped HTML, kernel view."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import models
import pytest
import torch
from torch import nn

import gradgate as gg
from gradgate._observe.audit.kernels import (
    KernelRow,
    NoCudaError,
    classify_kernel,
    count_kinds,
    profile_kernels,
    render_kernel_table,
)
from gradgate._observe.audit.render import SCHEMA

SEED_WGRAD = "void cudnn::cnn::wgrad2d_grouped_direct_kernel<(bool)0, (bool)1, int, float>"
SEED_DGRAD = "void cudnn::cnn::dgrad2d_grouped_direct_kernel<float, int, float, float>"
SEED_FORWARD = "void cudnn::cnn::conv2d_grouped_direct_kernel<(bool)0, (bool)1, (bool)0>"


@pytest.fixture(scope="module")
def late_freeze_report() -> gg.AuditReport:
    model, x, loss_fn = models.conv_stack(3)
    with gg.audit(model) as report:
        loss = loss_fn(model, x)
        model[0].requires_grad_(False)  # after the forward: wasted
        loss.backward()
    return report


def test_table_rows_hold_the_numbers(late_freeze_report: gg.AuditReport) -> None:
    lines = late_freeze_report.table().splitlines()
    assert lines[0].split() == [
        "module", "type", "wgrad", "dgrad", "backward", "FLOPs", "saved", "bytes", "wgrad",
        "bytes", "ms",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split()[1:7] for line in lines[2:7]}
    # conv 2: out 18×18, both directions 2·(2·2·3·18²·27) = 209,952 FLOPs; saves 2·3·20²·4 B;
    # its weight and bias gradients: (3·3·3·3 + 3)·4 B
    assert rows["2"] == ["Conv2d", "1", "1", "209,952", "9,600", "336"]
    assert rows["0"] == ["Conv2d", "1", "0", "156,816", "13,824", "336"]
    assert rows["(model)"][:3] == ["Sequential", "3", "2"]
    assert "model totals: 3 wgrad, 2 dgrad" in late_freeze_report.table()
    assert "wasted gradients: 2 (156,816 FLOPs)" in late_freeze_report.table()
    assert len(late_freeze_report.table(depth=0).splitlines()) == 3 + 1 + 1 + 1 + 3


def test_json_round_trip(late_freeze_report: gg.AuditReport) -> None:
    text = late_freeze_report.to_json()
    document = json.loads(text)
    assert document["schema"] == SCHEMA == "gradgate.audit/1"
    assert document["totals"] == late_freeze_report.totals
    assert document["modules"][1]["name"] == "0" and document["modules"][1]["leaf"]
    assert document["wasted"][0]["reason"] == "late_freeze"
    loaded = gg.AuditReport.from_json(text)
    assert loaded.modules == late_freeze_report.modules
    assert loaded.outside == late_freeze_report.outside
    assert loaded.wasted == late_freeze_report.wasted
    assert loaded.to_json() == text


def test_json_with_another_schema_is_refused() -> None:
    msg = "schema 'other/2'; expected 'gradgate.audit/1'"
    with pytest.raises(gg.GradgateError, match=re.escape(msg)):
        gg.AuditReport.from_json(json.dumps({"schema": "other/2"}))


def test_html_escapes_model_derived_names(tmp_path: Path) -> None:
    model = nn.Sequential()
    model.add_module("<script>alert(1)</script>", nn.Linear(2, 2))
    with gg.audit(model) as report:
        model(torch.randn(1, 2)).sum().backward()
    path = report.to_html(tmp_path / "audit.html")
    page = path.read_text(encoding="utf-8")
    assert "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.startswith("<!DOCTYPE html>") and "Wasted gradients" in page


@pytest.mark.slow  # a subprocess or a compile: seconds
def test_import_stays_light() -> None:
    code = (
        "import sys, gradgate, gradgate._observe.audit, gradgate._observe.graph; "
        "print(sorted(m for m in ('matplotlib', 'graphviz', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]"


# -- the kernel view --------------------------------------------------------------------------
def test_seed_kernel_names_are_classified() -> None:
    assert classify_kernel(SEED_WGRAD, in_backward=True) == "wgrad"
    assert classify_kernel(SEED_DGRAD, in_backward=True) == "dgrad"
    assert classify_kernel(SEED_FORWARD, in_backward=False) == "forward"
    assert classify_kernel("void at::native::reduce_kernel<512>", in_backward=True) == "other"


def test_kernel_table_has_the_seed_columns() -> None:
    rows = [
        KernelRow(SEED_WGRAD, "wgrad", (2623, 23520) + (10000,) * 8),
        KernelRow(SEED_DGRAD, "dgrad", (5600,) * 9),
    ]
    assert count_kinds(rows) == {"wgrad": 10, "dgrad": 9, "forward": 0, "other": 0}
    table = render_kernel_table(rows).splitlines()
    assert table[0].split()[:4] == ["Time", "(%)", "Total", "Time"]
    first = table[1].split()
    # 2,623 + 23,520 + 8·10,000 = 106,143 ns over 10 launches; 9·5,600 = 50,400 ns for dgrad
    assert first[:3] == ["67.8", "106,143", "10"] and first[8] == "wgrad"
    assert table[2].split()[:3] == ["32.2", "50,400", "9"]


def test_kernel_view_without_cuda_says_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(NoCudaError, match="needs a CUDA device"):
        profile_kernels(lambda: None)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="kernel names come from the CUDA profiler; CPU CI has no GPU",
)
def test_seed_kernel_counts_on_gpu() -> None:
    model, x, loss_fn = models.conv_stack(10)
    model, x = model.cuda(), x.cuda()
    loss_fn(model, x).backward()  # warm up cuDNN's algorithm choice
    rows = profile_kernels(lambda: loss_fn(model, x).backward())
    print(render_kernel_table(rows))
    counts = count_kinds(rows)
    assert (counts["wgrad"], counts["dgrad"]) == (10, 9)


def test_jupyter_shows_the_report_as_html_tables(late_freeze_report: gg.AuditReport) -> None:
    html = late_freeze_report._repr_html_()
    assert "<table>" in html and "<h4>Totals</h4>" in html and "<h4>Wasted gradients</h4>" in html
    assert "<td class='n'>209,952</td>" in html  # conv 2's backward FLOPs, as in the table
    assert "<!DOCTYPE" not in html  # a fragment for the notebook cell, not a page


def test_a_new_column_is_one_entry_in_the_records_module() -> None:
    from gradgate._observe.audit.records import COLUMNS, HEADERS, ModuleRecord

    fields = {f for f in ModuleRecord.__dataclass_fields__ if f not in ("name", "type", "leaf")}
    assert [c.field for c in COLUMNS] == [
        "wgrad", "dgrad", "backward_flops", "saved_bytes", "wgrad_bytes", "seconds"
    ]  # fmt: skip
    assert {c.field for c in COLUMNS} == fields
    assert HEADERS[2:] == tuple(c.header for c in COLUMNS)


@pytest.mark.parametrize("depth", [-1, "1", 1.5, True])
def test_a_bad_table_depth_is_named(late_freeze_report: gg.AuditReport, depth: object) -> None:
    with pytest.raises(gg.InvalidOptionError, match=re.escape(f"got {depth!r}; expected None")):
        late_freeze_report.table(depth=depth)  # type: ignore[arg-type]
