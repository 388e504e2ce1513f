"""LearnerMasters: fp32 master copies and optimizer state only for the parameters that learn.

BAdam's memory (Luo et al. 2024) for any plan: every weight stays in bf16 (or fp16); a parameter
that has a ``.grad`` at ``step()`` gets an fp32 master and the inner optimizer's state, the
update runs on the master and is copied back rounded to the parameter's dtype; a parameter that
stops learning drops them (or, with ``offload="cpu"``, they wait in CPU memory).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch

from .._plumbing.errors import InvalidOptionError
from .._plumbing.validate import check_choice
from . import sharded
from .masters_checks import refuse_plain, refused

__all__ = ["LearnerMasters"]

_LOW = (torch.bfloat16, torch.float16)  # these get masters
_IN_PLACE = (torch.float32, torch.float64)  # these the inner optimizer steps as they are
# a chunk of learners stepped together holds at least this many elements: fewer inner calls for
# many small parameters, while the temporaries stay near those of the largest parameter
_CHUNK_FLOOR = 1 << 20
_REFUSED = {
    "LBFGS": "it needs a closure and searches along all parameters at once",
    "SparseAdam": "it needs sparse gradients",
}


class LearnerMasters(torch.optim.Optimizer):
    """A torch optimizer over bf16/fp16 parameters with fp32 masters only for what learns.

    ``optimizer_class`` is an element-wise torch optimizer (``torch.optim.AdamW``, ``Adam``,
    ``SGD`` with momentum, ...) built with ``options``; its hyperparameters appear in this
    optimizer's ``param_groups``, so LR schedulers and trainers see an ordinary optimizer.

    At each :meth:`step`, every parameter with a ``.grad`` gets (or keeps) an fp32 master, made
    from its current value, and the inner optimizer's state; the update runs on the master and
    is copied back in the parameter's dtype. A bf16/fp16 parameter without a ``.grad`` rests:
    its master and state are dropped first (BAdam's reset; a new master is made from the
    parameter when it learns again), or with ``offload="cpu"`` they wait in CPU memory and come
    back exactly. float32/float64 parameters get no master: the inner optimizer steps them in
    place, exactly as it would alone (their state goes only through
    :func:`gradgate.optim.drop_state`). A parameter written from outside (its version moved
    since the last copy back) gets a new master from its value: the parameter is the truth.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).bfloat16()
    >>> opt = gg.optim.LearnerMasters(torch.optim.AdamW, net.parameters(), lr=1e-3)
    >>> _ = net[1].weight.requires_grad_(False)
    >>> net(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    >>> opt.step()
    >>> sorted(opt.state[net[0].weight])
    ['exp_avg', 'exp_avg_sq', 'master', 'step']
    >>> opt.state[net[0].weight]["master"].dtype, net[1].weight in opt.state
    (torch.float32, False)
    >>> opt.master_bytes()  # 21 learning parameters x 12 bytes, 3 step counters x 4 bytes
    264
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any],
        *,
        offload: str | None = None,
        **options: Any,
    ) -> None:
        _check_class(optimizer_class)
        check_choice("offload", offload, (None, "cpu"))
        groups = _groups(params)
        for group in groups:
            _check_dtypes(group["params"])
        self._inner = _inner_optimizer(optimizer_class, groups, options)  # never `optimizer`:
        # the trainer callbacks unwrap that attribute (accelerate's and DeepSpeed's wrappers)
        self._offload = offload
        self._known: set[torch.Tensor] = set()  # the parameters given (add_param_group)
        self._resting: set[torch.Tensor] = set()  # entries waiting on the CPU (offload)
        self._versions: dict[torch.Tensor, int] = {}  # each parameter's version at copy back
        super().__init__(groups, dict(self._inner.defaults))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch's), refusing parameters of a dtype that cannot have a master."""
        if isinstance(param_group, dict):
            _check_dtypes(_tensors_of(param_group.get("params", [])))
        super().add_param_group(param_group)
        self._known.update(self.param_groups[-1]["params"])

    def _take(self, params: Iterable[torch.Tensor], *, taken: bool = True) -> None:
        """Accept ``params`` in the groups though never given (``taken=False``: no longer):
        gradgate's DeepSpeed integration puts its stretches of ZeRO's partitions there."""
        (self._known.update if taken else self._known.difference_update)(params)

    # -- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step every parameter that has a ``.grad`` on its master; rest the others first."""
        if closure is None and sharded.is_checkpoint_probe(self):
            return None  # torch.distributed.checkpoint's probe would make masters of everything
        loss = None
        if closure is not None:  # Lightning runs forward and backward in it
            with torch.enable_grad():
                loss = closure()
        learners = self._learners()
        learning = {p for _, p in learners}
        # of the parameters in the groups now (DeepSpeed's ZeRO steps one group at a time)
        resting = {p for g in self.param_groups for p in g["params"]} - learning
        self._rest([p for p in self.state if p in resting and p.dtype in _LOW])
        inner = self._inner
        groups = [{**_options(g), "params": []} for g in self.param_groups]
        inner.param_groups = groups  # LR schedulers' lr and betas reach the inner optimizer
        try:
            for chunk in _chunks(learners):
                self._step_chunk(chunk, groups)
        finally:
            inner.param_groups = []
            inner.state.clear()
        return loss

    def _learners(self) -> list[tuple[int, torch.Tensor]]:
        found = []
        for index, group in enumerate(self.param_groups):
            for param in group["params"]:
                if param not in self._known and not self._adopt(param):
                    raise InvalidOptionError(
                        f"LearnerMasters' parameter groups hold a {tuple(param.shape)} "
                        f"{param.dtype} tensor it was not given (DeepSpeed ZeRO replaces the "
                        "groups with its own flat partitions); expected the model's "
                        "parameters: under DeepSpeed add "
                        "gg.integrations.deepspeed.step_learners_only(engine) after "
                        "deepspeed.initialize, which hands LearnerMasters each parameter's "
                        "stretch of them."
                    )
                if param.grad is not None:
                    found.append((index, param))
        return found

    def _adopt(self, param: torch.Tensor) -> bool:
        """Take a sharded parameter put in place of one given: accelerate's FSDP2 preparation
        swaps the model's parameters for their DTensor shards in the optimizer's groups."""
        if not sharded.is_sharded(param):
            return False
        self._known.add(param)
        return True

    def _step_chunk(
        self, chunk: list[tuple[int, torch.Tensor]], groups: list[dict[str, Any]]
    ) -> None:
        inner = self._inner
        for group in groups:
            group["params"] = []
        keys = []
        for index, param in chunk:
            key = self._wake(param, groups[index])
            if key is not param:
                key.grad = param.grad.to(torch.float32)  # type: ignore[union-attr]
            groups[index]["params"].append(key)
            inner.state[key] = {k: v for k, v in self.state[param].items() if k != "master"}
            keys.append((param, key))
        inner.step()
        for param, key in keys:
            self.state[param].update(inner.state.pop(key))
            if key is not param:
                key.grad = None
                param.copy_(key)  # rounds to nearest even: the bits of key.to(param.dtype)
                self._versions[param] = param._version

    def _wake(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The tensor the inner optimizer steps for ``param``: its master, or itself."""
        entry = self.state[param]
        if param in self._resting:
            self._resting.discard(param)
            for key, value in list(entry.items()):
                if isinstance(value, torch.Tensor):
                    entry[key] = value.to(_home(key, param, group))
        if param.dtype not in _LOW:
            return param
        master: torch.Tensor | None = entry.get("master")
        if master is None or self._versions.get(param) != param._version:
            master = entry["master"] = param.detach().to(torch.float32, copy=True)
            self._versions[param] = param._version
        return master

    def _rest(self, params: Iterable[torch.Tensor]) -> None:
        for param in params:
            if self._offload is None:
                self.state.pop(param, None)
                self._versions.pop(param, None)
                self._resting.discard(param)
                continue
            entry = self.state[param]
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    entry[key] = value.to("cpu")  # also after Lightning moved them back
            self._resting.add(param)

    def _rest_params(self, params: Iterable[torch.Tensor]) -> int:
        """What :func:`gradgate.optim.drop_state` does here: low-precision parameters rest (their
        masters and state dropped, or offloaded), others drop their state; ``.grad = None``.
        Returns the bytes freed on the device."""
        before = self.master_bytes()
        for param in params:
            if param in self.state:
                if param.dtype in _LOW:
                    self._rest([param])
                else:
                    del self.state[param]
            param.grad = None  # a zero .grad (zero_grad(set_to_none=False)) would step it
        return before - self.master_bytes()

    # -- memory and checkpoints ---------------------------------------------------------------
    def master_bytes(self) -> int:
        """Bytes of masters and inner-optimizer state held now on the parameters' devices.

        Entries resting on the CPU (``offload="cpu"``) are not counted; nor, for a parameter
        on a GPU, are scalars the inner optimizer keeps on the CPU (AdamW's ``step``).
        :func:`gradgate.optim.state_bytes` counts everything. Under FSDP2 (``fully_shard``)
        these are this rank's bytes: the masters and state of the learners' local shards.
        """
        storages: dict[int, Any] = {}
        for param, entry in self.state.items():
            if param in self._resting:
                continue
            for value in entry.values():
                if isinstance(value, torch.Tensor) and value.device == param.device:
                    storage = sharded.local(value).untyped_storage()
                    storages[id(storage)] = storage
        return sum(storage.nbytes() for storage in storages.values())

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict; each group also counts its parameters that have state
        (``learner_masters_held``), so that a load which lost them raises."""
        return sharded.with_held(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned; masters and moments keep their fp32 dtype.

        Load the model's weights first (HF and Lightning do): a parameter written after this
        gets a new master from its value. With ``offload="cpu"`` every entry starts resting on
        the CPU. A plain torch optimizer's state (bf16/fp16 moments, no masters) is refused;
        with its moments upcast to float32 first, it loads, and masters are made from the
        parameters at the next step.
        """
        saved = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(saved, dict) or not isinstance(state_dict.get("param_groups"), list):
            raise InvalidOptionError(
                f"state_dict={state_dict!r:.60}; expected the dict an optimizer's state_dict() "
                "returned, with 'state' and 'param_groups'."
            )
        groups = sharded.checked_held(state_dict["param_groups"], saved)
        entries = self._placed(saved, groups)
        # torch would cast masters to bf16
        super().load_state_dict({**state_dict, "param_groups": groups, "state": {}})
        self._resting.clear()
        self._versions.clear()
        for param, entry in entries.items():
            self.state[param] = entry
            if param.dtype in _LOW:
                self._versions[param] = param._version
                if self._offload is not None:
                    self._resting.add(param)

    def _placed(
        self, saved: dict[Any, Any], saved_groups: list[dict[str, Any]]
    ) -> dict[torch.Tensor, dict[str, Any]]:
        """The saved entries, keyed by parameter, copied where and as they belong."""
        ids = chain.from_iterable(g.get("params", ()) for g in saved_groups)
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        by_id = dict(zip(ids, params, strict=False))
        group_of = {i: g for g in saved_groups for i in g.get("params", ())}
        placed = {}
        for index, entry in saved.items():
            if index not in by_id:
                raise InvalidOptionError(
                    f"the state_dict has state for parameter {index!r}, which no saved group "
                    "holds; expected a state_dict of this optimizer's parameters."
                )
            param, group = by_id[index], group_of.get(index, {})
            refuse_plain(index, param, entry, low=_LOW)
            placed[param] = {k: self._loaded(k, v, param, group) for k, v in entry.items()}
        return placed

    def _loaded(self, key: str, value: Any, param: torch.Tensor, group: dict[str, Any]) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = sharded.sharded_like(value, param)  # a whole tensor (a full state dict) of a shard
        where = "cpu" if self._offload is not None and param.dtype in _LOW else None
        device = where or _home(key, param, group)
        if key == "step" or not value.is_floating_point():
            dtype = torch.float32 if key == "step" and _device_steps(group) else value.dtype
        elif param.dtype in _IN_PLACE:
            dtype = param.dtype  # as the inner optimizer alone loads it
        else:
            dtype = torch.promote_types(value.dtype, torch.float32)  # masters keep fp32
        return value.to(device=device, dtype=dtype, copy=True)

    # -- copies and display -------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        own = {name: getattr(self, name) for name in ("_inner", "_offload", "_known", "_resting")}
        # a copy's tensors count their versions afresh: keep only which ones were written
        written = {p: v != p._version for p, v in self._versions.items()}
        return {**super().__getstate__(), **own, "_versions": written}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # also what torch's load_state_dict calls, with its keys
        if "_versions" in state:
            written = state["_versions"].items()
            self._versions = {p: -1 if moved else p._version for p, moved in written}

    def __repr__(self) -> str:
        name = type(self._inner).__name__
        offload = f", offload={self._offload!r}" if self._offload else ""
        text = super().__repr__()
        return text.replace("LearnerMasters (", f"LearnerMasters({name}{offload}) (", 1)


def _check_class(optimizer_class: object) -> None:
    if not isinstance(optimizer_class, type) or not issubclass(
        optimizer_class, torch.optim.Optimizer
    ):
        shown = f"{optimizer_class!r:.60}"
        if isinstance(optimizer_class, torch.optim.Optimizer):
            shown = f"a {type(optimizer_class).__name__} instance"
        raise InvalidOptionError(
            f"optimizer_class={shown}; expected a torch.optim.Optimizer class (not an "
            "instance), e.g. "
            "gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), lr=1e-5)."
        )
    if issubclass(optimizer_class, LearnerMasters):
        raise InvalidOptionError(
            "optimizer_class=LearnerMasters; expected the optimizer that steps the masters, "
            "e.g. torch.optim.AdamW."
        )
    reason = _REFUSED.get(optimizer_class.__name__)
    if reason is not None:
        raise InvalidOptionError(
            f"optimizer_class={optimizer_class.__name__}: {reason}, and LearnerMasters steps "
            "the learning parameters' masters a few at a time; expected an element-wise "
            "optimizer, e.g. torch.optim.AdamW."
        )


def _groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """The parameter groups as torch would make them, before anything is built."""
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        raise InvalidOptionError(
            f"params={type(params).__name__}; expected an iterable of parameters or of "
            "parameter groups (dicts), e.g. model.parameters()."
        )
    items = list(params)
    if not items:
        raise InvalidOptionError(
            "params is empty; expected the model's parameters, e.g. model.parameters()."
        )
    if not isinstance(items[0], dict):
        return [{"params": items}]
    return [dict(g, params=_listed(g.get("params", []))) for g in items]


def _listed(params: Any) -> list[Any]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _tensors_of(params: Any) -> list[torch.Tensor]:
    """The tensors of a group's ``params`` (plain, or ``(name, tensor)`` pairs)."""
    found = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in _listed(params)]
    return [p for p in found if isinstance(p, torch.Tensor)]


def _check_dtypes(params: Any) -> None:
    for param in _tensors_of(params):
        if param.dtype not in _LOW + _IN_PLACE:
            raise InvalidOptionError(
                f"LearnerMasters got a {tuple(param.shape)} parameter of dtype {param.dtype}; "
                "expected bfloat16 or float16 (they get fp32 masters) or float32/float64 "
                "(stepped in place): leave it out of the optimizer, e.g. "
                "[p for p in model.parameters() if p.is_floating_point()]."
            )


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _inner_optimizer(
    optimizer_class: type[torch.optim.Optimizer],
    groups: list[dict[str, Any]],
    options: dict[str, Any],
) -> torch.optim.Optimizer:
    """The inner optimizer, built over empty fp32 placeholders: torch checks the options."""
    holders = []
    for group in groups:
        first = next(iter(_tensors_of(group["params"])), None)
        shape = (0,) * (1 if first is None else max(first.ndim, 1))
        device = torch.device("cpu") if first is None else first.device
        holders.append({**_options(group), "params": [torch.empty(shape, device=device)]})
    try:
        inner = optimizer_class(holders, **options)
    except (TypeError, ValueError, RuntimeError) as error:  # torch's checks of the options
        raise refused(optimizer_class, holders, options, error) from None
    if inner.state:
        raise InvalidOptionError(
            f"optimizer_class={optimizer_class.__name__} makes its state for every parameter "
            "when it is built, so it cannot hold state only for the parameters that learn; "
            "expected an optimizer that makes its state at the first step, e.g. "
            "torch.optim.AdamW."
        )
    inner.param_groups = []  # each step gives it the groups of the learners
    return inner


def _chunks(learners: list[tuple[int, torch.Tensor]]) -> list[list[tuple[int, torch.Tensor]]]:
    """Consecutive learners of at most as many elements together as the largest one (or the
    floor): each chunk's fp32 gradients and update temporaries go before the next is made."""
    if not learners:
        return []
    limit = max(_CHUNK_FLOOR, max(p.numel() for _, p in learners))
    chunks: list[list[tuple[int, torch.Tensor]]] = [[]]
    size = 0
    for pair in learners:
        if chunks[-1] and size + pair[1].numel() > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(pair)
        size += pair[1].numel()
    return chunks


def _device_steps(group: dict[str, Any]) -> bool:
    return bool(group.get("fused") or group.get("capturable"))


def _home(key: str, param: torch.Tensor, group: dict[str, Any]) -> torch.device:
    """Where a state entry lives while its parameter learns (torch's rule: ``step`` stays on
    the CPU unless the optimizer is fused or capturable)."""
    if key == "step" and not _device_steps(group):
        return torch.device("cpu")
    return param.device
