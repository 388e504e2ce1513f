"""The cache's wrappers: around the root's ``forward`` (outside the gate's own guard, so that a
forward's keys and hits are known before the gate runs) and around each block's ``forward``
(outside the gate's block wrapper, so that a block the cache stands in for does not run at all).
A copy of the model (deepcopy, pickle, ``torch.save``) gets the forwards they wrapped."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..._plumbing import torch_internals as internals
from ..._plumbing.hooks import _InstanceForward
from ..._plumbing.torch_internals import skip_frames
from .keys import KEY_COLUMN


class CacheForward(_InstanceForward):
    """The root's forward with the cache around it. A ``gradgate_key`` keyword (a batch from
    ``PrefixCache.keyed`` passed as ``model(**batch)``) is taken out and gives the keys."""

    def __init__(self, module: nn.Module, cache: Any) -> None:
        super().__init__(module)
        self.cache = cache

    @property
    def __signature__(self) -> inspect.Signature:
        """The forward's signature with ``gradgate_key``, so that trainers that keep only the
        columns the forward takes (transformers' ``remove_unused_columns``) keep the keys."""
        signature = inspect.signature(self.inner)
        parameters = list(signature.parameters.values())
        if KEY_COLUMN in signature.parameters:
            return signature
        at = len(parameters)
        if parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD:
            at -= 1
        key = inspect.Parameter(KEY_COLUMN, inspect.Parameter.KEYWORD_ONLY, default=None)
        return signature.replace(parameters=[*parameters[:at], key, *parameters[at:]])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        keys = kwargs.pop(KEY_COLUMN, None)
        if not self.live or torch.compiler.is_compiling() or internals.eval_frame_callback():
            return self.inner(*args, **kwargs)
        return self.cache._forward(self.inner, args, kwargs, keys)


class BlockForward(_InstanceForward):
    """A block's forward, which the forward's run may stand in for."""

    around_forward = True  # compile_blocks compiles the forward beneath it

    def __init__(self, module: nn.Module, cache: Any, position: int) -> None:
        super().__init__(module)
        self.cache, self.position = cache, position

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = getattr(self.cache._local, "run", None)
        if run is None or not self.live:
            return self.inner(*args, **kwargs)
        return run.block(self.position, self.inner, args, kwargs)


skip_frames(CacheForward.__call__, BlockForward.__call__)  # dynamo never traces the cache
