"""tril / triu on split rows or columns: each rank keeps its own triangle, the diagonal moved by
where its piece starts (lowering ``triangular_local``).

Element (i, j) of the matrix is kept by tril(x, k) iff j - i <= k. A rank holding rows
[r0, r0 + m) keeps its local (i', j) iff j - i' <= k + r0; one holding columns [c0, c0 + m)
iff j' - i <= k - c0. Elementwise otherwise: a split of any other dim passes through.

Example:
    >>> triangular_strategies(op)   # tril(x (8, 8)) -> [R], [S(0) -> S(0)] and [S(1) -> S(1)] via triangular_local
"""

from __future__ import annotations

import operator

import torch

from autopar.errors import ShardingError
from autopar.sharding.lowerings.base import Lowering, register_lowering
from autopar.placement import Shard, local_positions
from autopar.sharding.rules.registry import OpInfo, Strategy

aten = torch.ops.aten


def triangular_zigzag(x: torch.Tensor, dim: int, diagonal: int, n: int, coord: int, upper: bool) -> torch.Tensor:
    """tril (or triu) of the rank's zig-zag piece of ``x``, split on ``dim`` (one of the last two):
    element (i, j) is kept iff j - i <= diagonal (triu: >=) at the rows' and columns' serial positions."""
    nd = x.dim()
    rows, cols = x.shape[-2], x.shape[-1]
    rp = local_positions(rows, n, coord, True, x.device) if dim == nd - 2 else torch.arange(rows, device=x.device)
    cp = local_positions(cols, n, coord, True, x.device) if dim == nd - 1 else torch.arange(cols, device=x.device)
    d = cp[None, :] - rp[:, None]
    keep = d >= diagonal if upper else d <= diagonal
    return torch.where(keep, x, torch.zeros_like(x))


class TriangularLocal(Lowering):
    """tril/triu with the diagonal shifted by this rank's first row (or minus its first column)."""

    name = "triangular_local"
    uneven = True  # the diagonal shifts by the rank's first row, uneven pieces included

    def emit(self, em, node, args, kwargs, axis: int):
        x_node = node.args[0]
        ndim = x_node.meta["val"].dim()
        lay = node.meta["autopar"]
        diagonal = args[1] if len(args) > 1 else kwargs.pop("diagonal", 0)
        mine = [a for a, s in enumerate(lay.strategies) if s is not None and s.lowering is self]
        zigzag = [a for a in mine if em.orders.zigzag_in(node, 0, a)]
        if zigzag:  # pieces in the zig-zag order (load-balanced context parallel): from the positions
            if len(mine) > 1:
                raise ShardingError(
                    f"{node.name}: tril/triu split on two mesh axes, one in the zig-zag order; "
                    "plan that axis with its pieces in the contiguous order (load_balance=False)."
                )
            a = zigzag[0]
            dim = lay.input_targets[0][a].dim
            upper = node.target.overloadpacket is aten.triu
            call = (args[0], dim, diagonal, em.mesh.shape[a], em.coord(a), upper)
            return em.graph.call_function(triangular_zigzag, call)
        for a, s in enumerate(lay.strategies):
            if s is None or s.lowering is not self:
                continue
            dim = lay.input_targets[0][a].dim
            start, _ = em.piece_bounds(em.global_shape(x_node)[dim], a, em.orders.zigzag_in(node, 0, a))
            shift = operator.add if dim == ndim - 2 else operator.sub
            diagonal = em.graph.call_function(shift, (diagonal, start))
        return em.graph.call_function(node.target, (args[0], diagonal), kwargs)


TRIANGULAR_LOCAL = register_lowering(TriangularLocal())


def triangular_strategies(op: OpInfo, strategies: list[Strategy]) -> list[Strategy]:
    """Elementwise strategies of tril/triu: a split of one of the last two dims gets the lowering."""
    n = op.outputs[0].ndim
    out = []
    for s in strategies:
        p = s.outputs[0]
        if isinstance(p, Shard) and p.dim >= n - 2:
            s = Strategy(s.inputs, s.outputs, TRIANGULAR_LOCAL, "diagonal shifted to the piece")
        out.append(s)
    return out
