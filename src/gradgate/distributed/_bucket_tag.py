"""Which parameters a rank sends in a bucket, written into the bucket's own all-reduce.

``allreduce_trained(..., assume_same_plan=True)`` exchanges no flags before sending. Each rank
appends one digit per parameter of the bucket (1: sent, 0: not), packed in base ``world + 1``
into as few elements as the bucket's dtype sums exactly. After the sum every digit is 0 or
``world`` exactly when every rank sent the same parameters; every rank reads the same sums, so
either all of them raise or none does. There is no hash, so no two layouts can collide.

>>> import torch
>>> tag = encode([True, False, True], 2, torch.bfloat16)
>>> tag.tolist()
[10.0]
>>> disagreeing(tag * 2, 3, 2)
[]
>>> disagreeing(tag + encode([False, True, True], 2, torch.bfloat16), 3, 2)
[0, 1]
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=16)
def digits_per_element(world: int, dtype: torch.dtype) -> int:
    """How many base-``world + 1`` digits one element of ``dtype`` sums exactly (0: none)."""
    if not dtype.is_floating_point:
        return 0
    exact = 2 ** (1 - round(math.log2(torch.finfo(dtype).eps)))  # integers up to it are exact
    per, reach = 0, world + 1
    while reach <= exact:
        per, reach = per + 1, reach * (world + 1)
    return per


def encode(flags: list[bool], world: int, dtype: torch.dtype) -> torch.Tensor:
    """The flags as digits in base ``world + 1``, ``digits_per_element`` to an element."""
    per = digits_per_element(world, dtype)
    values = [
        sum(int(flag) * (world + 1) ** i for i, flag in enumerate(flags[start : start + per]))
        for start in range(0, len(flags), per)
    ]
    return torch.tensor(values, dtype=dtype)


def disagreeing(summed: torch.Tensor, count: int, world: int) -> list[int]:
    """Indices of the flags that not every rank set alike, read from the summed tags."""
    per = digits_per_element(world, summed.dtype)
    digits: list[int] = []
    for value in summed.tolist():
        number = int(value)
        if number != value or not 0 <= number < (world + 1) ** per:
            return list(range(count))  # not a sum of tags at all: a layout that differs
        for _ in range(per):
            number, digit = divmod(number, world + 1)
            digits.append(digit)
    return [i for i, digit in enumerate(digits[:count]) if digit not in (0, world)]
