"""Reductions (sum, mean, amax, ...) and softmax-like ops over a dim.

Reducing over a sharded dim leaves each rank a piece of the answer: Partial("sum") for sum,
Partial("avg") for mean. Max-like reductions over a sharded dim have no partial form here,
so that dim must be gathered first; any other dim may stay sharded.
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, aten_ops, register

aten = torch.ops.aten
R = Replicate()


# Overloads that reduce every dim; the others take (dim, keepdim) at argument positions
# 1 and 2, except where _DIM_ARGS says otherwise (norms take the order p first).
_FULL = set(aten_ops("sum", "mean", "max", "min", "any", "all", "prod", "norm.Scalar"))
_DIM_ARGS = {op: (2, 3) for op in aten_ops("norm.ScalarOpt_dim", "norm.ScalarOpt_dim_dtype", "linalg_vector_norm")}


def _reduced_dims(op: OpInfo) -> tuple[list[int], bool]:
    x = op.tensors[0]
    dim_at, keep_at = _DIM_ARGS.get(op.op, (1, 2))
    dims = None if op.op in _FULL else op.arg(dim_at, "dim", None)
    keepdim = bool(op.arg(keep_at, "keepdim", False))
    if dims is None or dims == []:
        return list(range(x.ndim)), keepdim
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % max(x.ndim, 1) for d in dims), keepdim


def _out_dim(d: int, reduced: list[int], keepdim: bool) -> int:
    return d if keepdim else d - sum(1 for r in reduced if r < d)


def reduction_strategies(op: OpInfo, partial_kind: str | None, reduced_dims=None) -> list[Strategy]:
    """``reduced_dims``: (dims, keepdim) where the op's arguments do not say them as sum's do."""
    x = op.tensors[0]
    reduced, keepdim = reduced_dims or _reduced_dims(op)
    n_out = len(op.outputs)
    strategies = [op.replicated()]
    for d in range(x.ndim):
        if x.shape[d] == 1:
            continue
        if d not in reduced:
            strategies.append(Strategy((Shard(d),), (Shard(_out_dim(d, reduced, keepdim)),) * n_out))
        elif partial_kind:
            strategies.append(Strategy((Shard(d),), (Partial(partial_kind),), None, "reduced a split dim"))
    if partial_kind:
        for kind in ("sum", "avg"):
            strategies.append(Strategy((Partial(kind),), (Partial(kind),), None, "linear"))
    return strategies


@register(*aten_ops("sum", "sum.dim_IntList"))
def sum_rule(op: OpInfo) -> list[Strategy]:
    return reduction_strategies(op, "sum")


@register(*aten_ops("mean", "mean.dim"))
def mean_rule(op: OpInfo) -> list[Strategy]:
    return reduction_strategies(op, "avg")


# Not here: max.other / min.other (elementwise, pointwise.py); var(self, unbiased) and
# var.dim(..., unbiased, keepdim) (export emits var.correction); max.dim_max (out= forms).
@register(
    *aten_ops(
        "amax",
        "amin",
        "max",
        "min",
        "max.dim",
        "min.dim",
        "argmax",
        "argmin",
        "var.correction",
        "std.correction",
        "any",
        "any.dim",
        "any.dims",
        "all",
        "all.dim",
        "all.dims",
        "logsumexp",
        "norm.Scalar",
        "norm.ScalarOpt_dim",
        "norm.ScalarOpt_dim_dtype",
        "linalg_vector_norm",
        "prod",
        "prod.dim_int",
    )
)
def nonlinear_reduction_rule(op: OpInfo) -> list[Strategy]:
    return reduction_strategies(op, None)


@register(*aten_ops("softmax.int", "_softmax", "log_softmax.int", "_log_softmax", "cumsum"))
def softmax_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    dim = op.args[1] % x.ndim
    strategies = [op.replicated()]
    for d in range(x.ndim):
        if d != dim and x.shape[d] != 1:
            strategies.append(Strategy((Shard(d),), (Shard(d),)))
    return strategies
