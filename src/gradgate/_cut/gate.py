"""The gates: ``BackpropGate`` (a plan per step: depth, learn, skip), ``backprop_depth`` and
``stop_gradient_at``. The mechanism is in ``cut``."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

from torch import Tensor, nn

from .._plumbing.errors import AlreadyGatedError, InvalidDepthError
from .._plumbing.hooks import guard_owners
from .._plumbing.tagging import runs_itself
from .._select.names import (
    Pattern,
    check_module,
    check_patterns,
    find_module,
    resolve_blocks,
    resolve_modules,
)
from .block_calls import require_a_forward
from .cut import PrefixMode, _Cut
from .plans import learners_under_every_gate


class BackpropGate(_Cut):
    """Per-minibatch plan: which blocks learn (``depth`` or ``learn``) and which skip backward.

    ``depth=k``: only the last ``k`` blocks and what runs after them learn; ``None`` cuts
    nowhere; ``0`` lets only what runs after the last block learn. ``learn={1, 4}`` lets any
    set of blocks (or modules, by name) learn; ``skip={2}`` runs residual blocks with no graph
    and passes the gradient around them (DropBP). Setting a field is O(1); ``gate.remove()``
    (or leaving a ``with`` block) removes every hook.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])
    >>> gate = gg.BackpropGate(net)
    >>> gate.depth = 1
    >>> net(torch.randn(2, 3)).sum().backward()
    >>> [name for name, p in net.named_parameters() if p.grad is not None]
    ['3.weight', '3.bias']
    >>> gate.remove()
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[Pattern] | str | None = None,
        *,
        depth: int | None = None,
        prefix_mode: PrefixMode = "keep",
        check_ranks: bool = False,
    ) -> None:
        check_module(model)
        require_a_forward(model)  # before looking for blocks: a ModuleList is the usual slip
        if depth is None:
            _refuse_depth_as_blocks(blocks)
        points = resolve_blocks(model, blocks)
        _refuse_a_second_gate(model, points, depth)
        depth = _validate_depth(depth, len(points), type(model).__name__)
        if not isinstance(check_ranks, bool):
            raise InvalidDepthError(f"check_ranks={check_ranks!r}; expected True or False.")
        if check_ranks:
            from .ranks import check_same_plan  # noqa: F401  (fails early if missing)
        super().__init__(model, points, prefix_mode=prefix_mode, check_ranks=check_ranks)
        self._depth: int | None = None
        self.depth = depth

    @property
    def blocks(self) -> list[str]:
        """The block names this gate plans over, in order."""
        return [name for name, _ in self._points]

    @property
    def depth(self) -> int | None:
        """How many of the last blocks learn; ``None`` for no cut (or when ``learn`` is set)."""
        return self._depth

    @depth.setter
    def depth(self, value: int | None) -> None:
        n = len(self._points)
        value = _validate_depth(value, n, type(self._model).__name__)
        self._set_plan(None if value is None else range(n - value, n))  # O(1)
        self._depth = value

    @property
    def learn(self) -> frozenset[int | str] | None:
        """The learning set: block positions and module names; ``None`` when not set."""
        if self._learn is None or self._depth is not None:
            return None
        names = {n: m for n, m in self._model.named_modules()}
        extra = [n for n, m in names.items() if any(m is e for e in self._extra)]
        return frozenset([*self._learn, *extra])

    @learn.setter
    def learn(self, value: Iterable[int | str] | None) -> None:
        if value is None:
            self._set_plan(None)
            self._depth = None
            return
        positions, extra = self._resolve_learn(value)
        self._set_plan(frozenset(positions), tuple(extra))
        self._depth = None

    @property
    def skip(self) -> frozenset[int]:
        """Block positions that run with no graph; the gradient passes around them (DropBP)."""
        return self._skip

    @skip.setter
    def skip(self, value: Iterable[int] | int | None) -> None:
        self._require_active()
        if hasattr(value, "__index__") and not (isinstance(value, Tensor) and value.dim()):
            _refuse_one_position(value)
        try:
            items = [] if value is None else list(value)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidDepthError(f"skip={value!r}; expected a set of block positions.") from None
        skip = frozenset(self._positions(items, option="skip"))
        if skip != self._skip:
            self._plan_changing()
        self._skip = skip
        self._new_tables()
        self._hooks_for_plan()
        self._fsdp.plan_changed()  # FSDP2: no backward all-gather where backward never runs

    def _resolve_learn(self, value: Iterable[int | str]) -> tuple[set[int], list[nn.Module]]:
        if isinstance(value, (str, int)):
            value = [value]
        try:
            items = list(value)
        except TypeError:
            raise InvalidDepthError(
                f"learn={value!r} is not a set; expected block positions and/or module names, "
                "e.g. learn={1, 4, 'transformer.wte'}, or None."
            ) from None
        numbers = [v for v in items if not isinstance(v, str)]
        positions = set(self._positions(numbers, option="learn"))
        extra: list[nn.Module] = []
        by_id = {id(m): i for i, (_, m) in enumerate(self._points)}
        for pattern in (v for v in items if isinstance(v, str)):
            found = [
                m
                for _, named in resolve_modules(self._model, [pattern])
                for m in ([named] if any(id(i) in by_id for i in named.modules()) else _run(named))
            ]
            for module in found:
                if id(module) in by_id:
                    positions.add(by_id[id(module)])
                elif module is self._model:
                    raise InvalidDepthError(
                        f"learn={pattern!r} names the whole model; expected blocks or modules "
                        "inside it (use depth=None for no cut)."
                    )
                elif any(id(inner) in by_id for inner in module.modules()):
                    self._refuse_container(pattern)
                elif all(module is not e for e in extra):
                    extra.append(module)
        return positions, extra

    def _refuse_container(self, pattern: str) -> None:
        """A module holding blocks (``"model.layers"``) is not a learner: its blocks are."""
        first = self._points[0][0]
        parent = first.rpartition(".")[0]
        example = f"{parent}.*" if parent else first
        raise InvalidDepthError(
            f"learn={pattern!r} names the container of the blocks ({first!r}, ...), which the "
            f"plan cannot open as one module; name the blocks themselves ({example!r}, "
            f"positions) or use depth (depth={len(self._points)} trains every block)."
        )

    def _positions(self, values: Iterable[object], *, option: str) -> list[int]:
        n = len(self._points)
        found = []
        for value in values:
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise InvalidDepthError(
                    f"{option} contains {value!r} ({type(value).__name__}); expected block "
                    f"positions 0..{n - 1}" + (" or module names." if option == "learn" else ".")
                )
            try:
                index = operator.index(value)  # type: ignore[arg-type]
            except TypeError:  # a float or multi-element tensor
                raise InvalidDepthError(
                    f"{option} contains {value!r}; expected integer block positions 0..{n - 1}."
                ) from None
            if not -n <= index < n:
                raise InvalidDepthError(
                    f"{option} contains block position {index}, out of range: "
                    f"{type(self._model).__name__} has {n} blocks; expected positions "
                    f"0..{n - 1}, or -{n}..-1 counting from the last."
                )
            found.append(index % n)
        return found

    def __repr__(self) -> str:
        if self._depth is not None or self._learn is None:
            plan = f"depth={self._depth}"
        else:
            plan = f"learn={sorted(self._learn)}"
        skip = f" skip={sorted(self._skip)}" if self._skip else ""
        state = "" if self.active else " (removed)"
        return f"<gradgate.BackpropGate {plan}{skip} of {len(self._points)} blocks{state}>"


