"""Blocked shards (``Shard(d, blocks=k)``) through ops that act elementwise along the dim.

Rules speak only of plain shards. When an input arrives blocked, every strategy of the
op that shards that input's dim is offered again with the blocked form, on every input
and output it shards, provided each of those dims has the same extent as the blocked
one: then the op maps element i of the dim to element i (a matmul's free dim, a bias
add, a view that keeps the dim whole, an activation), and any fixed permutation of the
dim, the blocked order included, passes through unchanged. A Partial output stays valid
too: a contraction over a blocked dim still sums every element once. Rules that end a
blocked dim (split into its blocks, a view to (blocks, heads, head_dim)) offer it
themselves (rules/views.py).

Example:
    >>> with_blocks([Strategy((Shard(1), Shard(0)), (Shard(1),))], info, [(Shard(1, blocks=3),), (R,)])
    [..., [S(1,blocks=3), S(0)] -> [S(1,blocks=3)]]   # when the weight's dim 0 has the same extent
"""

from __future__ import annotations

from dataclasses import replace

from autopar.placement import Shard


def with_blocks(strategies: list, info, cur: list) -> list:
    """``strategies`` plus blocked variants for the blocked shards among the current inputs."""
    blocked = {(p.blocks, info.tensors[i].shape[p.dim]) for i, p in _blocked_inputs(cur)}
    if not blocked:
        return strategies
    out = list(strategies)
    for k, extent in blocked:
        for s in strategies:
            v = _variant(s, info, k, extent)
            if v is not None and v not in out:
                out.append(v)
    return out


def _blocked_inputs(cur):
    for i, spec in enumerate(cur):
        for p in spec or ():
            if isinstance(p, Shard) and p.blocks > 1:
                yield i, p


def _variant(s, info, k: int, extent: int):
    ins = [_lift(p, m, k, extent) for p, m in zip(s.inputs, info.tensors)]
    outs = [_lift(p, m, k, extent) for p, m in zip(s.outputs, info.outputs)]
    if any(x is False for x in ins + outs) or not any(isinstance(p, Shard) for p in ins):
        return None
    return replace(s, inputs=tuple(ins), outputs=tuple(outs), note=(s.note + " blocked").strip())


def _lift(p, meta, k: int, extent: int):
    if not isinstance(p, Shard) or p.blocks > 1:
        return p
    if meta.shape[p.dim] != extent:
        return False
    return Shard(p.dim, blocks=k)
