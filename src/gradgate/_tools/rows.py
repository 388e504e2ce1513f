"""Learn rows, not only tensors: only some rows of an embedding's (or a linear layer's) weight
learn, with gradients and optimizer state the size of those rows.

``learn_rows(model, "model.embed_tokens", rows=new_ids)`` freezes the weight and registers a
parameter of the rows alone, ``weight_rows``, on the module: ``model.parameters()`` hands it
to any optimizer, which keeps state for the rows only, and no optimizer can move the other rows
(they have no gradient). How the rows get their gradient, and how the weight is kept holding
their values, is in :mod:`.row_grads`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from .._plumbing.errors import InvalidOptionError, RowsError, UnknownModuleError
from .._plumbing.handles import Handle
from .._select.names import check_module, find_module
from .freeze import _locations, _pop_flag, _push_flag
from .row_grads import (
    ATTRIBUTE,
    AfterStep,
    FoldRows,
    LoadRows,
    RowsForward,
    RowsLink,
    live_link,
    sharded,
    sharded_message,
)

Rows = Iterable[int] | torch.Tensor


class RowsHandle(Handle):
    """Undoes one :func:`learn_rows`: the learned rows written into the weight, the rows
    parameter taken off the module, the weight's ``requires_grad`` as it was; exactly once."""

    def __init__(self, name: str, link: RowsLink) -> None:
        super().__init__(self._restore, description=f"learn_rows {name!r} ({len(link.rows)} rows)")
        self._name, self._link = name, link
        self._module: nn.Module | None = None
        self._slots: list[tuple[nn.Module, str]] = []
        self._wrappers: list[RowsForward] = []
        self._hooks: list[RemovableHandle] = []

    @property
    def module(self) -> str:
        """The qualified name of the module whose rows learn."""
        return self._name

    @property
    def rows(self) -> list[int]:
        """The learning rows, in the order of the rows of ``parameter``."""
        return [int(row) for row in self._link.rows]

    @property
    def parameter(self) -> nn.Parameter:
        """The rows-sized parameter that learns (``weight_rows`` on the module)."""
        return self._link.param

    @property
    def weight(self) -> nn.Parameter:
        """The module's (frozen) weight."""
        return self._link.weight

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The rows alone, for a small checkpoint: ``{"rows": ids, "weight": values}``."""
        return {"rows": self._link.rows.clone(), "weight": self._link.param.detach().clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load rows saved by ``state_dict()`` (the same rows, in the same order)."""
        rows, values = state.get("rows"), state.get("weight")
        if not isinstance(rows, torch.Tensor) or rows.tolist() != self.rows:
            shown = rows.tolist() if isinstance(rows, torch.Tensor) else rows
            raise RowsError(
                f"the state holds rows {shown!r:.80}, this handle learns rows {self.rows!r:.80} "
                f"of {self._name!r}; expected the same rows in the same order. Load it into the "
                "handle of a learn_rows call with those rows."
            )
        if not isinstance(values, torch.Tensor) or values.shape != self.parameter.shape:
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else values
            raise RowsError(
                f"the state's 'weight' is {shape!r:.60}; expected a tensor of shape "
                f"{tuple(self.parameter.shape)} (the rows' values), as state_dict() writes it."
            )
        with torch.no_grad():
            self.parameter.copy_(values)
        self._link.write()

    def _restore(self) -> None:
        link = self._link
        link.write()
        for wrapper in reversed(self._wrappers):
            wrapper.uninstall()
        for hook in self._hooks:
            hook.remove()
        if self._module is not None and self._module._parameters.get(ATTRIBUTE) is link.param:
            del self._module._parameters[ATTRIBUTE]
        for module, name in reversed(self._slots):
            _pop_flag(self, module, name)