def backprop_depth(
    model: nn.Module,
    depth: int | None,
    blocks: Sequence[Pattern] | str | None = None,
    *,
    prefix_mode: PrefixMode = "keep",
) -> BackpropGate:
    """Context manager: forwards inside it learn only in the last ``depth`` blocks and after.

    ``prefix_mode`` sets the train/eval mode of the modules that run before the cut
    (``"keep"``, the default, leaves them alone).

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])
    >>> with gg.backprop_depth(net, 2):
    ...     loss = net(torch.randn(2, 3)).sum()
    >>> loss.backward()
    >>> [i for i, layer in enumerate(net) if layer.weight.grad is not None]
    [2, 3]
    """
    gate = BackpropGate(model, blocks, depth=depth, prefix_mode=prefix_mode)
    gate._warns_unused = True  # a `with` block in which no forward ran says so at its exit
    return gate


class StopGradient(_Cut):
    """A cut at the input of one named module; see :func:`stop_gradient_at`."""

    def __init__(self, model: nn.Module, name: str, *, prefix_mode: PrefixMode = "keep") -> None:
        check_module(model)
        if isinstance(name, str | int) and not isinstance(name, bool) and name != "":
            (name,) = check_patterns("stop_gradient_at", (name,), model=model)
        if isinstance(name, bool) or not isinstance(name, str | int) or name == "":
            raise InvalidDepthError(
                f"stop_gradient_at needs a module name or a block position; got {name!r}. "
                "Expected the qualified name of a module inside the model, e.g. "
                "'encoder.layer.4', or a position in gg.blocks(model), e.g. -1."
            )
        point = find_module(model, name)
        if point[1] is model:
            raise InvalidDepthError(
                f"{name!r} is the model itself; a cut at its input stops nothing. Name a "
                "module inside it."
            )
        super().__init__(model, [point], prefix_mode=prefix_mode)
        self._set_plan(frozenset({0}))

    def __repr__(self) -> str:
        state = "" if self.active else " (removed)"
        return f"<gradgate.StopGradient at input of {self._points[0][0]!r}{state}>"


