"""A batch as samples: the padding layout, one sample's rows cut out of a batch tensor (only
its tokens when a padding mask says where they are), a batch put back together from entries,
and a block's arguments and output narrowed to some of the samples and widened again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..._plumbing.autograd import tensors_in
from ..._plumbing.torch_internals.trees import tree_flatten, tree_unflatten


def batch_size(args: Any, kwargs: dict[str, Any]) -> int | None:
    """The first dimension of the first tensor input (``None``: no tensor with a dimension)."""
    tensor = first_tensor(args, kwargs, dimensions=True)
    return None if tensor is None else int(tensor.shape[0])


def first_tensor(args: Any, kwargs: Any, *, dimensions: bool = False) -> torch.Tensor | None:
    """The first tensor among ``args`` then ``kwargs`` (with ``dimensions``: that has one);
    looks inside containers only when no argument is a tensor itself."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and (value.dim() or not dimensions):
            return value
    for value in tensors_in((args, kwargs)):
        if value.dim() or not dimensions:
            return value
    return None


@dataclass(frozen=True)
class Padding:
    """Where each sample's tokens are in a padded batch: a 2-D ``attention_mask`` whose ones
    form one run per row (``starts``, ``lengths``), ``steps`` long. Tensors with that many
    steps in their second dimension keep only the tokens in an entry."""

    steps: int
    starts: list[int]
    lengths: list[int]

    @staticmethod
    def of(kwargs: dict[str, Any], batch: int) -> Padding | None:
        """The layout of a forward's ``attention_mask`` keyword, if it has a usable one."""
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != batch:
            return None
        if mask.is_floating_point() or mask.is_complex():
            return None  # an additive mask, not ones and zeros
        ones = mask != 0
        steps = ones.shape[1]
        lengths = ones.sum(1)
        starts = ones.to(torch.int8).argmax(1)
        position = torch.arange(steps, device=mask.device)
        run = (position >= starts[:, None]) & (position < (starts + lengths)[:, None])
        if not bool((run == ones).all()) or not bool((lengths > 0).all()):
            return None  # holes in a row (packed samples), or a row with no token
        return Padding(steps, starts.tolist(), lengths.tolist())

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.dim() >= 2 and tensor.shape[1] == self.steps


def sample_rows(
    tensor: torch.Tensor, rows: list[int], padding: Padding | None, device: torch.device
) -> list[torch.Tensor]:
    """Each of ``rows`` of ``tensor`` as a tensor of its own on ``device``, detached; a row
    padded on the right (its tokens first) keeps only its tokens."""
    tensor = tensor.detach()
    if padding is not None and padding.fits(tensor):
        return [
            tensor[i, : padding.lengths[i] if padding.starts[i] == 0 else padding.steps].to(
                device, copy=True
            )
            for i in rows
        ]
    if tensor.device != device:
        moved = tensor[rows].to(device)  # one copy across devices
        return [row.clone() for row in moved.unbind(0)]
    return [tensor[i].clone() for i in rows]


def assemble(
    entries: list[torch.Tensor],
    rows: list[int],
    live: torch.Tensor,
    padding: Padding | None,
    *,
    keep: bool,
) -> torch.Tensor:
    """A batch tensor like ``live`` whose ``rows`` are ``entries``, its other rows ``live``'s
    when ``keep``. An entry of a right-padded row holds its tokens only: the padding after them
    comes back as zeros (see docs/prefix-cache.md for when that is exact)."""
    first = entries[0]
    batch = live.shape[0]
    if padding is not None and padding.fits(live):
        shape = (batch, padding.steps, *first.shape[1:])
        out = torch.zeros(shape, dtype=first.dtype, device=live.device)
        if keep:
            others = [i for i in range(batch) if i not in set(rows)]
            out[others] = live[others].to(first.dtype)
        for i, entry in zip(rows, entries, strict=True):
            out[i, : entry.shape[0]] = entry.to(live.device, non_blocking=True)
        return out
    stacked = torch.stack(entries).to(live.device, non_blocking=True)
    if not keep:
        return stacked
    out = live.clone()
    out[rows] = stacked
    return out


def narrow_batch(value: Any, index: torch.Tensor, batch: int) -> Any:
    """``value`` with each tensor whose first dimension is the batch cut to ``index``'s rows."""
    leaves, spec = tree_flatten(value)
    picked = [
        leaf.index_select(0, index.to(leaf.device))
        if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] == batch
        else leaf
        for leaf in leaves
    ]
    return tree_unflatten(picked, spec)


def widen_batch(value: Any, index: torch.Tensor, part: int, batch: int) -> Any:
    """``value`` (a block's output for ``part`` rows) with each tensor whose first dimension is
    ``part`` put back at ``index``'s rows of a batch of zeros."""
    leaves, spec = tree_flatten(value)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] == part:
            wide = leaf.new_zeros((batch, *leaf.shape[1:]))
            wide.index_copy_(0, index.to(leaf.device), leaf)
            leaf = wide
        out.append(leaf)
    return tree_unflatten(out, spec)


_PLAIN = (type(None), bool, int, float, str)


class Template:
    """The shape of a block's output as it relates to its input, to stand in for the block
    when its output is not needed (a hit: only the first learner's input matters, and that
    comes from the cache). A dimension equal to the input's follows the input (batch, tokens);
    the others are fixed. Tensors the size of the input are the input itself; the others are
    zeros that take no memory."""

    def __init__(self, args: Any, kwargs: Any, output: Any) -> None:
        x = first_tensor(args, kwargs)
        leaves, self.spec = tree_flatten(output)
        self.usable = x is not None and all(
            isinstance(leaf, (torch.Tensor, *_PLAIN)) for leaf in leaves
        )
        shape = tuple(x.shape) if x is not None else ()
        self.leaves = [
            (_relation(shape, leaf.shape), leaf.dtype, leaf.shape == x.shape)  # type: ignore[union-attr]
            if isinstance(leaf, torch.Tensor)
            else leaf
            for leaf in leaves
        ]

    def fake(self, args: Any, kwargs: Any) -> Any:
        x = first_tensor(args, kwargs)
        assert x is not None
        out = []
        for leaf in self.leaves:
            if not isinstance(leaf, tuple):
                out.append(leaf)
                continue
            relation, dtype, same = leaf
            shape = [x.shape[d] if d is not None else size for d, size in relation]
            if same and list(x.shape) == shape and x.dtype == dtype:
                out.append(x)
            else:
                out.append(torch.zeros((), dtype=dtype, device=x.device).expand(shape))
        return tree_unflatten(out, self.spec)


def _relation(shape: tuple[int, ...], out: torch.Size) -> list[tuple[int | None, int]]:
    return [
        (d if d < len(shape) and shape[d] == size else None, size) for d, size in enumerate(out)
    ]
