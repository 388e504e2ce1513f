"""What differs between devices: how a step is timed and how its peak memory is read.

Everything else in the benchmark is device-agnostic. :func:`meter_for` picks the pair:

* CPU: wall time (``time.perf_counter``) and the process's peak resident memory during the
  step above what was resident before it (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs``);
* CUDA: CUDA events around the step and ``torch.cuda.max_memory_allocated`` during the step
  above ``torch.cuda.memory_allocated`` before it.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._plumbing.errors import InvalidOptionError, NoCudaError

Step = Callable[[], None]


@dataclass(frozen=True)
class Meter:
    """How to time one step and measure its peak memory on one device."""

    seconds: Callable[[Step], float]
    peak_bytes: Callable[[Step], int | None]
    timing: str
    peak: str


def resolve(device: str) -> torch.device:
    """The torch device for a ``--device`` value; a clear error when it is not usable here.

    >>> resolve("cpu")
    device(type='cpu')
    """
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise NoCudaError(
                f"--device {device}: CUDA is not available here (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda}); use --device cpu, or run on a machine "
                "with an NVIDIA GPU and a CUDA build of torch."
            )
        return torch.device(device)
    if device != "cpu":
        raise InvalidOptionError(f"--device {device!r}; expected 'cpu', 'cuda' or 'cuda:N'.")
    return torch.device("cpu")


def meter_for(device: torch.device) -> Meter:
    """The timer and peak-memory functions for ``device``.

    >>> meter_for(torch.device("cpu")).seconds.__name__
    'wall_seconds'
    """
    if device.type == "cuda":
        return Meter(
            seconds=cuda_seconds,
            peak_bytes=cuda_peak_bytes,
            timing="CUDA events around forward + backward + optimizer step",
            peak="torch.cuda.max_memory_allocated during the step above memory_allocated before",
        )
    return Meter(
        seconds=wall_seconds,
        peak_bytes=rss_peak_bytes,
        timing="wall seconds (time.perf_counter) of forward + backward + optimizer step",
        peak="VmHWM during the step above VmRSS before it (reset via /proc/self/clear_refs)",
    )


def describe(device: torch.device) -> str:
    """A human name for ``device``: the GPU's name on CUDA, the CPU model otherwise."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({cpu_name()})"


def wall_seconds(step: Step) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def cuda_seconds(step: Step) -> float:
    """Seconds of one call on the GPU, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def cuda_peak_bytes(step: Step) -> int:
    """The most CUDA memory allocated during the step, above what was allocated before it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated()) - int(before)


def rss_peak_bytes(step: Step) -> int | None:
    """The process's peak resident memory during the step above its resident memory before
    it, or ``None`` where that cannot be measured (not Linux).

    Frees what the allocator holds (``malloc_trim``) and resets the kernel's high-water mark
    first, so the figure belongs to this step alone.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        before = _status_bytes("VmRSS:")
    except OSError:
        return None
    step()
    after = _status_bytes("VmHWM:")
    return None if before is None or after is None else max(0, after - before)


def _status_bytes(field: str) -> int | None:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return None


def cpu_name() -> str:
    """The CPU's model name (Linux), else what :mod:`platform` knows."""
    import platform

    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
