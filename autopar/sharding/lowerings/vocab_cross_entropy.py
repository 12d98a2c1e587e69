"""The vocab-parallel cross-entropy lowering, and the collectives it runs (for Plan.collectives).

Per rank, with logits (N, L) holding classes [start, start + L) (L: the rank's piece of V,
placement.piece_sizes; any V, uneven pieces included):
    m   = max over ranks of the row maxima   (all_gather of N values, no gradient)
    se  = all_reduce(sum exp(logits - m))    (N values)
    t   = all_reduce(logits[target] - m, where the target is in this rank's range, else 0)
    row = log(se) - t, zero where target == ignore_index
Reductions: none -> rows; sum -> sum of rows; mean -> sum / count, the sum and the count
all-reduced together over every axis that splits the rows (data parallel), as
cross_entropy_split_rows does (``rows_mean``).

Example:
    >>> CROSS_ENTROPY_VOCAB_PARALLEL.comms(plan, node, axis, symbols)   # 3 collectives on tp
"""

from __future__ import annotations


import torch

from autopar.sharding.lowerings.base import Lowering, register_lowering
from autopar.sharding.lowerings.cross_entropy_rows import mean_comms, rows_mean
from autopar.sharding.lowerings.cross_entropy_rows import node_arg as _arg
from autopar.placement import Shard
from autopar.runtime.uneven import pad_piece
from autopar.runtime.ring import ring_bytes

aten = torch.ops.aten
ops = torch.ops.autopar
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2


def row_axes(node, vocab_axis: int) -> list[int]:
    """Axes other than the vocabulary one that split the rows (the logits' dim 0)."""
    lay = node.meta["autopar"]
    return [a for a, p in enumerate(lay.input_targets[0]) if a != vocab_axis and isinstance(p, Shard)]


def cross_entropy_vocab_parallel(em, node, args, kwargs, axis: int):
    logits, target = args[0], args[1]
    ignore_index = _arg(node, 4, "ignore_index", -100)
    reduction = _arg(node, 3, "reduction", REDUCTION_MEAN)
    call = em.graph.call_function
    vocab = em.global_shape(node.args[0])[1]
    start, n_local = em.piece_bounds(vocab, axis, em.orders.zigzag_in(node, 0, axis))
    if isinstance(vocab, int) and vocab < em.mesh.shape[axis]:  # a rank may hold no class: one -inf column
        logits = call(pad_piece, (logits, 1, 1, float("-inf")))
    local_max = call(aten.amax.default, (call(aten.detach.default, (logits,)), [1], True))
    maxes = em.collective(ops.all_gather.default, (local_max, 1), axis)
    shifted = call(aten.sub.Tensor, (logits, call(aten.amax.default, (maxes, [1], True))))
    sumexp = call(aten.sum.dim_IntList, (call(aten.exp.default, (shifted,)), [1]))
    sumexp = em.collective(ops.all_reduce.default, (sumexp,), axis, extra=("sum",))
    local_t = call(aten.sub.Tensor, (target, start))
    outside = call(
        aten.bitwise_or.Tensor, (call(aten.lt.Scalar, (local_t, 0)), call(aten.ge.Scalar, (local_t, n_local)))
    )
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
    return rows_mean(em, node, total, count, row_axes(node, axis))


class CrossEntropyVocabParallel(Lowering):
    """Cross-entropy on logits split by class: never gathers a row (3 collectives of N values)."""

    name = "cross_entropy_vocab_parallel"
    uneven = True  # any vocabulary: each rank's classes are placement.piece_start/piece_size
    contiguous = True  # reads its classes as one range (on a zig-zag axis: the plain order, piece_order.py)
    priority = 1  # also counts rows split on other axes: it takes over cross_entropy_split_rows

    def emit(self, em, node, args, kwargs, axis: int):
        return cross_entropy_vocab_parallel(em, node, args, kwargs, axis)

    def comms(self, plan, node, axis: int, symbols) -> list[tuple]:
        lay = node.meta["autopar"]
        val = node.args[0].meta["val"]
        row_bytes = symbols.shape(val.shape, lay.input_targets[0])[0] * val.dtype.itemsize
        n = symbols.axes[axis]
        out = [
            ("all_gather", axis, "forward", ring_bytes("all_gather", row_bytes, n)),
            ("all_reduce", axis, "forward", ring_bytes("all_reduce", row_bytes, n)),
            ("all_reduce", axis, "forward", ring_bytes("all_reduce", row_bytes, n)),
        ]
        if _arg(node, 3, "reduction", REDUCTION_MEAN) == REDUCTION_MEAN:
            out += mean_comms(plan, row_axes(node, axis), symbols)
        return out

    def kept(self, plan, node, axis: int) -> list[tuple]:
        """What the emitted ops' backward keeps (cost/activation_memory.py's terms): the shifted
        logits (``gather`` keeps its input) and their exp (``exp`` keeps its output), two tensors
        of the rank's logits piece in the logits' dtype, and the targets; the op itself keeps one
        (its log-softmax). Measured in a dry run (405B widths, vocabulary over tp 8, fp32 logits
        of 4 x 8192 rows: 1.96 GiB each, both alive from the forward to the loss's backward)."""
        return [("own", 0, 1.0, ("in", 0)), ("own", 1, 1.0, ("in", 0)), ("in", 1, 0.0)]

    def reason(self, axis_name: str) -> str:
        return (
            f"vocab-parallel cross-entropy on {axis_name}: row maxima gathered, exp-sums and target "
            "logits all-reduced (N values each), never a whole row"
        )


CROSS_ENTROPY_VOCAB_PARALLEL = register_lowering(CrossEntropyVocabParallel())