def learn_rows(model: nn.Module, module: str | nn.Module, rows: Rows) -> RowsHandle:
    """Only ``rows`` of ``module``'s weight learn; returns a handle (a context manager).

    ``module`` is an ``nn.Embedding`` or ``nn.Linear`` (or a subclass; a name in ``model`` or
    the module itself): its weight's rows are token ids of an embedding, output features of a
    linear layer (an LM head). The weight is frozen and a parameter of the rows alone,
    ``weight_rows``, is registered on the module, so ``torch.optim.AdamW(model.parameters())``
    keeps state for the rows only, and no optimizer can move the other rows: they get no
    gradient. The rows' gradient equals plain autograd's (the embedding's bit for bit; a
    linear layer's to rounding, bit for bit where the BLAS sums k rows as it sums them all).
    A weight tied into other modules (GPT-2's ``wte`` and ``lm_head``) learns its rows through
    every use. ``state_dict()`` holds the weight with the learned rows and no new key (HF
    ``save_pretrained`` just works); ``handle.remove()`` writes the rows into the weight and
    gives back the plain model. A frozen weight (``gg.freeze(model, "**")`` first) still
    learns its rows, and is frozen again after ``remove()``.

    >>> import torch, gradgate as gg
    >>> emb = torch.nn.Embedding(10, 4)
    >>> with gg.learn_rows(emb, "", rows=[7, 9]) as handle:
    ...     emb(torch.tensor([1, 7, 7])).sum().backward()
    ...     handle.parameter.grad, emb.weight.grad
    (tensor([[2., 2., 2., 2.],
            [0., 0., 0., 0.]]), None)
    """
    check_module(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise RowsError(
            "learn_rows got a DistributedDataParallel wrapper: DDP fixed the parameters it "
            "all-reduces when it was built, so a rows parameter added now would never be "
            "averaged; expected the plain model. Call gg.learn_rows(model, ...) first, then "
            "wrap it: DDP(model)."
        )
    name, target = _module(model, module)
    weight = _weight(name, target)
    ids = check_rows(rows, size=weight.shape[0], name=name)
    holders = _holders(model, name, weight)
    param = nn.Parameter(weight.detach().index_select(0, _on(ids, weight)).clone())
    link = RowsLink(name, weight, ids, param)
    link.uses = list(dict.fromkeys(q.rpartition(".")[0] for q, _, _ in holders))
    handle = RowsHandle(name, link)
    try:
        _apply(handle, target, holders)
    except BaseException:
        handle.remove()
        raise
    return handle


def _apply(
    handle: RowsHandle, target: nn.Module, holders: list[tuple[str, nn.Module, str]]
) -> None:
    link = handle._link
    weight = link.weight
    target.register_parameter(ATTRIBUTE, link.param)
    handle._module = target
    for _, module, attribute in holders:
        _push_flag(handle, module, attribute, False)
        handle._slots.append((module, attribute))
    if weight.grad is not None:  # earlier micro-batches: their rows' part carries on
        link.param.grad = weight.grad.index_select(0, _on(handle.rows, weight)).clone()
        weight.grad = None
    seen: set[int] = set()
    for qualified, module, attribute in holders:
        if id(module) not in seen:
            seen.add(id(module))
            use = qualified.rpartition(".")[0]
            wrapper = RowsForward(module, link, attribute, use)
            wrapper.install()
            handle._wrappers.append(wrapper)
    handle._hooks.append(target.register_state_dict_post_hook(FoldRows(link)))
    handle._hooks.append(target.register_load_state_dict_pre_hook(LoadRows(link)))
    after_step = register_optimizer_step_post_hook(AfterStep(link))
    handle._hooks.append(after_step)
    weakref.finalize(link, after_step.remove)  # the global hook goes with the model


def _on(ids: list[int], weight: torch.Tensor) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=weight.device)


def _module(model: nn.Module, module: object) -> tuple[str, nn.Module]:
    if isinstance(module, nn.Module):
        for name, found in model.named_modules():
            if found is module:
                return name, found
        raise UnknownModuleError(
            f"the module given ({type(module).__name__}) is not in {type(model).__name__}; "
            "expected one of its modules, by name or as the object: e.g. "
            "gg.learn_rows(model, model.get_input_embeddings(), rows=...)."
        )
    if not isinstance(module, str):
        raise InvalidOptionError(
            f"module={module!r:.60} ({type(module).__name__}); expected the name of an "
            "nn.Embedding or nn.Linear in the model (e.g. 'model.embed_tokens', 'lm_head'; '' "
            "for the model itself) or the module."
        )
    return ("", model) if module == "" else find_module(model, module)


