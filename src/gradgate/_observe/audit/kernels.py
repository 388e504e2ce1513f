"""The GPU kernel view: which kernels a step launched, classified like the seeds' Nsight tables.

Kernels whose names say ``wgrad`` / ``dgrad`` (cuDNN convolutions) are classified by name;
other kernels launched by an autograd node count as ``other`` backward work, and kernels
launched outside backward as ``forward``. Needs CUDA (``torch.profiler``).
"""

from __future__ import annotations

import statistics
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..._plumbing.errors import NoCudaError

KernelKind = Literal["wgrad", "dgrad", "forward", "other"]
_BACKWARD_RANGE = "autograd::engine::evaluate_function"


@dataclass(frozen=True)
class KernelRow:
    """All launches of one kernel name: the seeds' table columns, in nanoseconds."""

    name: str
    kind: KernelKind
    durations_ns: tuple[int, ...]

    @property
    def instances(self) -> int:
        return len(self.durations_ns)

    @property
    def total_ns(self) -> int:
        return sum(self.durations_ns)


def classify_kernel(name: str, *, in_backward: bool) -> KernelKind:
    """``wgrad`` / ``dgrad`` from a kernel's name, else ``forward`` or ``other`` backward work.

    >>> classify_kernel("void cudnn::cnn::wgrad2d_grouped_direct_kernel<...>", in_backward=True)
    'wgrad'
    >>> classify_kernel("void implicit_convolve_sgemm<float>", in_backward=False)
    'forward'
    """
    lowered = name.lower()
    for kind in ("wgrad", "dgrad"):
        if kind in lowered:
            return kind  # type: ignore[return-value]
    return "other" if in_backward else "forward"


def require_cuda() -> None:
    """Raise :class:`NoCudaError` unless a CUDA device is available."""
    if not torch.cuda.is_available():
        raise NoCudaError(
            "the kernel view (kernels=True) needs a CUDA device; torch.cuda.is_available() "
            "is False. Use gg.audit(model) without kernels=True (wgrad/dgrad per autograd "
            "node) on this machine, or run on a machine with a GPU."
        )


@contextmanager
def _quiet_profiler() -> Iterator[None]:
    """torch.profiler warns that it "clears events at the end of each cycle" when a profile
    starts again; gradgate profiles exactly one cycle, so that warning says nothing here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle")
        yield


class KernelRecorder:
    """Records the CUDA kernels launched between :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        require_cuda()
        self._profile: Any = None
        self.rows: list[KernelRow] = []

    def start(self) -> None:
        """Start ``torch.profiler`` (CPU and CUDA activities)."""
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        with _quiet_profiler():
            self._profile.__enter__()

    def stop(self) -> list[KernelRow]:
        """Wait for the device, stop the profiler, and return the kernels by name."""
        prof, self._profile = self._profile, None
        if prof is None:
            return self.rows
        try:
            torch.cuda.synchronize()
        finally:
            with _quiet_profiler():
                prof.__exit__(None, None, None)
                events = prof.events()
        durations: dict[tuple[str, KernelKind], list[int]] = defaultdict(list)
        for event in events:
            for kernel in getattr(event, "kernels", []):
                kind = classify_kernel(kernel.name, in_backward=_in_backward(event))
                durations[(kernel.name, kind)].append(int(kernel.duration * 1000))
        self.rows = [KernelRow(name, kind, tuple(d)) for (name, kind), d in durations.items()]
        return self.rows


def profile_kernels(step: Callable[[], Any]) -> list[KernelRow]:
    """Run ``step`` (forward and backward) under ``torch.profiler``; its kernels, by name."""
    recorder = KernelRecorder()
    recorder.start()
    try:
        step()
    finally:
        rows = recorder.stop()
    return rows


@dataclass(frozen=True)
class KernelTable:
    """``report.kernels``: the kernels of an audited step, as in the seeds' Nsight tables.

    ``rows`` hold one kernel name each; ``counts`` the launches per kind (wgrad, dgrad,
    forward, other); ``table()`` (also ``str()``) the Nsight-style text table.
    """

    rows: tuple[KernelRow, ...]

    @property
    def counts(self) -> dict[str, int]:
        """Kernel launches per kind, e.g. ``{"wgrad": 10, "dgrad": 9, ...}``."""
        return count_kinds(list(self.rows))

    def table(self, *, width: int = 100) -> str:
        """The Nsight-style table, slowest kernel first."""
        return render_kernel_table(list(self.rows), width=width)

    def __str__(self) -> str:
        return self.table()


def _in_backward(event: Any) -> bool:
    while event is not None:
        if event.name.startswith(_BACKWARD_RANGE):
            return True
        event = event.cpu_parent
    return False


def count_kinds(rows: list[KernelRow]) -> dict[str, int]:
    """Kernel launches per kind, e.g. ``{"wgrad": 10, "dgrad": 9, ...}``."""
    counts = dict.fromkeys(("wgrad", "dgrad", "forward", "other"), 0)
    for row in rows:
        counts[row.kind] += row.instances
    return counts


def render_kernel_table(rows: list[KernelRow], *, width: int = 100) -> str:
    """The seeds' Nsight table (time share, totals, instances, avg/med/min/max/stddev),
    with a kind column, slowest first.

    >>> table = render_kernel_table([KernelRow("wgrad_kernel", "wgrad", (100, 300))])
    >>> table.splitlines()[1].split()
    ['100.0', '400', '2', '200.0', '200.0', '100', '300', '141.4', 'wgrad', 'wgrad_kernel']
    """
    ordered = sorted(rows, key=lambda row: row.total_ns, reverse=True)
    grand = sum(row.total_ns for row in ordered) or 1
    header = (
        " Time (%)  Total Time (ns)  Instances  Avg (ns)  Med (ns)  Min (ns)  Max (ns)"
        "  StdDev (ns)  Kind   Name"
    )
    lines = [header]
    for row in ordered:
        d = row.durations_ns
        spread = statistics.stdev(d) if len(d) > 1 else 0.0
        name = row.name if len(row.name) <= width else row.name[: width - 1] + "…"
        lines.append(
            f"{100 * row.total_ns / grand:9.1f}  {row.total_ns:15,}  {row.instances:9}  "
            f"{statistics.mean(d):8.1f}  {statistics.median(d):8.1f}  {min(d):8}  "
            f"{max(d):8}  {spread:11.1f}  {row.kind:<6} {name}"
        )
    return "\n".join(lines)
