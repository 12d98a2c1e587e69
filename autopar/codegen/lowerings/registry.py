"""Local rewrites for strategies where running the op as-is on the local pieces is not enough.

Each lowering builds, in the rank's graph, what one op becomes on that rank. It gets the
emitter (to add nodes), the original node, its already-local arguments, and the mesh axis
whose strategy asked for it.

Example (vocabulary split over 2 ranks, rank 1 holds rows 32..63):
    ids 40 -> local row 8; ids 5 -> masked: the rank returns zeros there, rank 0 the row.
"""
from __future__ import annotations

import operator

import torch

from autopar.codegen.lowerings.vocab_cross_entropy import cross_entropy_vocab_parallel

aten = torch.ops.aten
ops = torch.ops.autopar


def vocab_parallel_embedding(em, node, args, kwargs, axis: int):
    weight, ids = args[0], args[1]
    n = em.mesh.shape[axis]
    rows = em.global_shape(node.args[0])[0] // n
    g = em.graph
    start = g.call_function(operator.mul, (em.coord(axis), rows))
    below = g.call_function(aten.lt.Scalar, (ids, start))
    above = g.call_function(aten.ge.Scalar, (ids, g.call_function(operator.add, (start, rows))))
    outside = g.call_function(aten.bitwise_or.Tensor, (below, above))
    shifted = g.call_function(aten.sub.Tensor, (ids, start))
    local_ids = g.call_function(aten.masked_fill.Scalar, (shifted, outside, 0))
    rest = list(args[2:])
    if rest and rest[0] is not None and rest[0] >= 0:  # padding_idx: local on its owner, none elsewhere
        rest[0] = g.call_function(local_padding_idx, (rest[0], start, rows))
    looked_up = g.call_function(aten.embedding.default, (weight, local_ids) + tuple(rest), kwargs)
    mask = g.call_function(aten.unsqueeze.default, (outside, -1))
    return g.call_function(aten.masked_fill.Scalar, (looked_up, mask, 0.0))


def local_padding_idx(padding_idx: int, start: int, rows: int) -> int:
    """The padding row's local index on the rank holding rows start..start+rows, else -1."""
    return padding_idx - start if start <= padding_idx < start + rows else -1


def cross_entropy_split_rows(em, node, args, kwargs, axis: int):
    """mean over rows split across ranks = local sum / global count of counted targets."""
    for vocab_axis, s in enumerate(node.meta["autopar"].strategies):  # classes split too:
        if s is not None and s.lowering == "cross_entropy_vocab_parallel":  # that lowering counts rows
            return cross_entropy_vocab_parallel(em, node, args, kwargs, vocab_axis)
    logits, target = args[0], args[1]
    ignore_index = _arg(node, 4, "ignore_index", -100)
    g = em.graph
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    smoothing = args[5] if len(args) > 5 else kwargs.get("label_smoothing", 0.0)
    local_sum = g.call_function(node.target, (logits, target, weight, 2, ignore_index, smoothing))  # 2: sum
    counted = g.call_function(aten.ne.Scalar, (target, ignore_index))
    count = g.call_function(aten.sum.dim_IntList, (counted, []), {"dtype": torch.float32})
    total = em.collective(ops.all_reduce.default, (count,), axis, extra=("sum",))
    total = g.call_function(aten._to_copy.default, (total,), {"dtype": _dtype(node)})
    return g.call_function(aten.div.Tensor, (local_sum, total))


def split_blocked(em, node, args, kwargs, axis: int):
    """split of a blocked shard into its blocks: each local block is 1/n of the global one."""
    n = em.mesh.shape[axis]
    sizes = args[1]
    local = [s // n for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // n
    return em.graph.call_function(node.target, (args[0], local, *args[2:]), kwargs)


def _arg(node, i, name, default):
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, default)


def _dtype(node):
    return node.meta["val"].dtype


LOWERINGS = {
    "vocab_parallel_embedding": vocab_parallel_embedding,
    "cross_entropy_split_rows": cross_entropy_split_rows,
    "split_blocked": split_blocked,
    "cross_entropy_vocab_parallel": cross_entropy_vocab_parallel,
}
