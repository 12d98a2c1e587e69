"""A grouped matmul on this rank's experts only (expert parallelism, grouped_mm_rule.py).

Rows of x are sorted by expert and ``offs`` holds the cumulative row counts of all E experts.
A rank holding experts lo..lo+El owns rows start..end (start = offs[lo-1], end = offs[lo+El-1]).
It rolls x up by ``start`` (a gather, no data-dependent shape), runs the op on its El
experts with offsets relative to ``start``, zeroes the rows past ``end`` (the native kernel
leaves them uninitialised; masking x too keeps its gradient there zero), and rolls back.
Every other rank's rows are zero: the output is this rank's partial sum of the serial output.

Example (E = 4 experts over 2 ranks, offs = [3, 5, 9, 12], rank 1 holds experts 2, 3):
    start = 5, local offs = [4, 7]: rows 5..11 of x meet experts 2 and 3; rows 0..4 are zero.
"""

from __future__ import annotations

import operator

import torch

from autopar.sharding.lowerings.base import Lowering, register_lowering

aten = torch.ops.aten


class LocalExperts(Lowering):
    name = "local_experts"

    def emit(self, em, node, args, kwargs, axis: int):
        x, w = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs["offs"]
        experts = em.global_shape(node.args[1])[0]
        lo, held = self._block(em, node, experts)
        g = em.graph
        offs_node = node.args[2] if len(node.args) > 2 else node.kwargs["offs"]
        zero = g.call_function(aten.zeros.default, ([1],), {"dtype": offs_node.meta["val"].dtype})
        padded = g.call_function(aten.cat.default, ([zero, offs],))
        start = g.call_function(aten.select.int, (padded, 0, lo))
        mine = g.call_function(aten.slice.Tensor, (offs, 0, lo, g.call_function(operator.add, (lo, held))))
        local_offs = g.call_function(aten.sub.Tensor, (mine, start))
        rows = g.call_function(aten.sym_size.int, (x, 0))
        pos = g.call_function(aten.arange.default, (rows,), {"dtype": torch.int64})
        valid = g.call_function(
            aten.unsqueeze.default,
            (g.call_function(aten.lt.Tensor, (pos, g.call_function(aten.select.int, (local_offs, 0, -1)))), -1),
        )
        up = g.call_function(aten.remainder.Scalar, (g.call_function(aten.add.Tensor, (pos, start)), rows))
        down = g.call_function(aten.remainder.Scalar, (g.call_function(aten.sub.Tensor, (pos, start)), rows))
        rolled = g.call_function(aten.index.Tensor, (x, [up]))
        rolled = g.call_function(aten.where.ScalarOther, (valid, rolled, 0.0))
        new_args = (rolled, w, local_offs) + tuple(args[3:])
        new_kwargs = {k: v for k, v in kwargs.items() if k != "offs"}
        if len(args) <= 2:
            new_kwargs["offs"] = new_args[2]
            new_args = new_args[:2] + new_args[3:]
        out = g.call_function(node.target, new_args, new_kwargs)
        out = g.call_function(aten.where.ScalarOther, (valid, out, 0.0))
        return g.call_function(aten.index.Tensor, (out, [down]))

    @staticmethod
    def _block(em, node, experts: int):
        """(first expert of this rank as a program value, experts per rank): axes splitting the
        experts nest in mesh order, the first axis outermost."""
        axes = [
            a for a, s in enumerate(node.meta["autopar"].strategies) if s is not None and s.lowering is LOCAL_EXPERTS
        ]
        n = 1
        for a in axes:
            n *= em.mesh.shape[a]
        held = em.local_size(experts, n)  # experts may be a program value (weights passed as inputs)
        lo, pieces = 0, 1
        for a in axes:
            pieces *= em.mesh.shape[a]
            stride = em.local_size(experts, pieces)
            lo = em.graph.call_function(operator.add, (lo, em.graph.call_function(operator.mul, (em.coord(a), stride))))
        return lo, held

    def reason(self, axis_name: str) -> str:
        return f"the experts are split on {axis_name}: each rank multiplies only the rows routed to its experts"


LOCAL_EXPERTS = register_lowering(LocalExperts())
