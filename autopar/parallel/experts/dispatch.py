"""A MoE experts module on one rank (``autopar::moe_experts``, moe_rule.py).

Each axis of the mesh does one of: nothing (tokens and experts replicated), split the tokens
(every expert here), split the experts (tokens replicated: out Partial), or both (expert
parallelism with dispatch). The rank program:

1. route locally: the (token, choice) pairs sorted by expert, their rows, the rows per expert;
2. on the dispatch axis (n ranks, E/n experts each): the per-expert counts exchanged (an
   all-to-all of E integers), then the rows sent to the ranks holding their experts (an
   all-to-all with variable sizes: dropless, a rank may get no row for an expert), and the
   received rows grouped by local expert; on expert-split axes: the rows of this rank's
   experts kept (the others' outputs stay zero);
3. the expert chain (the module's grouped matmuls and what runs between them, copied from
   the trace) on those rows with this rank's expert weights;
4. the outputs sent back (the reverse all-to-all), put back in token order, times the
   routing weights and summed over the choices, as the module does.
The backward is the reverse: each all-to-all's gradient is the all-to-all the other way.

Example (4 ranks, 8 experts, tokens and experts on "dp"):
    rank 0 routes its 16 tokens x 2 choices; sends rows of experts 2-3 to rank 1, ...; runs experts
    0-1 on the rows every rank sent it; sends each rank its rows' outputs back.
"""

from __future__ import annotations

import operator

import torch

from autopar.placement import Shard
from autopar.parallel.experts import moe_dispatch as md
from autopar.parallel.experts.blocks import BLOCKS
from autopar.parallel.experts.lists import owned_items, tie_others
from autopar.sharding.lowerings.base import Lowering, register_lowering

aten = torch.ops.aten
ops = torch.ops.autopar
COUNT_BYTES = 8  # the per-expert counts are int64


def axis_modes(strategies, block) -> dict[int, str]:
    """{axis: 'tokens' | 'experts' | 'dispatch'} for the axes that split something."""
    out = {}
    for axis, s in enumerate(strategies):
        if s is None:
            continue
        tok = isinstance(s.inputs[0], Shard)
        # whole experts split (stacked: S(0); a ModuleList's: S(d, of=...)); a split of each expert (tp) runs as it is
        p = s.inputs[3] if len(s.inputs) > 3 else None
        listed = block.expert is not None
        par = isinstance(p, Shard) and ((p.of is not None) if listed else (p.dim == 0 and p.blocks == 1))
        if tok or par:
            out[axis] = "dispatch" if tok and par else "tokens" if tok else "experts"
    return out


def dispatch_part(strategies, axis: int, mesh):
    """The part of ``axis`` a dispatch runs on (a SubAxis: the experts split on one of two merged
    data-parallel axes, Shard.within for the inner, Shard.across for the outer), or None: the
    whole axis."""
    p = strategies[axis].inputs[3]
    return mesh.part(axis, p.grouped, p.part) if p.grouped else None


