"""Which classic mistakes are present? Reads model, optimizer and graph; changes nothing.

Each finding has a stable ``code``:

===========================  ==================================================================
``frozen-in-optimizer``      a frozen parameter the optimizer still holds has a ``.grad`` tensor,
                             so momentum, weight decay or Adam state will move it
``requires-grad-attr``       ``module.requires_grad = False`` set as a plain attribute
``norm-in-frozen``           a norm layer with frozen parameters still updates running statistics
``not-in-optimizer``         a parameter requires grad but is in no optimizer group (wasted wgrad)
``param-in-two-groups``      the same parameter in two optimizer groups (or two optimizers)
``optimizer-not-for-model``  an optimizer holds none of the model's parameters (said once,
                             not once per parameter)
``eval-builds-graph``        the model is in ``eval()`` but ``loss`` still carries a graph
``late-freeze``              ``requires_grad`` was turned off after the forward that built ``loss``
===========================  ==================================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from .._plumbing.autograd import leaf_variable, walk
from .._plumbing.errors import InvalidOptionError


@dataclass(frozen=True)
class Finding:
    """One detected mistake: a stable ``code``, ``where`` it is, what is wrong, and the fix."""

    code: str
    where: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.where}: {self.message} Fix: {self.fix}"


def check(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    loss: torch.Tensor | None = None,
) -> list[Finding]:
    """Findings for the classic gradient mistakes in ``model`` (and ``optimizer``, ``loss``).

    Never prints and never changes anything. Pass the optimizer (or a list of them) for the
    optimizer checks, and the loss (or any output) of the latest forward for the graph checks.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> opt = torch.optim.SGD(net[1].parameters(), lr=0.1)
    >>> [finding.code for finding in gg.check(net, opt)]
    ['not-in-optimizer', 'not-in-optimizer']
    >>> gg.check(net, torch.optim.SGD(net.parameters(), lr=0.1))
    []
    """
    optimizers = _checked_arguments(model, optimizer, loss)
    names = _parameter_names(model)
    findings = [*_plain_requires_grad_attribute(model), *_norm_in_frozen_region(model)]
    if optimizers:
        findings += _optimizer_findings(model, optimizers, names)
    if loss is not None:
        findings += _graph_findings(model, loss, names)
    return findings


def _checked_arguments(
    model: object, optimizer: object, loss: object
) -> list[torch.optim.Optimizer]:
    """The optimizers to check; :class:`InvalidOptionError` for an argument of the wrong kind."""
    if not isinstance(model, nn.Module):
        raise InvalidOptionError(
            f"gg.check(model=...) got {type(model).__name__}; expected a torch.nn.Module."
        )
    if optimizer is None:
        optimizers: list[object] = []
    elif isinstance(optimizer, torch.optim.Optimizer):
        optimizers = [optimizer]
    elif isinstance(optimizer, (list, tuple)):
        optimizers = list(optimizer)
    else:
        optimizers = [optimizer]
    for item in optimizers:
        if not isinstance(item, torch.optim.Optimizer):
            raise InvalidOptionError(
                f"gg.check(optimizer=...) got {type(item).__name__} {item!r:.60}; expected a "
                "torch.optim.Optimizer, a list of them, or None."
            )
    if loss is not None and not isinstance(loss, torch.Tensor):
        raise InvalidOptionError(
            f"gg.check(loss={loss!r:.40}) got {type(loss).__name__}; expected the torch.Tensor "
            "output "
            "(or loss) of the latest forward, or None."
        )
    return optimizers  # type: ignore[return-value]


def _parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=True)}


def _plain_requires_grad_attribute(model: nn.Module) -> Iterable[Finding]:
    for name, module in model.named_modules():
        if "requires_grad" in vars(module):
            value = vars(module)["requires_grad"]
            where = name or type(module).__name__
            yield Finding(
                "requires-grad-attr",
                where,
                f"{where}.requires_grad = {value!r} is a plain attribute on the module: it does "
                "nothing, its parameters still require grad and still learn.",
                f"del the attribute and call {where}.requires_grad_({value!r}) (sets every "
                "parameter), or gg.freeze(model, ...).",
            )


def _norm_in_frozen_region(model: nn.Module) -> Iterable[Finding]:
    for name, module in model.named_modules():
        params = list(module.parameters())
        if (
            isinstance(module, _NormBase)
            and module.track_running_stats
            and module.training
            and params
            and not any(p.requires_grad for p in params)
        ):
            yield Finding(
                "norm-in-frozen",
                name,
                f"{type(module).__name__} {name!r} is frozen (no parameter requires grad) but "
                "in train mode, so every forward still updates its running mean and variance.",
                f"gg.freeze(model, {name!r}, norm='eval') keeps it in eval across "
                f"model.train(); or call model.get_submodule({name!r}).eval() after each "
                "model.train().",
            )


def _optimizer_findings(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], names: dict[int, str]
) -> list[Finding]:
    findings: list[Finding] = []
    held: dict[int, str] = {}
    foreign = 0
    for which, opt in enumerate(optimizers):
        label = f"optimizer {which}" if len(optimizers) > 1 else "optimizer"
        if _holds_none_of(opt, names):  # one line, not one per parameter of either
            findings.append(_not_for_model(model, opt, label, len(names)))
            foreign += 1
            continue
        for index, group in enumerate(opt.param_groups):
            for param in group["params"]:
                name = names.get(id(param), f"<parameter outside the model {tuple(param.shape)}>")
                place = f"{label} param_groups[{index}]"
                if id(param) in held:
                    findings.append(
                        Finding(
                            "param-in-two-groups",
                            name,
                            f"{name!r} is in {held[id(param)]} and again in {place}: it is "
                            "stepped twice per step, with two sets of hyperparameters.",
                            "keep each parameter in exactly one group of one optimizer.",
                        )
                    )
                    continue
                held[id(param)] = place
                if not param.requires_grad and param.grad is not None:
                    findings.append(_frozen_in_optimizer(opt, group, param, name, place))
    for name, param in model.named_parameters():
        if foreign == len(optimizers):
            break  # no optimizer of this model was given: that is the one finding
        if param.requires_grad and id(param) not in held:
            findings.append(
                Finding(
                    "not-in-optimizer",
                    name,
                    f"{name!r} requires grad but is in no optimizer group: backward computes "
                    "its gradient (wgrad) and nothing ever uses it.",
                    f"freeze it (gg.freeze(model, {name!r})) so no wgrad is computed, or add "
                    "it to the optimizer.",
                )
            )
    return findings


def _holds_none_of(opt: torch.optim.Optimizer, names: dict[int, str]) -> bool:
    """Whether ``opt`` holds parameters, none of them the model's."""
    params = [p for group in opt.param_groups for p in group["params"]]
    return bool(params) and bool(names) and not any(id(p) in names for p in params)


