"""Every workload of the benchmark by name, in the order the table shows them."""

from __future__ import annotations

from collections.abc import Callable

from .hf import gpt2, llama
from .workloads import Workload, conv_stack, transformer

FACTORIES: dict[str, Callable[..., Workload]] = {
    "transformer": transformer,
    "gpt2": gpt2,
    "llama": llama,
    "conv_stack": conv_stack,
}
