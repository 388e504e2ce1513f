"""A frozen prefix run three ways: ``.detach()``, ``torch.no_grad()``, ``torch.inference_mode()``.

Measures, for the prefix of a small MLP: bytes saved for backward (saved-tensor hooks, each
storage counted once), the peak of those bytes alive during the forward, and the median time of
prefix + suffix forward and backward. Times are ratios from one run on a noisy machine.
"""

import statistics
import time

import torch
from torch import nn

import gradgate as gg


class SavedBytes:
    """Counts the bytes autograd saves for backward while active (each storage once)."""

    def __init__(self) -> None:
        self.total = 0
        self._seen: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.total += storage.nbytes()
        return tensor

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def prefix_output(prefix: nn.Module, x: torch.Tensor, way: str) -> torch.Tensor:
    if way == "detach":
        return prefix(x).detach()
    if way == "no_grad":
        with torch.no_grad():
            return prefix(x)
    with torch.inference_mode():
        out = prefix(x)
    return out.clone()  # an inference tensor cannot be saved for backward; a clone can


def main() -> None:
    torch.manual_seed(0)
    prefix = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])
    suffix = nn.Linear(256, 1)
    x = torch.randn(512, 256)
    ways = ["detach", "no_grad", "inference_mode"]
    saved, times, grads = {}, {way: [] for way in ways}, {}
    for way in ways:
        with SavedBytes() as counter:
            prefix_output(prefix, x, way)
        saved[way] = counter.total
    for _ in range(7):  # interleaved, so a busy machine slows every way alike
        for way in ways:
            suffix.zero_grad()
            start = time.perf_counter()
            suffix(prefix_output(prefix, x, way)).mean().backward()
            times[way].append(time.perf_counter() - start)
            grads[way] = suffix.weight.grad.clone()
    seconds = {way: statistics.median(times[way]) for way in ways}

    base = seconds["no_grad"]
    print(f"prefix bytes saved for backward: {saved}")
    print(f"step time relative to no_grad: { {k: round(v / base, 2) for k, v in seconds.items()} }")
    print(
        f"detach records the prefix graph, the others do not: "
        f"{saved['detach'] > 0 and saved['no_grad'] == saved['inference_mode'] == 0}"
    )
    print(
        f"suffix gradients identical: "
        f"{all(torch.equal(grads['no_grad'], grads[way]) for way in ways)}"
    )

    with torch.inference_mode():
        raw = prefix(x)
    try:
        with gg.explain(suffix):
            suffix(raw)
    except gg.GradgateError as err:
        print(f"inference tensor without clone: {type(err).__name__}")


if __name__ == "__main__":
    main()
