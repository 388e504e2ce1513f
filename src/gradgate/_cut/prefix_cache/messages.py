"""What a prefix cache says when it cannot serve a hit: the likely causes, and the fix."""

from __future__ import annotations

import torch

from .keys import Key

UNKEYED = (
    "no forward of the cached model got keys in this training step, so the prefix cache stored "
    "nothing and will serve nothing. Train on gg.PrefixCache.keyed(dataset) (items carry a "
    "gradgate_key; call the model with model(**batch), or take the keys out yourself with "
    "cache.keys(...))."
)


def changed_input_message(key: Key) -> str:
    return (
        f"the input of key {key!r} differs from the input its entry was stored with (changed "
        "inputs for a key): random augmentation (a new crop or flip each epoch), masking drawn "
        "per epoch, or a key that names another sample now. The cache serves only inputs that "
        "repeat: augment after the cut, or not in cached epochs; give each distinct input its "
        "own key; or cache.clear() if the data changed for good."
    )


def mismatch_message(
    where: str, key: Key, cached: torch.Tensor, now: torch.Tensor, random_parts: list[str]
) -> str:
    """A checked hit differs from what the prefix computes now: the likely causes first."""
    causes = []
    if random_parts:
        listed = ", ".join(random_parts[:3])
        causes.append(f"dropout or BatchNorm in train mode before the cut ({listed})")
    causes += [
        "augmentation or other randomness inside the model's forward before the cut",
        "changed inputs for a key that the inputs' fingerprint cannot see (a buffer or state "
        "outside the inputs)",
        "weights before the cut changed where torch does not count it (param.data = ..., an "
        "optimizer writing through .data)",
        "kernels whose result depends on the batch (nondeterministic algorithms)",
    ]
    listed = "; ".join(f"{i + 1}) {cause}" for i, cause in enumerate(causes))
    difference = (
        f"largest difference {float((cached.float() - now.float()).abs().max()):.3g}"
        if cached.shape == now.shape
        else f"shape {tuple(cached.shape)} cached, {tuple(now.shape)} now"
    )
    return (
        f"check: the cached input of the first learner {where!r} for key {key!r} differs from "
        f"what the prefix computes now ({difference}), so hits would not be what the model "
        f"computes. Likely causes: {listed}. Fix the cause (eval mode before the cut, no "
        "augmentation), then cache.clear()."
    )
