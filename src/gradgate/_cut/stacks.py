"""The stacks of blocks as they run: their order, and which modules run after each.

A gate's blocks come in stacks (the containers they live in: an encoder's layers, a decoder's
layers, two towers). Each forward records which stack ran first and which outside module (an
embedding, a final norm, a head) ran before or after each stack; the cut uses that to open after
a stack that LayerDrop skipped entirely, and to refuse stacks listed against their run order.
"""

from __future__ import annotations

import functools
import inspect
import re

from torch import nn

from .._plumbing.errors import BlockCallError
from .._select.names import ancestors
from .frames import Frame


class Stacks:
    """The stack of each block position, the outside modules, and what runs after each stack."""

    def __init__(self, model: nn.Module, points: list[tuple[str, nn.Module]]) -> None:
        self._model, self._points = model, points
        self.names = [name.rpartition(".")[0] for name, _ in points]
        ids = {stack: i for i, stack in enumerate(dict.fromkeys(self.names))}
        self.of = [ids[stack] for stack in self.names]
        # per block: the first of its stack (run in order, it is the one that starts the stack)
        self.starts = [p == 0 or self.of[p] != self.of[p - 1] for p in range(len(self.of))]
        self.outside = outside_modules(model, points)
        # members of a container with no forward (norms[i] after block i): taken for code
        # between the blocks until a forward shows one running after the last block that ran
        self.listed = set(listed_members(model, self.outside, points))
        self._owner = {id(m): ("block", i) for i, (_, b) in enumerate(points) for m in b.modules()}
        self._owner |= {
            id(m): ("outside", i) for i, o in enumerate(self.outside) for m in o.modules()
        }
        self._after: dict[int, set[int]] = {}  # stack -> outside modules seen only after it
        self._before: dict[int, set[int]] = {}
        self.after_some: set[int] = set()  # outside modules seen after some stack
        self.seen_all = False  # a forward ran every stack: what runs after each is known
        self._learned: tuple[list[int], list[tuple[int, int, int]]] | None = None  # the last run
        # per outside module: the last block that ran before it, in forwards that ran every
        # block (exact), and in forwards that skipped some (LayerDrop: a lower bound)
        self._ran_after: dict[int, int] = {}
        self._ran_after_some: dict[int, int] = {}
        self._placed: list[int] | None = None  # the same, guessed from the model's structure
        self.runs = 0  # runs learned that differ from the one before: what caches compare

    def start(self, frame: Frame, position: int, *, planned: bool) -> None:
        """The first block of a stack runs in this forward: stacks run in their listed order."""
        stack = self.of[position]
        if planned and frame.stacks_ran and stack < max(frame.stacks_ran):
            order = [*frame.stacks_ran, stack]
            order += [s for s in dict.fromkeys(self.of) if s not in order]
            raise BlockCallError(
                "the stacks of blocks run in another order than listed: "
                f"{self.names[self.of.index(frame.stacks_ran[-1])]!r} ran before "
                f"{self.names[position]!r}, which is listed first. depth counts blocks in the "
                "listed order, so the cut would fall in the wrong place. Pass them in the order "
                f"they run: blocks={self._patterns(order)}"
            )
        frame.stacks_ran.append(stack)

    def holding(self, modules: tuple[nn.Module, ...]) -> tuple[frozenset[int], frozenset[int]]:
        """Block positions holding one of ``modules``; outside modules that are (inside) one."""
        blocks = {
            self._owner[id(m)][1] for m in modules if self._owner.get(id(m), ("",))[0] == "block"
        }
        inside = {id(n) for m in modules for n in m.modules()}
        outside = {i for i, o in enumerate(self.outside) if id(o) in inside}
        return frozenset(blocks), frozenset(outside)

    def between_blocks(self, index: int) -> bool:
        """Whether outside module ``index``, running after a block before the first learner,
        is taken for code between the blocks (frozen) before any forward showed where it runs:
        it is listed (see listed_members)."""
        return index in self.listed

    def ran_last(self, indices: list[int]) -> None:
        """Outside modules ran after the last block that ran in a forward: not listed ones."""
        self.listed.difference_update(indices)

    def runs_after_last(self, frame: Frame, index: int) -> bool:
        """Whether outside module ``index`` runs after the last stack (a final norm, a head)."""
        last = self.of[-1]
        return last in frame.stacks_ran or self.seen_after(last, index)

    def seen_after(self, stack: int, index: int) -> bool:
        """Whether outside module ``index`` ran after ``stack`` (and never before it) so far."""
        return index in self._after.get(stack, ()) and index not in self._before.get(stack, ())

    def first_block_after(self, index: int) -> int:
        """The first block outside module ``index`` may run before: the first of the first stack
        it was not seen running after (the number of blocks when it runs after all of them)."""
        for position, stack in enumerate(self.of):
            if not self.seen_after(stack, index):
                return position
        return len(self.of)

    def learn(self, frame: Frame) -> None:
        """Take note of what ran before and after each stack in a forward that completed."""
        if not frame.stacks_ran or (frame.stacks_ran, frame.outside_calls) == self._learned:
            return  # no stack ran, or the same run as the last: nothing new
        self._learned = (frame.stacks_ran, frame.outside_calls)
        self.runs += 1
        self.seen_all = self.seen_all or len(frame.stacks_ran) == len(set(self.of))
        for order, stack in enumerate(frame.stacks_ran):
            after = self._after.setdefault(stack, set())
            before = self._before.setdefault(stack, set())
            for index, stacks_ran, _ in frame.outside_calls:
                (after if order < stacks_ran else before).add(index)
            self.after_some |= after
        ran_after = self._ran_after if len(frame.ran) == len(self.of) else self._ran_after_some
        for index, _, position in frame.outside_calls:
            ran_after[index] = max(position, ran_after.get(index, -1))

    def runs_after(self, index: int) -> int:
        """The last block position that runs before outside module ``index`` (its last call;
        -1: before every block): as seen in a forward that ran every block, else guessed from
        the model's structure (see :func:`placement`), raised to what forwards that skipped
        blocks showed."""
        if index in self._ran_after:
            return self._ran_after[index]
        if self._placed is None:
            self._placed = placement(self._model, self._points, self.outside)
        return max(self._placed[index], self._ran_after_some.get(index, -1))

    def unit_of(self, module: nn.Module) -> tuple[str, int]:
        """``("block", position)``, ``("outside", index)``, or ``("", -1)`` for the model and
        the containers around the blocks."""
        return self._owner.get(id(module), ("", -1))

    def last_stack_start(self) -> int:
        """The position of the first block of the last stack."""
        return self.of.index(self.of[-1])

    def _patterns(self, order: list[int]) -> list[str]:
        patterns: list[str] = []
        for stack in order:
            names = [n for (n, _), s in zip(self._points, self.of, strict=True) if s == stack]
            container = self.names[self.of.index(stack)]
            children = self._model.get_submodule(container).named_children()
            whole = names == [f"{container}.{child}" for child, _ in children]
            patterns += [f"{container}.*"] if container and whole else names
        return patterns


