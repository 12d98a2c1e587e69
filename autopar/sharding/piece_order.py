"""Which split tensors hold their pieces in the zig-zag order, and which in the plain one.

A technique may ask for the zig-zag order of pieces on its mesh axis (``Technique.piece_order``:
load-balanced context parallel) and then cuts the user's sequences head-tail (placement.py's
orders, ``Shard.order``): rank r of the axis holds chunks r and 2n-1-r. A
parameter split on the same axis (a column-parallel Linear there, a vocabulary split) is cut
plainly: rank r holds piece r. So on such an axis a split tensor is in one of two orders, and
every collective that joins or cuts pieces must know which. This pass says it for every value
of the plan and every input of every op, before anything is emitted:

- a user input split on the axis is in the zig-zag order (``plan.local_inputs`` cuts it so);
- a parameter, buffer or constant is in the plain order (its stored piece);
- an op's output split on the axis is in the order of its inputs split on the axis (zig-zag
  where none is: a draw cut by positions);
- a cut made on the way into an op (slice, reduce-scatter, the new split of an all-to-all)
  takes the order the op needs: that of its other inputs split on the axis, zig-zag where they
  have none, plain for a lowering that reads its piece as one range (``Lowering.contiguous``);
- an input that arrives split in the other order than the op needs is reordered on that edge
  (gathered, reordered, cut again: ``PieceOrders.reorders``), so every op sees one order.

The layouts propagation chose stay order-free (the rules and the cost model compare plain
splits); ``out_spec`` / ``in_spec`` give the emitter each edge's two layouts with their orders
(``Shard(d, order="zigzag")``), and redistribute.plan_steps turns them into steps like any other.

Example (a column-parallel Linear on the context-parallel axis, as the fuzzer drew it): the
sequence is gathered before the Linear (zig-zag pieces rejoined), its output is split by the
weight's rows (plain pieces), so the output's final all-gather joins them plainly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch.fx as fx

from autopar.placement import ZIGZAG, Shard
from autopar.sharding.lowerings.base import lowering_for
from autopar.sharding.redistribute import plan_steps

CUTS = ("slice", "reduce_scatter", "all_to_all")  # steps that make a new split on their axis


@dataclass
class PieceOrders:
    """The zig-zag axes and, on them, the values in the plain order.

    ``plain_out[node]``: the axes on which ``node``'s output is split in the plain order (every
    other split on a zig-zag axis is zig-zag). ``plain_in[(node, i)]``: the same for input ``i``
    as the op reads it (after its redistribution). ``reorders``: (node, input index, axis) of
    each edge whose arriving order differs from what the op reads (an extra all-gather there).
    """

    axes: frozenset = frozenset()
    plain_out: dict = field(default_factory=dict)
    plain_in: dict = field(default_factory=dict)
    reorders: list = field(default_factory=list)

    def zigzag_out(self, node: fx.Node, axis: int) -> bool:
        """Whether ``node``'s output split on ``axis`` is in the zig-zag order."""
        return axis in self.axes and axis not in self.plain_out.get(node.name, ())

    def zigzag_in(self, node: fx.Node, i: int, axis: int) -> bool:
        """Whether ``node``'s input ``i`` split on ``axis``, as the op reads it, is zig-zag."""
        return axis in self.axes and axis not in self.plain_in.get((node.name, i), ())

    def reordered(self, node: fx.Node, i: int) -> frozenset:
        """The axes on which ``node``'s input ``i`` is reordered on its way in."""
        return frozenset(a for name, j, a in self.reorders if name == node.name and j == i)

    def out_spec(self, node: fx.Node, spec: tuple) -> tuple:
        """``node``'s output layout ``spec`` with the order of its pieces on every ordered axis
        (``Shard.order``): what the emitter redistributes from."""
        return _ordered(spec, [a for a in self.axes if self.zigzag_out(node, a)])

    def in_spec(self, node: fx.Node, i: int, target: tuple) -> tuple:
        """Input ``i``'s layout ``target`` as ``node`` reads it, with the order of its pieces:
        what the emitter redistributes to (a change of order is then a step: redistribute.py)."""
        return _ordered(target, [a for a in self.axes if self.zigzag_in(node, i, a)])

    def output_spec(self, spec: tuple, target: tuple) -> tuple:
        """A model output's layout ``target`` with orders, from its value's ordered ``spec``: a
        split kept as it is keeps its order; a split made on the way out is cut zig-zag."""
        out = list(_ordered(target, self.axes))
        for a in self.axes:
            if isinstance(spec[a], Shard) and replace(spec[a], order=None) == target[a]:
                out[a] = spec[a]
        return tuple(out)


