"""A whole MoE experts module as one op: ``autopar::moe_experts(hidden, index, weights, params, key)``
(blocks.py makes it from an ``expert_parallel`` module). Token-wise: output row t
depends on row t of hidden, index and weights only. Strategies, per mesh axis:

- tokens split (hidden, index, weights S(0)), experts replicated -> out S(0): each rank runs its
  tokens through every expert (plain data parallelism);
- tokens split and experts split (params S(0); a per-expert ModuleList's S(0, of=(i, E)): expert
  i's tensors whole on the rank holding it, empty elsewhere) on the same axis -> out S(0): expert parallelism
  with an all-to-all dispatch (lowering ``expert_dispatch``): each rank sends every routed row
  to the rank holding its expert and gets the outputs back; experts split within groups of the
  axis (``S(0, within=k)``: the inner of two merged data-parallel axes) -> the same dispatch
  inside each group of k ranks; split across those groups (``S(0, across=k)``: the outer axis)
  -> the dispatch among the ranks at the same position in every group;
- tokens replicated, experts split -> out Partial: each rank runs the rows routed to its own
  experts, the others' rows are zero (the expert split without a dispatch);
- all replicated -> replicated;
- tokens replicated, each expert split column- then row-parallel (``expert_parallel(.., tp=)``,
  tensor_parallel.py) -> out Partial: the chain runs as it is on the weights' pieces (a
  ModuleList's row bias read as P: the first rank's part adds it, so the sum holds it once).

Every strategy names the one lowering: it emits the whole module on the rank (route, dispatch or
select, the expert chain, combine, weighting), whatever each axis does.

Example:
    >>> moe_experts_rule(op)   # [hidden S(0), index S(0), weights S(0), w S(0)] -> [S(0)] via expert_dispatch
"""

from __future__ import annotations

from autopar.placement import Partial, Replicate, Shard
from autopar.parallel.experts.blocks import BLOCKS, MOE_EXPERTS
from autopar.parallel.experts.dispatch import EXPERT_DISPATCH
from autopar.sharding.rules.registry import OpInfo, Strategy, Work, register

R = Replicate()


def moe_experts_rule(op: OpInfo) -> list[Strategy]:
    hidden, index, weights, *params = op.tensors
    tokens = (hidden, index, weights)

    block = BLOCKS[op.args[4]]

    def strategy(tok, par, out, note):
        if isinstance(par, Shard) and block.expert is not None:  # a ModuleList: each expert's tensors on its rank
            of = [(j // block.per_expert, block.experts) for j in range(len(params))]
            split = tuple(Shard(block.of_dim(j), of=o, within=par.within, across=par.across) for j, o in enumerate(of))
        else:
            split = tuple(par for _ in params)
        return Strategy(tuple(tok for _ in tokens) + split, (out,), EXPERT_DISPATCH, note)

    tp = []
    if block.tp is not None:  # each expert split column- then row-parallel: a partial sum
        ins = (R,) * len(tokens) + block.tp[1]
        tp.append(Strategy(ins, (Partial(),), EXPERT_DISPATCH, "expert tensor parallel"))
    grouped = []
    if block.grouped is not None:  # experts on one of two merged data-parallel axes
        note = f"expert parallel on the {block.grouped.part} part of the axis: tokens dispatched inside its groups"
        grouped.append(strategy(Shard(0), block.grouped, Shard(0), note))
    return (
        tp
        + grouped
        + [
            strategy(R, R, R, "replicated"),
            strategy(Shard(0), R, Shard(0), "tokens split, every expert on each rank"),
            strategy(Shard(0), Shard(0), Shard(0), "expert parallel: tokens dispatched to their experts' ranks"),
            strategy(R, Shard(0), Partial(), "experts split: each rank runs the rows routed to its experts"),
        ]
    )


def moe_experts_flops(node, sy):
    """Global forward FLOPs of a moe_experts node: every routed row (tokens x top-k) through one
    expert's weights, 2 per multiply-add (the cost model's ``Work.flops``)."""
    params = node.args[3]
    stacked = [p.meta["val"].shape[1:] for p in params if p.meta["val"].dim() == 3]
    per_expert = BLOCKS[node.args[4]].per_expert  # a ModuleList's: expert 0's own tensors
    one = stacked or [p.meta["val"].shape for p in params[:per_expert]]
    return 2 * sy.numel(node.args[1].meta["val"].shape) * sum(sy.numel(shape) for shape in one)


EXPERTS = Work("experts", flops=moe_experts_flops)  # kind "experts": a library kernel, never fused (cost/fusion.py)
register(MOE_EXPERTS, work=EXPERTS)(moe_experts_rule)
