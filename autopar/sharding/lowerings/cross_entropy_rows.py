"""Cross-entropy over rows split across ranks: the mean is the local sum divided by the
global count of counted targets (ranks may drop different numbers of ignore_index rows, or hold
different numbers of rows: a dynamic-padding loader's sequence lengths; with class probabilities
as targets every row counts), so each rank's loss is its partial sum of the serial mean over the
union of the ranks' rows. ``ap.DataParallel(axis, loss_mean="per_rank")`` makes it DDP's instead
(``row_count``).

Example (rows split over dp=2, 3 and 1 counted targets): rank 0 returns sum0 / 4, rank 1 sum1 / 4.
"""

from __future__ import annotations

import torch

from autopar.sharding.lowerings.base import Lowering, register_lowering
from autopar.runtime.ring import ring_bytes

aten = torch.ops.aten
ops = torch.ops.autopar
COUNT_BYTES = 4  # the count is one float32


def node_arg(node, i: int, name: str, default):
    """Argument ``i`` (or keyword ``name``) of the traced node."""
    return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)


def _counted(g, node, target, ignore_index):
    """One flag per row that the serial mean divides by: targets other than ``ignore_index``
    for class indices; every row for class probabilities (soft labels), which have no
    ignore_index and hold one value per class (the class dim is dim 1)."""
    if node.args[1].meta["val"].dtype.is_floating_point:
        first_class = g.call_function(aten.select.int, (target, 1, 0))
        return g.call_function(aten.ones_like.default, (first_class,), {"dtype": torch.bool})
    return g.call_function(aten.ne.Scalar, (target, ignore_index))


def per_rank_mean(plan, axis: int) -> bool:
    """Whether a mean over rows split on ``axis`` is each rank's own mean (DDP's loss):
    ``ap.DataParallel(axis, loss_mean="per_rank")`` on its axis. Otherwise (the default) it is
    the mean over every rank's rows, the serial model's on the union of the ranks' batches."""
    dp = plan.data_parallel
    return dp is not None and axis == plan.dp_axis and dp.loss_mean == "per_rank"


def row_count(em, count, axis: int):
    """What a mean over rows split on ``axis`` divides the rank's sum by: the count summed over
    the axis (a token-weighted mean of all ranks' rows, whatever each rank holds), or for a
    per-rank mean the rank's own count times the axis size (the ranks' means, averaged when the
    loss is summed over the axis: the gradient DDP gives)."""
    if per_rank_mean(em.plan, axis):
        return em.graph.call_function(aten.mul.Tensor, (count, float(em.mesh.shape[axis])))
    return em.collective(ops.all_reduce.default, (count,), axis, extra=("sum",))


class CrossEntropySplitRows(Lowering):
    name = "cross_entropy_split_rows"
    uneven = True  # local sum / global count: right for rows cut in pieces of any size

    def emit(self, em, node, args, kwargs, axis: int):
        logits, target = args[0], args[1]
        ignore_index = node_arg(node, 4, "ignore_index", -100)
        g = em.graph
        weight = args[2] if len(args) > 2 else kwargs.get("weight")
        sum_args = (logits, target, weight, 2, ignore_index)  # 2: reduction "sum"
        if node.target is aten.cross_entropy_loss.default:  # nll_loss has no label smoothing
            sum_args += (args[5] if len(args) > 5 else kwargs.get("label_smoothing", 0.0),)
        local_sum = g.call_function(node.target, sum_args)
        count = g.call_function(
            aten.sum.dim_IntList, (_counted(g, node, target, ignore_index), []), {"dtype": torch.float32}
        )
        total = row_count(em, count, axis)
        total = g.call_function(aten._to_copy.default, (total,), {"dtype": node.meta["val"].dtype})
        return g.call_function(aten.div.Tensor, (local_sum, total))

    def comms(self, plan, node, axis: int, symbols) -> list[tuple]:
        if per_rank_mean(plan, axis):
            return []
        return [("all_reduce", axis, "forward", ring_bytes("all_reduce", COUNT_BYTES, symbols.axes[axis]))]

    def reason(self, axis_name: str) -> str:
        return (
            f"the loss's rows are split on {axis_name}: the count of targets is summed over {axis_name} "
            "so that local sum / global count is the serial mean"
        )


CROSS_ENTROPY_SPLIT_ROWS = register_lowering(CrossEntropySplitRows())
