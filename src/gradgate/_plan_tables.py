"""A cut's tables for one plan: where the cut opens, where it opens for now, which blocks the
hooks can pass over.

The block hooks read them at every block of every forward; they are computed once per plan, at
the first forward that needs them (setting a depth stays O(1)). ``learn`` is a range or a set of
learning positions (``None``: no cut), ``skip`` the skipped positions, ``stack_of`` each block's
stack.
"""

from __future__ import annotations

from collections.abc import Collection


def first_opener(learn: Collection[int] | None, skip: Collection[int], n: int) -> int:
    """Position of the first learning block that is not skipped (``n`` when there is none).

    >>> first_opener(range(3, 5), set(), 5), first_opener({1, 3}, {1}, 5)
    (3, 3)
    >>> first_opener(None, set(), 5)
    5
    """
    learn = learn or ()
    if isinstance(learn, range) and not skip:
        return learn.start
    return min((p for p in learn if p not in skip), default=n)


def opens_after(
    learn: Collection[int] | None, skip: Collection[int], stack_of: list[int], first: int
) -> list[bool]:
    """Per block: whether the cut opens, for now, right after it, when it does not learn: in the
    stack of the first learner ``first`` (of the last block when only what runs after the blocks
    learns); the next non-learner closes it again. So a learner called through ``checkpoint()``
    sees grad on, and LayerDrop cannot keep the cut shut.

    >>> opens_after(range(3, 4), set(), [0, 0, 1, 1], 3)
    [False, False, True, False]
    """
    learn = learn or ()
    stack = stack_of[min(first, len(stack_of) - 1)]
    return [not (p in learn and p not in skip) and of == stack for p, of in enumerate(stack_of)]


def plain_blocks(
    learn: Collection[int] | None,
    skip: Collection[int],
    named_inside: Collection[int],
    n: int,
    *,
    learning: bool = False,
) -> list[bool]:
    """Per block of ``n``: it does not learn (it learns, with ``learning``), is not skipped,
    and holds no named learning module. Run in order before the cut (after it, with
    ``learning``), its hooks only note it ran (and close the cut again if it opened for now).

    >>> plain_blocks(range(3, 5), {1}, set(), 5)
    [True, False, True, False, False]
    >>> plain_blocks(range(3, 5), {1}, set(), 5, learning=True)
    [False, False, False, True, True]
    """
    learn = learn or ()
    return [(p in learn) == learning and not (p in skip or p in named_inside) for p in range(n)]