def stop_gradient_at(
    model: nn.Module, name: str, *, prefix_mode: PrefixMode = "keep"
) -> StopGradient:
    """Cut at the input of the named module: nothing that runs before it records a graph.

    Returns a removable handle that is also a context manager.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    >>> with gg.stop_gradient_at(net, "1"):
    ...     net(torch.randn(2, 3)).sum().backward()
    >>> net[0].weight.grad is None, net[1].weight.grad is not None
    (True, True)
    """
    gate = StopGradient(model, name, prefix_mode=prefix_mode)
    gate._warns_unused = True  # a `with` block in which no forward ran says so at its exit
    return gate


def _run(module: nn.Module) -> list[nn.Module]:
    """A module named in ``learn``, or for a container that is never called itself (a
    ``ModuleList`` inside a block), its members that are: their hooks open the cut.

    >>> _run(nn.ModuleList([nn.Linear(1, 1), nn.ModuleDict({"a": nn.ReLU()})]))
    [Linear(in_features=1, out_features=1, bias=True), ReLU()]
    """
    if runs_itself(module) or not module._modules:
        return [module]
    return [m for child in module.children() for m in _run(child)]


def _validate_depth(depth: object, n: int, model_name: str) -> int | None:
    if depth is None:
        return None
    if isinstance(depth, bool) or not hasattr(depth, "__index__"):
        raise InvalidDepthError(
            f"depth {depth!r} has type {type(depth).__name__}; expected an integer 0..{n} "
            "or None (no cut)."
        )
    try:
        value = operator.index(depth)  # type: ignore[arg-type]
    except TypeError:  # a float or multi-element tensor
        raise InvalidDepthError(
            f"depth {depth!r} is not one integer; expected an integer 0..{n} or None (no cut)."
        ) from None
    if not 0 <= value <= n:
        raise InvalidDepthError(
            f"depth {value} is out of range: {model_name} has {n} blocks; expected an integer "
            f"0..{n} (0: only what runs after the last block learns) or None (no cut)."
        )
    return value


