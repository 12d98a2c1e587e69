"""Cross-entropy over rows split across ranks: the mean is the sum over every rank's rows
divided by the global count of counted targets (ranks may drop different numbers of ignore_index
rows, or hold different numbers of rows: a dynamic-padding loader's sequence lengths; with class
probabilities as targets every row counts): the serial mean over the union of the ranks' rows,
the same value on every rank. ``ap.DataParallel(axis, loss_mean="per_rank")`` makes it DDP's
instead: the mean of the ranks' own means.

One all-reduce of two numbers (the rank's sum and its count) gives both totals: the mean is
whole on every rank (its strategy's output is replicated), where dividing the local sum by an
all-reduced count first left a partial loss for the output to all-reduce again (two blocking
scalar all-reduces in forward). Autograd through the sum's all-reduce (identity backward) gives
each rank's rows the serial gradient, 1 / global count.

Example (rows split over dp=2, 3 and 1 counted targets): every rank returns (sum0 + sum1) / 4.
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
    name = plan.mesh.axis_names[axis]
    return any(t.loss_mean_on(name) == "per_rank" for t in plan.options.techniques)


def rows_mean(em, node, total, count, axes: list[int]):
    """The mean of rows split on ``axes`` from a rank's ``total`` (its rows' loss sum) and its
    ``count`` (float32), whole on every rank: over the global-mean axes the sum and the count are
    all-reduced together (one collective of two numbers per axis: a token-weighted mean of every
    rank's rows, whatever each rank holds); over a per-rank-mean axis the ranks' means are
    averaged (DDP's loss and gradient)."""
    call, dtype = em.graph.call_function, node.meta["val"].dtype
    # summed in float32 (a bf16 loss's sum and the count), or in float64 for a float64 model:
    # its loss keeps its own precision (a float32 sum moved an fp64 loss by 1e-8)
    wide = torch.float64 if dtype == torch.float64 else torch.float32

    def cast(x, frm, to):  # to the pair's dtype and back: none where they are one
        return x if frm == to else call(aten._to_copy.default, (x,), {"dtype": to})

    per_rank = [a for a in axes if per_rank_mean(em.plan, a)]
    pair = call(aten.stack.default, ([cast(total, dtype, wide), cast(count, torch.float32, wide)],))
    for a in axes:
        if a not in per_rank:
            pair = em.collective(ops.all_reduce.default, (pair,), a, extra=("sum",))
    mean = call(aten.div.Tensor, (call(aten.select.int, (pair, 0, 0)), call(aten.select.int, (pair, 0, 1))))
    for a in per_rank:
        mean = em.collective(ops.all_reduce.default, (mean,), a, extra=("avg",))
    return cast(mean, wide, dtype)


def mean_comms(plan, axes: list[int], symbols) -> list[tuple]:
    """The collectives of ``rows_mean`` (for Plan.collectives and the cost model)."""
    return [
        (
            "all_reduce",
            a,
            "forward",
            ring_bytes("all_reduce", COUNT_BYTES * (1 if per_rank_mean(plan, a) else 2), symbols.axes[a]),
        )
        for a in axes
    ]


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
        return rows_mean(em, node, local_sum, count, [axis])

    def comms(self, plan, node, axis: int, symbols) -> list[tuple]:
        return mean_comms(plan, [axis], symbols)

    def reason(self, axis_name: str) -> str:
        return (
            f"the loss's rows are split on {axis_name}: the rows' loss sum and count of targets are summed "
            f"over {axis_name} together (one all-reduce of two numbers), their ratio the serial mean"
        )


CROSS_ENTROPY_SPLIT_ROWS = register_lowering(CrossEntropySplitRows())
