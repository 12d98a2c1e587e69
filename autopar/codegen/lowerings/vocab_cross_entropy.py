"""The vocab-parallel cross-entropy lowering, and the collectives it runs (for Plan.collectives).

Per rank, with logits (N, V/n) holding classes [start, start + V/n):
    m   = max over ranks of the row maxima   (all_gather of N values, no gradient)
    se  = all_reduce(sum exp(logits - m))    (N values)
    t   = all_reduce(logits[target] - m, where the target is in this rank's range, else 0)
    row = log(se) - t, zero where target == ignore_index
Reductions: none -> rows; sum -> sum of rows; mean -> sum / count, the count all-reduced
over every axis that splits the rows (data parallel), as cross_entropy_split_rows does.

Example:
    >>> lowering_comms("cross_entropy_vocab_parallel", plan, node, axis)   # 3 collectives on tp
"""
from __future__ import annotations

import operator

import torch

from autopar.placement import Shard

aten = torch.ops.aten
ops = torch.ops.autopar
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2


def _arg(node, i, name, default):
    return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)


def row_axes(node, vocab_axis: int) -> list[int]:
    """Axes other than the vocabulary one that split the rows (the logits' dim 0)."""
    lay = node.meta["autopar"]
    return [a for a, p in enumerate(lay.input_targets[0]) if a != vocab_axis and isinstance(p, Shard)]


def cross_entropy_vocab_parallel(em, node, args, kwargs, axis: int):
    logits, target = args[0], args[1]
    ignore_index = _arg(node, 4, "ignore_index", -100)
    reduction = _arg(node, 3, "reduction", REDUCTION_MEAN)
    call = em.graph.call_function
    n_local = em.global_shape(node.args[0])[1] // em.mesh.shape[axis]
    start = call(operator.mul, (em.coord(axis), n_local))
    local_max = call(aten.amax.default, (call(aten.detach.default, (logits,)), [1], True))
    maxes = em.collective(ops.all_gather.default, (local_max, 1), axis)
    shifted = call(aten.sub.Tensor, (logits, call(aten.amax.default, (maxes, [1], True))))
    sumexp = call(aten.sum.dim_IntList, (call(aten.exp.default, (shifted,)), [1]))
    sumexp = em.collective(ops.all_reduce.default, (sumexp,), axis, extra=("sum",))
    local_t = call(aten.sub.Tensor, (target, start))
    outside = call(aten.bitwise_or.Tensor, (call(aten.lt.Scalar, (local_t, 0)),
                                            call(aten.ge.Scalar, (local_t, n_local))))
    index = call(aten.unsqueeze.default, (call(aten.masked_fill.Scalar, (local_t, outside, 0)), 1))
    picked = call(aten.squeeze.dim, (call(aten.gather.default, (shifted, 1, index)), 1))
    picked = call(aten.masked_fill.Scalar, (picked, outside, 0.0))
    picked = em.collective(ops.all_reduce.default, (picked,), axis, extra=("sum",))
    rows = call(aten.sub.Tensor, (call(aten.log.default, (sumexp,)), picked))
    counted = call(aten.ne.Scalar, (target, ignore_index))
    rows = call(aten.where.self, (counted, rows, call(aten.zeros_like.default, (rows,))))
    if reduction == REDUCTION_NONE:
        return rows
    total = call(aten.sum.default, (rows,))
    if reduction == REDUCTION_SUM:
        return total
    count = call(aten.sum.dim_IntList, (counted, []), {"dtype": torch.float32})
    for a in row_axes(node, axis):
        count = em.collective(ops.all_reduce.default, (count,), a, extra=("sum",))
    count = call(aten._to_copy.default, (count,), {"dtype": node.meta["val"].dtype})
    return call(aten.div.Tensor, (total, count))


def vocab_parallel_comms(plan, node, axis: int, sy) -> list[tuple]:
    """(kind, mesh axis, phase, bytes per rank as a sympy formula) of what the lowering runs,
    for Plan.collectives; ``sy`` is the plan's formulas.PlanSymbols."""
    lay = node.meta["autopar"]
    val = node.args[0].meta["val"]
    rows = sy.shape(val.shape, lay.input_targets[0])[0]
    n = sy.axes[axis]
    item = val.dtype.itemsize
    out = [("all_gather", axis, "forward", (n - 1) * rows * item),
           ("all_reduce", axis, "forward", 2 * (n - 1) / n * rows * item),
           ("all_reduce", axis, "forward", 2 * (n - 1) / n * rows * item)]
    if _arg(node, 3, "reduction", REDUCTION_MEAN) == REDUCTION_MEAN:
        for a in row_axes(node, axis):
            m = sy.axes[a]
            out.append(("all_reduce", a, "forward", 2 * (m - 1) / m * 4))
    return out
