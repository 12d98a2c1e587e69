"""Reductions whose dims and keepdim sit elsewhere than sum's (dim, keepdim) at 1 and 2, from one
table: variance and standard deviation (with their means), medians, modes, k-th values,
nan-aware sums and means, min-max pairs, nonzero counts, logsumexp under its special name,
quantiles of one q, trapezoid integrals (and their scans); softmax under other names and its backward.

Over a dim that stays split these keep it split (every output, values and indices alike);
over a split dim only a sum has a partial form (nansum, count_nonzero: Partial("sum")), the
others need the dim whole. ``var``/``std`` take ``unbiased`` (a bool) where sum takes ``dim``:
their dims come from the table, never from the argument at position 1.

Example:
    >>> dim_reduction_rule(op)   # var.dim(x (8, 6), [1]) -> [R], [S(0) -> S(0)]
"""

from __future__ import annotations


import torch

from autopar.placement import Shard
from autopar.sharding.rules.reductions import reduction_strategies, softmax_rule
from autopar.sharding.rules.registry import OpInfo, Strategy, aten_ops, register

aten = torch.ops.aten

ALL = "all"  # every dim (the overload has no dim argument, or it is None)

# overload -> (position and name of dim, default dim, position and name of keepdim, partial kind)
TABLE = {
    **dict.fromkeys(aten_ops("var", "std", "var_mean", "std_mean"), ((None, None), ALL, (None, None), None)),
    **dict.fromkeys(aten_ops("var.dim", "std.dim", "var_mean.dim", "std_mean.dim"), ((1, "dim"), ALL, (3, "keepdim"), None)),
    **dict.fromkeys(aten_ops("var_mean.correction", "std_mean.correction"), ((1, "dim"), ALL, (99, "keepdim"), None)),
    **dict.fromkeys(aten_ops("median", "nanmedian"), ((None, None), ALL, (None, None), None)),
    **dict.fromkeys(aten_ops("median.dim", "nanmedian.dim", "mode"), ((1, "dim"), -1, (2, "keepdim"), None)),
    aten_ops("kthvalue")[0]: ((2, "dim"), -1, (3, "keepdim"), None),
    aten_ops("nanmean")[0]: ((1, "dim"), ALL, (2, "keepdim"), None),  # counts differ per rank: no partial form
    aten_ops("nansum")[0]: ((1, "dim"), ALL, (2, "keepdim"), "sum"),
    aten_ops("aminmax")[0]: ((99, "dim"), ALL, (99, "keepdim"), None),
    aten_ops("count_nonzero")[0]: ((1, "dim"), ALL, (None, None), "sum"),
    aten_ops("count_nonzero.dim_IntList")[0]: ((1, "dim"), ALL, (None, None), "sum"),
    aten_ops("special_logsumexp")[0]: ((1, "dim"), ALL, (2, "keepdim"), None),
    aten_ops("norm.ScalarOpt_dtype")[0]: ((None, None), ALL, (None, None), None),
    **dict.fromkeys(aten_ops("quantile.scalar", "nanquantile.scalar"), ((2, "dim"), ALL, (3, "keepdim"), None)),
}  # fmt: skip


def reduced_dims(op: OpInfo) -> tuple[list[int], bool]:
    """(the dims ``op`` reduces, keepdim), read as TABLE says."""
    (dim_at, dim_name), default, (keep_at, keep_name) = TABLE[op.op][:3]
    ndim = max(op.tensors[0].ndim, 1)
    dims = op.arg(dim_at, dim_name, default) if dim_at is not None else ALL
    keepdim = bool(op.arg(keep_at, keep_name, False)) if keep_at is not None else False
    if dims is None or dims == ALL or dims == []:
        return list(range(op.tensors[0].ndim)), keepdim
    dims = [dims] if isinstance(dims, int) else dims
    return sorted(d % ndim for d in dims), keepdim


@register(*TABLE)
def dim_reduction_rule(op: OpInfo) -> list[Strategy]:
    return reduction_strategies(op, TABLE[op.op][3], reduced_dims(op))


TRAPEZOIDS = aten_ops("trapz.x", "trapz.dx", "trapezoid.x", "trapezoid.dx")
CUMULATIVE = aten_ops("cumulative_trapezoid.x", "cumulative_trapezoid.dx")


@register(*TRAPEZOIDS, *CUMULATIVE)
def trapezoid_rule(op: OpInfo) -> list[Strategy]:
    """Integrals of y along ``dim`` (cumulative: a scan): every other dim of y splits, and with it the
    sample points x where x has y's dims (a 1-D x is along ``dim``: replicated)."""
    y = op.tensors[0]
    x = op.tensors[1] if len(op.tensors) > 1 else None
    dim = op.arg(2, "dim", -1) % y.ndim
    scan = op.op in CUMULATIVE
    strategies = [op.replicated()]
    for d in range(y.ndim):
        if d == dim or y.shape[d] <= 1:
            continue
        placed = {y: Shard(d)}
        if x is not None and x.ndim == y.ndim:
            if x.shape[d] != y.shape[d]:
                continue
            placed[x] = Shard(d)
        strategies.append(op.strategy(placed, Shard(d if scan else d - (d > dim))))
    return strategies


# softmax-like ops over one dim, under other names (softmax_rule: every other dim splits)
register(aten._safe_softmax.default)(softmax_rule)


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward_rule(op: OpInfo) -> list[Strategy]:
    """(grad_output, output, dim, dtype): both split alike on any dim but ``dim``."""
    g = op.tensors[0]
    dim = op.args[2] % g.ndim
    return [op.replicated()] + [
        Strategy((Shard(d), Shard(d)), (Shard(d),)) for d in range(g.ndim) if d != dim and g.shape[d] > 1
    ]
