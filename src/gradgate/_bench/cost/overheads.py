"""Overheads: changing the depth every step (48 blocks), and the audit's own cost."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

import gradgate as gg

from ..device import Meter, meter_for
from ..methods import Runner
from ..workloads import Size, transformer


def depth_change(
    *, size: Size = "quick", n: int = 48, repeats: int = 5, device: torch.device | None = None
) -> dict[str, float]:
    """Seconds per ``gate.depth = k`` on a 48-block model, and that as a fraction of a step."""
    device = device or torch.device("cpu")
    meter = meter_for(device)
    workload = transformer(size=size, n=n, d_model=64 if size != "tiny" else None, device=device)
    runner = Runner(workload)
    try:
        depths = [*range(n + 1), None]
        for depth in depths:  # first visit of a depth may do one-time checks
            runner.gate.depth = depth
        calls = 20 * len(depths)
        start = time.perf_counter()
        for i in range(calls):
            runner.gate.depth = depths[i % len(depths)]
        per_change = (time.perf_counter() - start) / calls
        runner.step("gradgate", n // 2)
        step = statistics.median(
            meter.seconds(lambda: runner.step("gradgate", n // 2)) for _ in range(repeats)
        )
    finally:
        runner.close()
    return {"depth_change_seconds": per_change, "depth_change_step_fraction": per_change / step}


def audit_ratio(
    *, size: Size = "quick", repeats: int = 5, device: torch.device | None = None
) -> float | None:
    """Median step time under ``gg.audit`` over the plain step; None where audit fails."""
    device = device or torch.device("cpu")
    meter: Meter = meter_for(device)
    runner = Runner(transformer(size=size, device=device))
    model = runner.gated

    def audited() -> None:
        with gg.audit(model) as _report:
            runner.step("gradgate", 3)

    try:
        audited()
    except Exception as error:  # audit is optional here: report it as not measured
        print(f"audit overhead not measured: {error!r}", file=sys.stderr)
        runner.close()
        return None
    try:
        plain: list[float] = []
        with_audit: list[float] = []
        for _ in range(repeats):
            plain.append(meter.seconds(lambda: runner.step("gradgate", 3)))
            with_audit.append(meter.seconds(audited))
    finally:
        runner.close()
    return statistics.median(with_audit) / statistics.median(plain)


def measure(*, size: Size, device: torch.device | None = None) -> dict[str, Any]:
    """Both overheads, for the JSON's ``machine.overheads``."""
    return {
        **depth_change(size=size, device=device),
        "audit_ratio": audit_ratio(size=size, device=device),
    }