class ExpertDispatch(Lowering):
    name = "expert_dispatch"
    priority = 10
    # a batch cut unevenly at run time: the rank routes its own tokens and the dispatch exchanges
    # the counts first (the experts must divide: E/n each)
    ragged = True

    def refusal(self, node, axis: int) -> str | None:
        block = BLOCKS[node.args[4]]
        modes = axis_modes(node.meta["autopar"].strategies, block)
        dispatch = [a for a, m in modes.items() if m == "dispatch"]
        if len(dispatch) > 1 or (dispatch and "experts" in modes.values()):
            return (
                f"moe_experts at {node.name!r} ({block.path}): experts split on more than one axis with a "
                "dispatch on one of them is not supported yet; split the experts over one axis."
            )
        return None

    def emit(self, em, node, args, kwargs, axis: int):
        hidden, index, weights, params, key = args
        block = BLOCKS[key]
        modes = axis_modes(node.meta["autopar"].strategies, block)
        dispatch = [a for a, m in modes.items() if m == "dispatch"]
        split = [a for a, m in modes.items() if m == "experts"]
        g = em.graph
        routed = g.call_function(md.route, (hidden, index, block.experts))
        rows, order, counts, ids = (g.call_function(operator.getitem, (routed, i)) for i in range(4))
        if dispatch:
            part = dispatch_part(node.meta["autopar"].strategies, dispatch[0], em.mesh)
            out_rows = self._dispatched(em, block, rows, counts, list(params), dispatch[0], part)
        elif split:
            out_rows = self._own_experts(em, block, rows, counts, list(params), split)
        else:
            offsets = g.call_function(aten.cumsum.default, (counts, 0), {"dtype": torch.int32})
            out_rows = self._chain(em, block, rows, offsets, ids, list(params))
        dtype = node.meta["val"].dtype
        return g.call_function(md.unroute, (out_rows, order, weights, dtype))

    @staticmethod
    def _chain(em, block, rows, offsets, ids, params):
        """The expert chain's nodes, copied into the rank's program."""
        chain = block.local_chain(len(params))
        ph = [n for n in chain.graph.nodes if n.op == "placeholder"]
        return em.graph.graph_copy(chain.graph, dict(zip(ph, [rows, offsets, ids, *params])))

    @staticmethod
    def _held_params(em, block, params, first, held):
        """(a ModuleList's parameters of experts ``first .. first + held - 1``, the arguments of
        ``tie_others`` for the rest): ``first`` is a value of the program; the rank gets every
        expert's tensors (the others' empty) and runs its own."""
        m = block.per_expert
        start = em.graph.call_function(operator.mul, (first, m))
        mine = em.graph.call_function(owned_items, (params, start, held * m))
        return [em.graph.call_function(operator.getitem, (mine, j)) for j in range(held * m)], (params, start, held * m)

    def _run_held(self, em, block, rows, offsets, ids, params, first, held):
        """The chain on experts ``first .. first + held - 1``; a ModuleList's other experts' (empty)
        tensors tied in with an exact 0 so that each gets its (empty) gradient."""
        if block.expert is None:
            return self._chain(em, block, rows, offsets, ids, params)
        mine, others = self._held_params(em, block, params, first, held)
        y = self._chain(em, block, rows, offsets, ids, mine)
        return em.graph.call_function(tie_others, (y, *others))  # stacked weights: already E/n here

    def _dispatched(self, em, block, rows, counts, params, axis, part=None):
        """Counts exchanged, rows to their experts' ranks, the chain on this rank's E/n experts
        (rows grouped by expert, each row's local expert id for expert biases), rows back.
        ``part`` (a SubAxis): all of it inside this rank's group on that part of the axis (experts
        over one of two merged data-parallel axes: each such group holds every expert)."""
        g, n = em.graph, em.mesh.axis_size(part if part is not None else axis)
        held = block.experts // n
        each = g.call_function(aten.full.default, ([n], held), {"dtype": torch.int64})
        received = em.collective(ops.all_to_all_v.default, (counts, each, each), axis, part=part)
        plan = g.call_function(md.dispatch_plan, (counts, received, n))
        send, recv, regroup, per_expert = (g.call_function(operator.getitem, (plan, i)) for i in range(4))
        arrived = em.collective(ops.all_to_all_v.default, (rows, send, recv), axis, part=part)
        x = g.call_function(md.regroup_rows, (arrived, regroup))
        offsets = g.call_function(aten.cumsum.default, (per_expert, 0), {"dtype": torch.int32})
        ids = g.call_function(md.expert_ids, (per_expert,))
        first = g.call_function(operator.mul, (em.coord(axis, part), held))
        y = self._run_held(em, block, x, offsets, ids, params, first, held)
        y = g.call_function(md.ungroup_rows, (y, regroup))
        return em.collective(ops.all_to_all_v.default, (y, recv, send), axis, part=part)

    def _own_experts(self, em, block, rows, counts, params, axes):
        """The chain on the rows of this rank's experts only (tokens replicated on ``axes``); the
        other rows' outputs are zero: this rank's part of a sum over ``axes``."""
        g = em.graph
        pieces, first = 1, 0
        for a in axes:  # nested in mesh order, the first axis outermost (as the weights are split)
            pieces *= em.mesh.shape[a]
            first = g.call_function(
                operator.add, (first, g.call_function(operator.mul, (em.coord(a), block.experts // pieces)))
            )
        held = block.experts // pieces
        mine = g.call_function(md.expert_rows, (rows, counts, first, held))
        x, offsets, ids = (g.call_function(operator.getitem, (mine, i)) for i in range(3))
        y = self._run_held(em, block, x, offsets, ids, params, first, held)
        total = g.call_function(aten.sym_size.int, (rows, 0))
        return g.call_function(md.place_rows, (y, counts, first, total))

    def comms(self, plan, node, axis: int, symbols) -> list[tuple]:
        """Per dispatch axis of n ranks: the counts (E int64), and the routed rows both ways,
        forward and backward: tokens x top-k x hidden x bytes, the (n-1)/n of them that go to
        other ranks when the routing is uniform (their expectation; the counts decide)."""
        strategies = node.meta["autopar"].strategies
        block = BLOCKS[node.args[4]]
        modes = axis_modes(strategies, block)
        hidden = node.args[0]
        out = []
        for a, mode in modes.items():
            if mode != "dispatch":
                continue
            part = dispatch_part(strategies, a, plan.mesh)
            if part is not None:  # inside the groups of one part of the axis: shown on its name
                a = part
            n = symbols.axis(a)
            rows = symbols.local_bytes(hidden, node.meta["autopar"].input_targets[0]) * block.top_k
            moved = rows * (n - 1) / n
            out.append(("all_to_all", a, "forward", block.experts * COUNT_BYTES * (n - 1) / n))
            out += [("all_to_all", a, "forward", moved), ("all_to_all", a, "forward", moved)]
            out.append(("all_to_all", a, "backward", moved))  # the outputs' gradients to the experts
            if plan.ctx.needs_grad.get(hidden):  # the rows' gradients back (not for an input without one)
                out.append(("all_to_all", a, "backward", moved))
        return out

    def reason(self, axis_name: str) -> str:
        return (
            f"expert parallel on {axis_name}: the routed token rows go to the ranks holding their experts "
            "and come back (all-to-all both ways, sizes from the routing)"
        )


EXPERT_DISPATCH = register_lowering(ExpertDispatch())