def placement(
    model: nn.Module, points: list[tuple[str, nn.Module]], outside: list[nn.Module]
) -> list[int]:
    """Per outside module, the block after which it is taken to run before a forward shows it:
    registration order where it shares a parent with the blocks' stacks. An embedding
    registered before the container of its stack runs before the stack's first block (-1 for
    the first stack: before every block); a final norm or a head registered after the
    containers runs after the last block of the latest-listed stack before it.

    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed, self.layers = nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)] * 2)
    ...         self.head = nn.Linear(2, 2)
    >>> net = Net()
    >>> placement(net, [("layers.0", net.layers[0]), ("layers.1", net.layers[1])],
    ...           [net.embed, net.head])
    [-1, 1]
    """
    names = {id(m): name for name, m in model.named_modules()}
    containers = [name.rpartition(".")[0] for name, _ in points]
    found = []
    for module in outside:
        name = names.get(id(module), "")
        parent = name
        while parent:  # the deepest ancestor holding a stack
            parent = parent.rpartition(".")[0]
            under = [p for p, c in enumerate(containers) if _within(c, parent)]
            if under:
                break
        else:
            under = list(range(len(points)))
        found.append(_placed(model, parent, name, under, containers, points))
    return found


def _within(name: str, parent: str) -> bool:
    return not parent or name == parent or name.startswith(f"{parent}.")


def _branch(parent: str, name: str) -> str:
    """The child of ``parent`` on the way to ``name``."""
    rest = name[len(parent) + 1 :] if parent else name
    return rest.split(".")[0]