def _plain_split(p: Shard) -> bool:
    """A split of the whole axis into its ranks' pieces (no list item, no part of an axis)."""
    return p.of is None and not p.grouped


def _ordered(spec: tuple, axes) -> tuple:
    """``spec`` with its splits on ``axes`` in the zig-zag order (the others as they are)."""
    if not axes:
        return tuple(spec)
    return tuple(
        replace(p, order=ZIGZAG) if a in axes and isinstance(p, Shard) and p.order is None and _plain_split(p) else p
        for a, p in enumerate(spec)
    )


def zigzag_axes(plan) -> frozenset:
    """The mesh axes (of more than one rank) whose sequence pieces are in the zig-zag order."""
    return frozenset(
        a
        for a, name in enumerate(plan.mesh.axis_names)
        if plan.mesh.shape[a] > 1 and any(t.piece_order(name) == ZIGZAG for t in plan.options.techniques)
    )


def piece_orders(plan) -> PieceOrders:
    """The orders of ``plan``'s split values (computed once per plan, kept in ``plan.built``)."""
    found = plan.built.get("piece_orders")
    if found is None:
        found = plan.built["piece_orders"] = _walk(plan, zigzag_axes(plan))
    return found


def _walk(plan, axes: frozenset) -> PieceOrders:
    orders = PieceOrders(axes)
    if not axes:
        return orders
    for node in plan.graph.nodes:
        lay = node.meta.get("autopar")
        if node.op == "placeholder" or node.op == "get_attr":
            stored = node.op == "get_attr" or plan.attr_name(node.name) is not None
            if stored and lay is not None and lay.outputs:
                orders.plain_out[node.name] = _split_on(lay.spec, axes)
            continue
        if lay is None or not lay.outputs or not lay.inputs:
            src = next((a for a in node.args if isinstance(a, fx.Node)), None)  # getitem and friends
            if src is not None and src.name in orders.plain_out:
                orders.plain_out[node.name] = orders.plain_out[src.name]
            continue
        _resolve(plan, node, lay, axes, orders)
    return orders


def _split_on(spec, axes) -> frozenset:
    return frozenset(a for a in axes if isinstance(spec[a], Shard))


def _resolve(plan, node, lay, axes, orders: PieceOrders) -> None:
    """Each input's order as ``node`` reads it, and its output's, on every zig-zag axis."""
    fixed, split = [], []  # per input: {axis: arrives plain?} where no cut makes its split; the axes it is split on
    for src, target in zip(lay.inputs, lay.input_targets):
        steps = plan_steps(src.meta["autopar"].spec, target) if "autopar" in src.meta else []
        cut = {s.axis for s in steps if s.kind in CUTS}
        plain = orders.plain_out.get(src.name, frozenset())
        split.append(_split_on(target, axes))
        fixed.append({a: a in plain for a in split[-1] - cut})
    chosen = lowering_for(lay.strategies)
    plain_out = set()
    for a in axes:
        arrived = [f[a] for f in fixed if a in f]
        if chosen is not None and chosen[1] == a and chosen[0].contiguous:
            want_plain = True  # the lowering reads its piece as one range (a vocabulary's rows)
        else:
            want_plain = bool(arrived) and all(arrived)  # the user's zig-zag wins over a stored piece
        orders.reorders += [(node.name, i, a) for i, f in enumerate(fixed) if a in f and f[a] != want_plain]
        readers = [i for i, s in enumerate(split) if a in s]
        if want_plain and readers:
            plain_out.add(a)
            for i in readers:
                orders.plain_in[(node.name, i)] = orders.plain_in.get((node.name, i), frozenset()) | {a}
    if plain_out:
        orders.plain_out[node.name] = frozenset(plain_out & _split_on(lay.spec, axes))
