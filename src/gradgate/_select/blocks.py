"""How ``gg.blocks`` finds a model's main block sequence: the candidate sequences, their rules
and scores, and the errors when there is none or more than one.

Nothing here changes a model.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from .._plumbing.errors import AmbiguousBlocksError, NoBlocksError

Members = list[tuple[str, nn.Module]]

_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)
_BLOCK_NAMES = ("Block", "Layer")  # GPT2Block, LlamaDecoderLayer, nn.TransformerEncoderLayer


def find_blocks(model: nn.Module) -> list[str]:
    """The best candidate sequence's names; the errors of :func:`gradgate.blocks`."""
    scored = sorted(
        ((_score(members), [n for n, _ in members]) for members in _candidates(model)),
        key=lambda item: item[0],
        reverse=True,
    )
    if not scored:
        raise NoBlocksError(_no_blocks_message(model))
    best_score, best = scored[0]
    rivals = [
        names
        for score, names in scored[1:]
        if score[0] == best_score[0] and 3 * score[1] >= best_score[1] and _disjoint(names, best)
    ]
    if rivals:
        order = {name: i for i, (name, _) in enumerate(model.named_modules())}
        stacks = sorted([best, *rivals], key=lambda names: order[names[0]])
        raise AmbiguousBlocksError(_ambiguous_message(model, stacks))
    return best


def is_norm(module: nn.Module) -> bool:
    """A normalization layer: torch's, or a class named like one (``LlamaRMSNorm``)."""
    return isinstance(module, _NORMS) or "Norm" in type(module).__name__


def looks_like_a_block(module: nn.Module) -> bool:
    """One block of a bigger model rather than a model made of blocks: no stack of composite
    blocks inside, and a block's class name or a norm or attention layer among its parts."""
    if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) or _holds_a_stack(module):
        return False
    if type(module).__name__.endswith(_BLOCK_NAMES):
        return True
    parts = [child for child in module.children() if _has_parameters(child)]
    return len(parts) >= 2 and any(is_norm(c) or _is_attention(c) for c in parts)


def _candidates(model: nn.Module) -> Iterable[Members]:
    """Repeated sequences: container members, or runs of same-class composite children."""
    for owner, module in model.named_modules():
        children = [
            (f"{owner}.{name}" if owner else name, child)
            for name, child in module.named_children()
            if _has_parameters(child)
        ]
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            members = children
            if children and not any(_is_composite(c) for _, c in children):
                members = _repeated_layers(children)
                if len(members) == 2 and _inside_a_block(model, owner):
                    continue  # an MLP's two layers (or a downsample) are parts of one block
            if len(members) >= 2:
                yield members
            continue
        run: Members = []
        for item in [*children, None]:
            if item is not None and run and type(item[1]) is type(run[-1][1]):
                run.append(item)
                continue
            if len(run) >= 2 and _is_run_member(run[0][1]):
                yield run
            run = [item] if item is not None else []


def _repeated_layers(layers: Members) -> Members:
    """In a flat container, the blocks are the layers of its most frequent compute class (the
    most parameters on a tie): not its norm layers, a stem or a classifier of another class."""
    by_class: dict[type, Members] = {}
    for name, layer in layers:
        if not is_norm(layer):
            by_class.setdefault(type(layer), []).append((name, layer))
    if not by_class:
        return []
    best = max(by_class.values(), key=lambda group: (len(group), _parameter_count(group)))
    return best if len(best) >= 2 else []


def _inside_a_block(model: nn.Module, owner: str) -> bool:
    if not owner:
        return False  # the model itself is the container: its layers are the blocks
    return looks_like_a_block(model.get_submodule(owner.rpartition(".")[0]))


def _is_run_member(module: nn.Module) -> bool:
    """A composite module with a forward that is not itself a stack holder (T5's encoder)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) or not _is_composite(module):
        return False
    if isinstance(module, nn.Sequential):
        return True  # a CNN stage
    return not any(
        isinstance(inner, (nn.ModuleList, nn.Sequential))
        and sum(1 for c in inner.children() if _has_parameters(c)) >= 2
        for inner in module.modules()
    )


def _holds_a_stack(module: nn.Module) -> bool:
    return any(
        isinstance(inner, (nn.ModuleList, nn.Sequential))
        and sum(1 for c in inner.children() if _is_composite(c) and _has_parameters(c)) >= 2
        for inner in module.modules()
    )


def _is_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or "Attention" in type(module).__name__


def _is_composite(module: nn.Module) -> bool:
    return any(True for _ in module.children())


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _parameter_count(members: Members) -> int:
    return sum(p.numel() for _, m in members for p in m.parameters())


def _score(members: Members) -> tuple[int, int, int, int]:
    """Composite blocks first, then parameters covered, then count, then the outermost."""
    composite = int(all(_is_composite(m) for _, m in members))
    return composite, _parameter_count(members), len(members), -members[0][0].count(".")


def _disjoint(names: list[str], others: list[str]) -> bool:
    """Neither sequence lies inside (or overlaps) a member of the other."""

    def inside(name: str, group: list[str]) -> bool:
        return any(name == g or name.startswith(f"{g}.") or g.startswith(f"{name}.") for g in group)

    return not any(inside(n, others) for n in names)


def _pattern_for(names: list[str]) -> str:
    owner = names[0].rpartition(".")[0]
    if all(n.rpartition(".")[0] == owner for n in names) and owner:
        return f"{owner}.*" if len(names) > 1 else names[0]
    return ", ".join(repr(n) for n in names)


def _ambiguous_message(model: nn.Module, stacks: list[list[str]]) -> str:
    listed = "; ".join(f"{_pattern_for(s)} ({len(s)} blocks)" for s in stacks)
    paste = ", ".join(repr(_pattern_for(s)) for s in stacks)
    return (
        f"{type(model).__name__} has {len(stacks)} comparable block stacks: {listed}. gradgate "
        "does not guess which one depth counts over. Pass them in the order your model runs "
        f"them, e.g. blocks=[{paste}] (both stacks, depth counts from the end of the last; "
        "listed here as registered: a gate checks the order at its first forward), or just one "
        "of them."
    )


def _no_blocks_message(model: nn.Module) -> str:
    name = type(model).__name__
    if looks_like_a_block(model):
        parts = ", ".join(type(c).__name__ for c in model.children() if _has_parameters(c))
        return (
            f"found no repeated block sequence in {name}: {name} looks like a single block (it "
            f"holds {parts} and no stack of blocks), not a model made of blocks. Gated alone, "
            "its input already carries the graph of the blocks that ran before it: no cut "
            "inside it can stop their gradients, and its layers are not blocks to count depth "
            "over. Expected the whole model: gate the model that contains it (gg.blocks(model) "
            "lists its blocks) and choose this block there with depth=... or learn={...}. If "
            "it really is the whole model, name its blocks with the blocks= option, in the "
            "order they run."
        )
    module, prefix = model, ""
    while True:
        children = [(n, c) for n, c in module.named_children() if _has_parameters(c)]
        if len(children) != 1:
            break
        prefix = f"{prefix}{children[0][0]}."
        module = children[0][1]
    names = [f"{prefix}{n}" for n, c in children if not is_norm(c)][:3]
    example = f"blocks={names!r}" if names else "blocks=['<module name>', ...]"
    return (
        f"found no repeated block sequence in {name}: no nn.ModuleList, nn.Sequential or run "
        "of same-class children holds two or more blocks with parameters. Pass the blocks "
        f"explicitly, in the order they run, e.g. {example}; a layer your model calls several "
        "times (ALBERT's shared layer, a universal transformer) is one block."
    )
