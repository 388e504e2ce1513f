"""Fingerprints: of the prefix's weights (cheap, every forward: each tensor's identity, version
and storage; and by content, for a directory reused by a later run), and of each sample's inputs
(so that a key whose input changed is caught before its entry is served).

Content hashes are exact integer arithmetic: each element's bits times a fixed pseudo-random
weight, summed modulo 2**64. Sums of integers do not depend on the order of the additions, so a
sample hashes the same in any batch, on any device, in any run.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..._plumbing.autograd import tensors_in

_MASK64 = (1 << 64) - 1
SAMPLED = 1 << 16  # elements of a sample's input hashed at most: larger inputs, evenly spaced
_SEED = 0x5EED_CAC4E
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensors_of(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """The parameters and buffers of ``modules`` (their own, not their submodules')."""
    found: list[torch.Tensor] = []
    for module in modules:
        found += [p for p in module._parameters.values() if p is not None]
        found += [b for b in module._buffers.values() if b is not None]
    return found


def weights_state(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """What changes when a weight does: a tensor replaced (identity), written in place (its
    version counter: optimizer steps, ``load_state_dict``, ``copy_``) or given new storage
    (``param.data = ...``). Read at every forward: three C attribute reads per tensor."""
    return (
        *map(id, tensors),
        *[t._version for t in tensors],
        *[t.data_ptr() for t in tensors],
    )


class Hasher:
    """Exact content hashes with the weights of one fixed sequence (made once, grown as needed,
    per device)."""

    def __init__(self) -> None:
        self._weights: dict[torch.device, torch.Tensor] = {}

    def weights(self, n: int, device: torch.device) -> torch.Tensor:
        have = self._weights.get(device)
        if have is None or have.numel() < n:
            size = 1 << max(10, (n - 1).bit_length())
            have = self._weights[device] = splitmix64(size).to(device)
        return have[:n]

    def rows(self, bits: torch.Tensor) -> torch.Tensor:
        """Per row of a 2-D integer tensor: its hash, an int64 tensor."""
        weights = self.weights(bits.shape[1], bits.device)
        return (bits.to(torch.int64) * weights).sum(1)

    def tensor(self, tensor: torch.Tensor) -> int:
        """One tensor's content, shape and dtype."""
        flat = as_bits(tensor.detach()).reshape(1, -1)
        value = int(self.rows(flat)[0]) if flat.numel() else 0
        return mix(value, describe(tensor.shape, tensor.dtype))

    def named(self, tensors: list[tuple[str, torch.Tensor]]) -> str:
        """The content of named tensors, as hex (a directory's weights)."""
        value = 0
        for name, tensor in tensors:
            value = mix(mix(value, zlib.crc32(name.encode())), self.tensor(tensor))
        return f"{value:016x}"


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers: floats by their bit patterns (so that -0.0 and 0.0,
    or two NaNs, are told apart as the cache must), integers and booleans as they are."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.is_floating_point():
        return tensor.contiguous().view(_BITS[tensor.element_size()])
    return tensor


def splitmix64(n: int) -> torch.Tensor:
    """``n`` pseudo-random int64 values, the same in every run and on every machine
    (SplitMix64 of 0..n-1, in wrapping int64 arithmetic).

    >>> splitmix64(2).tolist()
    [-8674301662963512680, -8409007157397751190]
    """
    z = (torch.arange(n, dtype=torch.int64) + _SEED) * _signed(0x9E3779B97F4A7C15)
    z = (z ^ _shift(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shift(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _shift(z, 31)


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    return (z >> bits) & ((1 << (64 - bits)) - 1)  # a logical shift of the 64-bit pattern


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def mix(value: int, other: int) -> int:
    """Combine two hashes (unsigned 64-bit)."""
    return ((value * 0x100000001B3) ^ (other & _MASK64)) & _MASK64


def describe(shape: Any, dtype: torch.dtype) -> int:
    return zlib.crc32(repr((tuple(shape), str(dtype))).encode())


def input_fingerprints(
    hasher: Hasher,
    args: Any,
    kwargs: dict[str, Any],
    batch: int,
    starts: list[int] | None,
    lengths: list[int] | None,
) -> list[int]:
    """Per sample, a hash of its inputs: every tensor input whose first dimension is the batch
    (keyword inputs named like labels left out: the prefix does not read them), sorted by
    keyword; of a large input (an image), 65,536 elements evenly spaced. With a padding mask
    (``starts``, ``lengths``), inputs as long as the mask count only the sample's tokens,
    wherever the padding puts them."""
    named = [(str(i), v) for i, v in enumerate(tensors_in(args))]
    named += [(k, v) for k in sorted(kwargs) if "label" not in k for v in tensors_in(kwargs[k])]
    result = torch.zeros(batch, dtype=torch.int64)
    counted = None if lengths is None else torch.tensor(lengths, dtype=torch.int64)
    for name, tensor in named:
        if tensor.dim() == 0 or tensor.shape[0] != batch:
            continue
        trimmed = starts is not None and tensor.dim() >= 2 and lengths is not None
        if trimmed and counted is not None and tensor.shape[1] == _mask_length(kwargs):
            bits = _content_bits(tensor, starts, lengths)  # type: ignore[arg-type]
            shape: Any = counted * 1000003 + describe(tensor.shape[2:], tensor.dtype)
        else:  # the same shape every time: of a large one (an image) a sample is enough, as a
            # new crop, flip or jitter changes every element
            bits = as_bits(tensor.detach()).reshape(batch, -1)
            if bits.shape[1] > SAMPLED:
                bits = bits[:, :: -(-bits.shape[1] // SAMPLED)]
            shape = describe(tensor.shape[1:], tensor.dtype)
        bits = bits.reshape(batch, -1)
        hashed = hasher.rows(bits).cpu() if bits.shape[1] else 0
        result = _mix(_mix(_mix(result, zlib.crc32(name.encode())), shape), hashed)
    return result.tolist()  # type: ignore[no-any-return]


def _mix(value: torch.Tensor, other: Any) -> torch.Tensor:
    mixed: torch.Tensor = (value * 0x100000001B3) ^ other  # wrapping int64 arithmetic
    return mixed


def _mask_length(kwargs: dict[str, Any]) -> int:
    return int(kwargs["attention_mask"].shape[1])


def _content_bits(tensor: torch.Tensor, starts: list[int], lengths: list[int]) -> torch.Tensor:
    """Each row's tokens moved to the front (padding zeroed), flattened per sample."""
    batch, steps = tensor.shape[:2]
    bits = as_bits(tensor.detach())
    position = torch.arange(steps, device=tensor.device)
    start = torch.tensor(starts, device=tensor.device)
    length = torch.tensor(lengths, device=tensor.device)
    index = (position + start[:, None]) % steps  # the row rolled so its tokens come first
    shape = (batch, steps, *([1] * (tensor.dim() - 2)))
    rolled = bits.gather(1, index.view(shape).expand(bits.shape))
    keep = (position[None, :] < length[:, None]).view(shape)
    return torch.where(keep, rolled, torch.zeros((), dtype=rolled.dtype, device=rolled.device))
