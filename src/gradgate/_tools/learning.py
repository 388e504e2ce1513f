"""What learns under the current plan: ``gg.learning(model)``, the one query for it.

gradgate cuts the graph with grad mode, not with ``requires_grad``, so every tool that reads
``requires_grad`` (a model summary, a count of trainable parameters) sees a gated model as
wholly trainable. This query reads the plan of every gate on the model (depth, learning set,
skips; see :func:`gradgate._cut.plans.plan_learners`) and ``requires_grad`` (freezing): the
parameters it names are those that a backward of the next forward gives a ``.grad``, when the
loss reaches them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .._cut.gate import gate_points, gated_model, gates_on, learner_ids
from .._plumbing.errors import InvalidOptionError
from .._select.names import check_module


@dataclass(frozen=True)
class _Parameter:
    name: str
    owner: str  # the module that holds it (its first owner, for a tied parameter)
    size: int
    learns: bool


class Learning(Mapping[str, int]):
    """The parameters that learn under the current plan, by module: ``{module name: number of
    learning parameters}`` for the modules that hold some (a tied parameter is counted once,
    with its first owner). Printed, it is a table that ends with the count of the whole model.

    ``count`` is the number of learning parameters, ``total`` the number of all of them,
    ``share`` their ratio; ``names`` the learning parameters' names; ``blocks`` the number of
    learning parameters in each block of the gates that has some (a block that does not
    learn is absent); ``learns(param)`` and ``within(module name)`` answer for one.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    >>> gate = gg.BackpropGate(net, depth=1)
    >>> print(gg.learning(net))
    module  learning  of
    2             20  20
    learning 20 of 60 parameters (33.33%) under <gradgate.BackpropGate depth=1 of 3 blocks>
    >>> gate.remove()
    """

    def __init__(
        self, model: nn.Module, parameters: list[_Parameter], ids: set[int], plans: list[str]
    ) -> None:
        self._model = model
        self._parameters = parameters
        self._by_name = {p.name: p for p in parameters}
        self._ids = ids
        rows: dict[str, int] = {}
        for p in parameters:
            if p.learns:
                rows[p.owner] = rows.get(p.owner, 0) + p.size
        self._rows = rows
        self.blocks: dict[str, int] = {}
        self.plans = plans  # how each gate's plan reads, for the table's last line
        self.count: int = sum(rows.values())
        self.total: int = sum(p.size for p in parameters)

    @property
    def share(self) -> float:
        """The learning parameters' share of all parameters (0.0 for a model with none)."""
        return self.count / self.total if self.total else 0.0

    @property
    def names(self) -> list[str]:
        """The names of the learning parameters, in the model's order."""
        return [p.name for p in self._parameters if p.learns]

    def learns(self, param: torch.Tensor | str) -> bool:
        """Whether ``param`` (a parameter of the model, or its name) learns."""
        if isinstance(param, str):
            if param not in self._by_name:
                raise InvalidOptionError(
                    f"learns({param!r}): no parameter of that name; expected one of "
                    f"learning.names or a name from model.named_parameters()."
                )
            return self._by_name[param].learns
        return id(param) in self._ids

    def within(self, module: str) -> int:
        """The number of learning parameters inside the module named ``module`` ("" for the
        whole model), each counted once; a tied parameter counts in every module that holds
        it (a tied head learns with its embedding's weight)."""
        found = self._model.get_submodule(module)  # raises naming the bad name
        return sum(p.numel() for p in found.parameters() if id(p) in self._ids)

    # -- the mapping ---------------------------------------------------------------------------
    def __getitem__(self, module: str) -> int:
        return self._rows[module]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    # -- shown ---------------------------------------------------------------------------------
    def table(self) -> str:
        """One row per module that holds learning parameters (its count, and of how many it
        holds), then the count of the whole model and the plan it follows."""
        held: dict[str, int] = {}
        for p in self._parameters:
            held[p.owner] = held.get(p.owner, 0) + p.size
        rows = [
            (name or "(model)", f"{count:,}", f"{held[name]:,}") for name, count in self.items()
        ]
        header = ("module", "learning", "of")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        lines = [
            f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}".rstrip()
            for a, b, c in [header, *rows]
        ]
        under = " and ".join(self.plans) if self.plans else "no gate: requires_grad only"
        share = f"{100 * self.share:.2f}%"
        lines.append(
            f"learning {self.count:,} of {self.total:,} parameters ({share}) under {under}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return self.table()


def learning(model: nn.Module) -> Learning:
    """What learns in ``model`` under the current plan: ``{module name: number of parameters}``.

    The parameters that the plans of the gates on ``model`` (or on modules inside it) let learn
    (depth, learning set, skips) and that require grad (freezing); without a gate, those that
    require grad. Where a gate's embeddings, norms and heads run is what its forwards showed
    (before its first forward: the model's structure, see ``Stacks.runs_after``). A parameter
    the loss does not reach gets no ``.grad`` even so. Printed, it is a table
    (PEFT's ``print_trainable_parameters``, for any model).

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> dict(gg.learning(net))
    {'0': 6, '1': 3}
    >>> _ = net[1].bias.requires_grad_(False)
    >>> gg.learning(net).count, gg.learning(net).names
    (8, ['0.weight', '0.bias', '1.weight'])
    """
    check_module(model)
    module_names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    allowed = learner_ids(model)  # every gate's plan, nested gates included
    blocks: list[str] = []
    plans: list[str] = []
    for gate in gates_on(model):
        plans.append(repr(gate))
        prefix = module_names.get(id(gated_model(gate)), "")
        blocks += [_joined(prefix, name) for name, _ in gate_points(gate)]
    named = list(model.named_parameters())
    ids = {id(p) for _, p in named if p.requires_grad and (allowed is None or id(p) in allowed)}
    found = [
        _Parameter(name, name.rpartition(".")[0], param.numel(), id(param) in ids)
        for name, param in named
    ]
    result = Learning(model, found, ids, plans)
    result.blocks.update(
        (name, count) for name in dict.fromkeys(blocks) if (count := result.within(name))
    )
    return result


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name