def _refuse_a_second_gate(
    model: nn.Module, points: list[tuple[str, nn.Module]], depth: object
) -> None:
    """A live gate of ``model`` that plans over some of the same blocks (a notebook cell run
    again): two plans for one block compose into one nobody wrote. Gates of other blocks of the
    model, or of a module inside it, compose as documented and stay allowed."""
    mine = {id(module) for _, module in points}
    for gate in guard_owners(model):
        if (
            isinstance(gate, BackpropGate)
            and gate.active
            and any(id(module) in mine for _, module in gate._points)
        ):
            _already_gated(model, gate, depth)


def _already_gated(model: nn.Module, gate: BackpropGate, depth: object) -> None:
    first = gate._points[0][0]
    more = ", ..." if len(gate._points) > 1 else ""
    raise AlreadyGatedError(
        f"{type(model).__name__} already has a gate on the same blocks ({first!r}{more}): "
        f"{gate!r}. A second one would cut too (only the blocks both let learn would learn); "
        f"a re-run notebook cell makes one. Change the first gate's plan (gate.depth = "
        f"{depth!r}), or remove it first (gate.remove()), then gate again."
    )


def _refuse_depth_as_blocks(blocks: object) -> None:
    """``BackpropGate(model, 2)`` means depth 2 far more often than a gate over block 2 alone."""
    if isinstance(blocks, (bool, str)) or not hasattr(blocks, "__index__"):
        return
    if isinstance(blocks, Tensor) and blocks.dim():
        return
    raise InvalidDepthError(
        f"blocks={blocks!r} makes a gate over that one block with no cut; did you mean "
        f"depth={blocks!r}? The second positional argument is blocks: write "
        f"gg.BackpropGate(model, depth={blocks!r}), or blocks=[{blocks!r}] if a gate over that "
        "one block is what you expected."
    )


def _refuse_one_position(value: object) -> None:
    """``gate.skip = 3`` reads as "skip 3 blocks" as much as "skip block 3": a set says which."""
    try:
        index = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:  # a float tensor
        index = None
    if index is None:
        raise InvalidDepthError(f"skip={value!r}; expected a set of block positions.")
    raise InvalidDepthError(
        f"skip={value!r} is one integer; expected a set of block positions (the blocks that "
        f"run with no graph). To skip block {index}, write gate.skip = {{{index}}}; "
        "gate.skip = None skips none."
    )


# -- what the layers above may know of a gate (none of them reads its fields) ----------------
def gates_on(model: nn.Module) -> list[_Cut]:
    """The live gates on ``model`` and on the modules inside it, outermost first.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> gate = gg.BackpropGate(net, depth=1)
    >>> gates_on(net) == [gate]
    True
    >>> gate.remove(); gates_on(net)
    []
    """
    return [
        owner
        for module in model.modules()
        for owner in guard_owners(module)
        if isinstance(owner, _Cut) and owner.active
    ]


def gated_model(gate: _Cut) -> nn.Module:
    """The module ``gate`` was made on."""
    return gate._model


def gate_points(gate: _Cut) -> list[tuple[str, nn.Module]]:
    """The blocks ``gate`` plans over, ``(name, module)`` in order."""
    return list(gate._points)


def gate_parts(gate: object) -> tuple[nn.Module, list[tuple[str, nn.Module]]] | None:
    """The model and the blocks of a gradgate gate; ``None`` for anything else."""
    if not isinstance(gate, _Cut):
        return None
    return gate._model, list(gate._points)


def named_learner_ids(gate: _Cut) -> frozenset[int]:
    """The ids of the parameters of the modules the plan names in ``learn`` (not blocks)."""
    return gate._keep


def learner_ids(model: nn.Module) -> set[int] | None:
    """The ids of the parameters of ``model`` that the plans of the gates on it (or inside it)
    let learn, ``requires_grad`` aside (``None``: no plan restricts any); see
    :func:`gradgate._cut.plans.plan_learners`."""
    return learners_under_every_gate(model)


def forward_count(gate: object) -> int | None:
    """How many forwards of the gated model ran so far (``None`` for what is not a gate)."""
    return gate._forwards if isinstance(gate, _Cut) else None
