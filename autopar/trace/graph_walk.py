"""Walks over a traced graph: what a node is computed from, or what is computed from it, going
only through the nodes of a region (a set of nodes, or a test on each node). One definition for
the MoE collapse (sharding/expert_blocks.py, expert_lists.py) and the search's layer pairs
(search/candidates.py).

Example:
    >>> ancestors([out], inside)                       # out and what it is computed from, inside
    >>> descendants([x], lambda n: n.op == "call_function")   # every op x feeds
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.fx as fx


def _test(within) -> Callable[[fx.Node], bool]:
    return within.__contains__ if isinstance(within, (set, frozenset, dict)) else within


def ancestors(starts: Iterable[fx.Node], within) -> set:
    """``starts`` and the nodes they are computed from, through nodes ``within``."""
    keep, seen = _test(within), set(starts)
    todo = list(seen)
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen and keep(a):
                seen.add(a)
                todo.append(a)
    return seen


def descendants(starts: Iterable[fx.Node], within) -> set:
    """The nodes computed from any of ``starts`` through nodes ``within`` (a start only where
    another start reaches it)."""
    keep, seen = _test(within), set()
    todo = list(starts)
    while todo:
        for u in todo.pop().users:
            if u not in seen and keep(u):
                seen.add(u)
                todo.append(u)
    return seen