def _placed(
    model: nn.Module,
    parent: str,
    name: str,
    under: list[int],
    containers: list[str],
    points: list[tuple[str, nn.Module]],
) -> int:
    order = _call_order(model.get_submodule(parent))
    mine = order.get(_branch(parent, name), -1)
    before = [
        p
        for p in under
        if order.get(
            _branch(parent, points[p][0] if containers[p] == parent else containers[p]), -1
        )
        < mine
    ]
    return max(before) if before else min(under) - 1


def runs_before(model: nn.Module, first: str, second: str) -> bool:
    """Whether module ``first`` is taken to run before ``second`` (both named in ``model``):
    where the forward of their closest common ancestor calls them (see ``_call_order``). An
    ancestor of the other runs around it: neither before.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    >>> runs_before(net, "0", "1.1"), runs_before(net, "1.1", "0"), runs_before(net, "1", "1.0")
    (True, False, False)
    """
    a, b = first.split("."), second.split(".")
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    if common == len(a) or common == len(b):
        return False
    order = _call_order(model.get_submodule(".".join(a[:common])))
    return order.get(a[common], -1) < order.get(b[common], -1)


def _call_order(parent: nn.Module) -> dict[str, int]:
    """The order in which ``parent``'s forward names its children (``self.<child>``), the
    children it does not name after them in registration order: a module registered after the
    blocks and used before them (BART's ``layernorm_embedding``) is placed where it runs."""
    children = [name for name, _ in parent.named_children()]
    source = _forward_source(type(parent))  # type: ignore[arg-type]
    found = {}
    for child in children:
        match = re.search(rf"self\.{re.escape(child)}\b", source)
        found[child] = match.start() if match else -1
    late = len(source) + 1
    ranked = sorted(children, key=lambda c: (late if found[c] < 0 else found[c], children.index(c)))
    return {child: i for i, child in enumerate(ranked)}


@functools.lru_cache(maxsize=256)
def _forward_source(kind: type) -> str:
    """The source of ``kind.forward`` with the methods it calls on ``self`` written out where
    they are called (CLIP's ``get_image_features`` runs the vision tower and its projection)."""
    return _expanded(kind, "forward", set())


def _expanded(kind: type, method: str, seen: set[str]) -> str:
    seen.add(method)
    try:
        source = inspect.getsource(getattr(kind, method))
    except (OSError, TypeError, AttributeError):  # no source (compiled, built in)
        return ""
    parts = re.split(r"(self\.\w+\()", source)
    for i in range(1, len(parts), 2):
        called = parts[i][len("self.") : -1]
        own = callable(getattr(kind, called, None)) and not hasattr(nn.Module, called)
        if own and called not in seen and len(seen) < 16:
            parts[i] += _expanded(kind, called, seen)
    return "".join(parts)


def listed_members(
    model: nn.Module, outside: list[nn.Module], points: list[tuple[str, nn.Module]]
) -> list[int]:
    """Positions in ``outside`` of the members of containers with no forward of their own
    (``nn.ModuleList``, ``nn.ModuleDict``: a list of norms or gates applied after each block),
    and of an ``nn.Sequential``'s members that run before its last block (a flat CNN's norms)."""
    parents = {id(child): module for module in model.modules() for child in module.children()}
    block_ids = {id(block) for _, block in points}
    last_block = {
        id(parent): max(i for i, child in enumerate(parent.children()) if id(child) in block_ids)
        for parent in model.modules()
        if isinstance(parent, nn.Sequential) and any(id(c) in block_ids for c in parent.children())
    }

    def between(module: nn.Module, parent: nn.Module) -> bool:
        if id(parent) in last_block:
            return list(parent.children()).index(module) < last_block[id(parent)]
        return type(parent).forward is nn.Module.forward and "forward" not in vars(parent)

    return [
        index
        for index, module in enumerate(outside)
        if (parent := parents.get(id(module))) is not None and between(module, parent)
    ]


def outside_modules(model: nn.Module, points: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The largest modules that are neither blocks, inside blocks, nor holders of blocks.

    These are the embeddings, final norms and heads around the stacks.
    """
    inside = {id(m) for _, block in points for m in block.modules()}
    holders = {id(model.get_submodule(a)) for name, _ in points for a in ancestors(name)}
    found: list[nn.Module] = []
    seen = {id(model)}

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in seen or id(child) in inside:
                continue
            seen.add(id(child))
            if id(child) in holders or type(child).forward is nn.Module.forward:
                walk(child)  # a container of blocks, or a ModuleList / ModuleDict (no forward)
            else:
                found.append(child)

    walk(model)
    return found
