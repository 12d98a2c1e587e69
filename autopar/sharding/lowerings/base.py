"""Lowerings: what one op becomes on a rank when running it as-is on the local pieces is not
enough (a vocabulary-split embedding must mask ids it does not hold, a loss over split rows
must divide by the global count, ...).

A rule's strategy names its lowering by object (``Strategy.lowering``). The lowering owns
everything about it: the nodes it emits, the collectives it runs (for Plan.collectives and
the cost model) and why they run (for explain), so nothing elsewhere matches it by name.
Where the strategies of several axes carry lowerings, the one with the highest ``priority``
is emitted (it handles the other axes too: the vocab-parallel loss also counts split rows).

Example:
    >>> class Negate(Lowering):
    ...     name = "negate"
    ...     def emit(self, em, node, args, kwargs, axis):
    ...         return em.graph.call_function(aten.neg.default, (args[0],))
    >>> NEGATE = register_lowering(Negate())
"""

from __future__ import annotations

from autopar.errors import ShardingError

LOWERINGS: dict[str, "Lowering"] = {}


class Lowering:
    name: str = ""
    priority: int = 0
    # Whether emit() handles pieces of different sizes (a dim that does not divide by its
    # axis: placement.piece_sizes). Propagation offers a strategy with such a lowering on an
    # uneven split only when it does; the others need the split to divide.
    uneven: bool = False
    # Whether emit() handles a dynamic dim (the batch) cut unevenly at run time on a ragged axis
    # (propagate.is_ragged: pieces of any size, no rank knowing the others'), its static split dims
    # dividing: it sizes everything from its own pieces. ``uneven`` implies it.
    ragged: bool = False
    # Whether emit() reads its piece of the split dim as one range (em.piece_bounds: a vocabulary's
    # rows). On a load-balanced context-parallel axis its inputs then come in the plain order, not
    # the zig-zag one (sharding/piece_order.py reorders them on the way in).
    contiguous: bool = False

    def emit(self, em, node, args: tuple, kwargs: dict, axis: int):
        """Add the rank's nodes for ``node`` to ``em.graph`` (args are already local)."""
        raise NotImplementedError

    def comms(self, plan, node, axis: int, symbols) -> list[tuple]:
        """(kind, mesh axis, phase, bytes per rank as a sympy formula) of what ``emit`` runs."""
        return []

    def kept(self, plan, node, axis: int) -> list[tuple] | None:
        """What the lowered op's backward keeps, in cost/activation_memory.py's terms: ("in", i)
        its i-th tensor input, ("out", j) its j-th output, ("own", 0, fraction, ref) a tensor of
        its own sized after ``ref``, ("gathered", i, mesh axis) input i gathered on that axis (a
        storage of its own). None: what the op itself keeps (probed on the meta device)."""
        return None

    def workspace(self, plan, node, axis: int, symbols):
        """Bytes the lowered op holds beyond what it keeps while it runs (its forward or its
        backward, whichever holds more), at the sizes ``symbols`` gives (numbers or formulas)."""
        return 0

    def steps(self, plan, node, axis: int, symbols) -> dict | None:
        """A lowering that runs in steps (ring attention): ``{"steps": n, "flops": ..., "bytes":
        ..., "messages": ...}``, one step's compute (forward + backward) and what it sends, as
        formulas of ``symbols``; Cost.time() sets one beside the other. None: not in steps."""
        return None

    def strategy_bytes(self, info, s, axis: int, cur, mesh, grads) -> float:
        """Bytes per rank the strategy ``s`` moves on ``axis`` inside ``emit`` (not on its input
        edges), forward and backward, for propagation to weigh it against the other strategies;
        ``cur``: the inputs' current placements, ``grads``: per input whether a gradient flows to it.
        0 for a lowering whose collectives are small (scales) or none."""
        return 0.0

    def reason(self, axis_name: str) -> str:
        """Why this lowering's collectives run, for plan.explain."""
        return f"{self.name} on {axis_name}"

    def refusal(self, node, axis: int) -> str | None:
        """Why emit() cannot run ``node`` as planned (a combination of the axes' strategies it does
        not handle), or None. Asked while planning (``check_lowerings``), so that a plan ap.plan
        returns always emits: a refusal after a plan was accepted is a defect."""
        return None

    def __repr__(self) -> str:
        return self.name


def register_lowering(lowering: Lowering) -> Lowering:
    """Add ``lowering`` to the registry (plan files name it); a second one of a name is an error."""
    if not lowering.name or lowering.name in LOWERINGS:
        raise ValueError(f"lowering {lowering.name!r} is unnamed or registered twice")
    LOWERINGS[lowering.name] = lowering
    return lowering


def lowering_for(strategies) -> tuple[Lowering, int] | None:
    """(lowering, its axis) that a node's per-axis strategies call for, or None."""
    found = [(s.lowering, axis) for axis, s in enumerate(strategies) if s is not None and s.lowering]
    return max(found, key=lambda la: la[0].priority, default=None)


def check_lowerings(graph) -> None:
    """Refuse, while planning, every lowered node whose lowering says it cannot run as planned.

    Example:
        >>> check_lowerings(plan.graph)   # in Plan.finish, beside check_ragged
    """
    for node in graph.nodes:
        lay = node.meta.get("autopar")
        found = lowering_for(lay.strategies) if lay is not None and lay.strategies else None
        why = found[0].refusal(node, found[1]) if found is not None else None
        if why:
            raise ShardingError(why)