def _not_for_model(model: nn.Module, opt: torch.optim.Optimizer, label: str, count: int) -> Finding:
    held = len({id(p) for group in opt.param_groups for p in group["params"]})
    return Finding(
        "optimizer-not-for-model",
        label,
        f"{label} ({type(opt).__name__}) holds none of the {count} parameters of "
        f"{type(model).__name__}: its {held} parameters are other tensors (those of another "
        "model, of a copy made with copy.deepcopy or reloaded after the optimizer was built, "
        "or the flat copies of a DeepSpeed or FSDP optimizer), so its step never moves this "
        "model.",
        "build the optimizer from this model's parameters "
        "(torch.optim.AdamW(model.parameters())) after the model's last copy or reload, and "
        "pass that one.",
    )


def _frozen_in_optimizer(
    opt: torch.optim.Optimizer, group: dict[str, object], param: torch.Tensor, name: str, place: str
) -> Finding:
    movers = []
    momentum = group.get("momentum", 0)
    if isinstance(momentum, (int, float)) and momentum:
        movers.append(f"momentum={momentum}")
    decay = group.get("weight_decay", 0)
    if isinstance(decay, (int, float)) and decay:
        movers.append(f"weight_decay={decay}")
    if opt.state.get(param):
        movers.append(f"{type(opt).__name__} state ({', '.join(sorted(opt.state[param]))})")
    grad = param.grad
    kind = "a zero tensor" if grad is not None and not grad.any() else "a stale gradient tensor"
    reason = ", ".join(movers) if movers else "the stale gradient itself"
    return Finding(
        "frozen-in-optimizer",
        name,
        f"{name!r} does not require grad but is held by {place} and its .grad is {kind} "
        f"(not None), so optimizer.step() still moves it through {reason}.",
        f"freeze with gg.freeze(model, {name!r}): it drops an all-zero .grad at once and "
        "before each step, and a kept (accumulated) .grad right after the step that applied "
        "it, so no step moves the parameter; or zero grads with optimizer.zero_grad("
        "set_to_none=True) (the default); or leave the parameter out of the optimizer.",
    )


def _graph_findings(model: nn.Module, loss: torch.Tensor, names: dict[int, str]) -> list[Finding]:
    findings: list[Finding] = []
    if loss.grad_fn is not None and not any(m.training for m in model.modules()):
        findings.append(
            Finding(
                "eval-builds-graph",
                type(model).__name__,
                "the model is in eval() but its output still records an autograd graph: eval() "
                "only switches dropout and norm layers to inference behaviour, it does not stop "
                "gradient tracking, so activations are kept for a backward.",
                "run inference under torch.no_grad() or torch.inference_mode(); call model.eval() "
                "as well for dropout and norm layers.",
            )
        )
    for param in _leaves(loss):
        if not param.requires_grad:
            name = names.get(id(param), f"<tensor {tuple(param.shape)}>")
            findings.append(
                Finding(
                    "late-freeze",
                    name,
                    f"{name!r} was set to requires_grad=False after the forward that built this "
                    "loss: backward still computes its gradient (and everything upstream of it) "
                    "and then drops it.",
                    f"freeze before the forward (gg.freeze(model, {name!r})) and run the "
                    "forward again.",
                )
            )
    return findings


def _leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors (``AccumulateGrad`` variables) the loss's graph accumulates into."""
    found = (leaf_variable(node) for node in walk([loss.grad_fn]))
    return [variable for variable in found if variable is not None]
