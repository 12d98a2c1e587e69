"""Walks over a traced graph: what a node is computed from, or what is computed from it, going
only through the nodes of a region (a set of nodes, or a test on each node). One definition for
the MoE collapse (parallel/experts/) and the search's layer pairs
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
    starts = list(starts)
    return _reached(starts, within, lambda n: n.all_input_nodes, set(starts))


def descendants(starts: Iterable[fx.Node], within) -> set:
    """The nodes computed from any of ``starts`` through nodes ``within`` (a start only where
    another start reaches it)."""
    return _reached(list(starts), within, lambda n: n.users, set())


def _reached(todo: list, within, neighbours, seen: set) -> set:
    """``seen`` grown by every node reached from ``todo`` along ``neighbours`` through ``within``."""
    keep = _test(within)
    while todo:
        for a in neighbours(todo.pop()):
            if a not in seen and keep(a):
                seen.add(a)
                todo.append(a)
    return seen