def _weight(name: str, module: nn.Module) -> nn.Parameter:
    kind = type(module).__name__
    if not isinstance(module, (nn.Embedding, nn.Linear)):
        raise RowsError(
            f"{name!r} is a {kind}, which has no weight rows learn_rows can follow; expected "
            "an nn.Embedding (rows: token ids) or an nn.Linear (rows: output features, as in "
            "an LM head), or a subclass. Name the embedding or the head, e.g. "
            "'model.embed_tokens' or 'lm_head'."
        )
    weight = module._parameters.get("weight")
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        raise RowsError(
            f"{name!r} ({kind}) has no 2-D weight parameter (its weight is "
            f"{type(weight).__name__}); expected a weight of shape (rows, features)."
        )
    if not weight.is_floating_point():
        raise RowsError(
            f"the weight of {name!r} is {weight.dtype} (quantized or integer), which cannot "
            "learn; expected a floating-point weight."
        )
    if isinstance(module, nn.Embedding) and module.max_norm is not None:
        raise RowsError(
            f"{name!r} has max_norm={module.max_norm!r}: each forward renormalizes rows of the "
            "weight in place, which the rows parameter would not follow; expected "
            f"max_norm=None. Set model.get_submodule({name!r}).max_norm = None first."
        )
    if sharded(weight):
        raise RowsError(sharded_message(name))
    link = live_link(module)
    if link is not None and link.name != name:
        _tied_refusal(name, link.name, link)
    if link is not None or ATTRIBUTE in module._parameters or hasattr(module, ATTRIBUTE):
        held = f"rows {[int(r) for r in link.rows]!r:.60}" if link is not None else ATTRIBUTE
        raise RowsError(
            f"{name!r} already learns {held} through gg.learn_rows; a module's weight takes "
            "one learn_rows at a time. Remove that handle first (handle.remove(), which keeps "
            "the rows it learned), then call gg.learn_rows once with all the rows."
        )
    return weight


def _holders(model: nn.Module, name: str, weight: nn.Parameter) -> list[tuple[str, nn.Module, str]]:
    """Every (module, attribute) holding the weight: the module itself and those tied to it."""
    found = _locations(model).get(id(weight), [])
    for qualified, module, attribute in found:
        link = live_link(module)
        if link is not None:
            _tied_refusal(name, qualified, link)
        if not isinstance(module, (nn.Embedding, nn.Linear)) or attribute != "weight":
            raise RowsError(
                f"the weight of {name!r} is also {qualified!r} ({type(module).__name__}), a use "
                "learn_rows cannot follow (it follows nn.Embedding and nn.Linear weights); "
                "expected it tied only to embeddings and linear layers. Untie it, or learn the "
                "whole weight."
            )
    return found


def _tied_refusal(name: str, tied: str, link: RowsLink) -> None:
    raise RowsError(
        f"the weight of {name!r} is tied to {tied!r}, whose rows "
        f"{[int(r) for r in link.rows]!r:.60} already learn through gg.learn_rows of "
        f"{link.name!r}, through both uses; expected one learn_rows per weight. Remove that "
        "handle first, then call gg.learn_rows once with all the rows."
    )


def check_rows(rows: object, *, size: int, name: str) -> list[int]:
    """The rows as a list of distinct ints in ``0..size-1``, else an error naming the value."""
    if isinstance(rows, torch.Tensor):
        if rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
            raise InvalidOptionError(
                f"rows is a {rows.dtype} tensor; expected integer row indices (token ids), "
                "e.g. torch.tensor([32000, 32001]) or tokenizer.convert_tokens_to_ids(...)."
            )
        if rows.dim() > 1:
            raise InvalidOptionError(
                f"rows has shape {tuple(rows.shape)}; expected one index per row (a 1-D "
                "tensor or a list). Flatten it: rows=ids.flatten()."
            )
        rows = rows.reshape(-1).tolist()
    if isinstance(rows, (str, bytes, int, float)) or not isinstance(rows, Iterable):
        raise InvalidOptionError(
            f"rows={rows!r:.60} ({type(rows).__name__}); expected a list of row indices "
            "(token ids), e.g. rows=[32000, 32001]; for one row, rows=[32000]."
        )
    found: list[int] = []
    for row in rows:
        found.append(_row(row, size, name))
    if not found:
        raise InvalidOptionError(
            f"rows is empty; expected at least one row index of {name!r} to learn (0..{size - 1})."
            " With no new tokens there is nothing to learn: skip the learn_rows call."
        )
    twice = sorted({row for row in found if found.count(row) > 1})
    if twice:
        raise InvalidOptionError(
            f"rows lists {twice!r:.60} more than once; expected each row once (a row has one "
            "value to learn). Pass sorted(set(rows))."
        )
    return found


def _row(row: Any, size: int, name: str) -> int:
    if isinstance(row, torch.Tensor) and row.dim() == 0 and not row.is_floating_point():
        row = row.item()
    if isinstance(row, bool) or not hasattr(row, "__index__"):
        raise InvalidOptionError(
            f"rows holds {row!r:.40} ({type(row).__name__}); expected integer row indices "
            "(token ids). Convert them: rows=[int(i) for i in ids]."
        )
    index = int(row.__index__())
    if not 0 <= index < size:
        raise InvalidOptionError(
            f"row {index} is out of range for {name!r}, which has {size} rows (0..{size - 1}); "
            "expected an index into the weight. Resize it first for new tokens "
            "(model.resize_token_embeddings(len(tokenizer))), then call gg.learn_rows."
        )
    return index
