"""Measurements of one step: backward FLOPs, bytes saved for backward, peak RSS, time."""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable

import torch

from .methods import Runner
from .workloads import Depth


def backward_flops(runner: Runner, method: str, depth: Depth) -> int:
    """FLOPs that ``loss.backward()`` runs (``FlopCounterMode`` around the backward only)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)

    def counted(loss: torch.Tensor) -> None:
        with counter:
            loss.backward()

    runner.step(method, depth, backward=counted)
    return int(counter.get_total_flops())


def saved_bytes(runner: Runner, method: str, depth: Depth) -> int:
    """Bytes autograd saves for backward: each storage once, parameters excluded."""
    model = runner.model_for(method)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in params:
            seen.setdefault(key, storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        runner.step(method, depth)
    return sum(seen.values())


def peak_rss_bytes(step: Callable[[], None]) -> int | None:
    """Peak resident memory of this process during ``step()``, or None where not measurable.

    Frees what the allocator holds (``malloc_trim``), resets the kernel's high-water mark
    (``/proc/self/clear_refs``) and reads ``VmHWM`` after the step (Linux only).
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return None
    step()
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def timed(step: Callable[[], None]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    step()
    return time.perf_counter() - start
