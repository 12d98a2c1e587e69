"""Reductions (sum, mean, amax, ...) and softmax-like ops over a dim.

Reducing over a sharded dim leaves each rank a piece of the answer: Partial("sum") for sum,
Partial("avg") for mean. Max-like reductions over a sharded dim have no partial form here,
so that dim must be gathered first; any other dim may stay sharded.
"""
from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten
R = Replicate()


def _reduced_dims(op: OpInfo) -> tuple[list[int], bool]:
    x = op.tensors[0]
    dims = op.arg(1, "dim", None)
    keepdim = bool(op.arg(2, "keepdim", False))
    if dims is None or dims == [] or op.op in (aten.sum.default, aten.mean.default):
        return list(range(x.ndim)), False
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % max(x.ndim, 1) for d in dims), keepdim


def _out_dim(d: int, reduced: list[int], keepdim: bool) -> int:
    return d if keepdim else d - sum(1 for r in reduced if r < d)


def reduction_strategies(op: OpInfo, partial_kind: str | None) -> list[Strategy]:
    x = op.tensors[0]
    reduced, keepdim = _reduced_dims(op)
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


@register(aten.sum)
def sum_rule(op: OpInfo) -> list[Strategy]:
    return reduction_strategies(op, "sum")


@register(aten.mean)
def mean_rule(op: OpInfo) -> list[Strategy]:
    return reduction_strategies(op, "avg")


@register(aten.amax, aten.amin, aten.max, aten.min, aten.argmax, aten.argmin, aten.var,
          aten.std, aten.any, aten.all, aten.logsumexp, aten.norm, aten.linalg_vector_norm, aten.prod)
def nonlinear_reduction_rule(op: OpInfo) -> list[Strategy]:
    if op.op in (aten.max.default, aten.min.default):  # full reductions without dim
        return [op.replicated()]
    return reduction_strategies(op, None)


@register(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.cumsum)
def softmax_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    dim = op.args[1] % x.ndim
    strategies = [op.replicated()]
    for d in range(x.ndim):
        if d != dim and x.shape[d] != 1:
            strategies.append(Strategy((Shard(d),), (Shard(d),)))
    return strategies
