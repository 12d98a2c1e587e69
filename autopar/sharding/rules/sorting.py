"""Sorting along one dim: topk, sort, argsort, and the scans cumsum/cumprod.

Each slice along ``dim`` is sorted (or scanned) on its own, so every other dim may stay split,
alike on the input and on every output (values and indices). MoE routers (topk over the
experts of each token) keep the token split this way.

Example:
    >>> along_dim_rule(op)    # topk x (8, 4) over dim -1 -> [R], [S(0) -> S(0), S(0)]
"""

from __future__ import annotations

import torch

from autopar.placement import Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten


def _dim(op: OpInfo) -> int:
    x = op.tensors[0]
    packet = op.op.overloadpacket
    if packet is aten.topk:
        d = op.arg(2, "dim", -1)
    elif op.op in (aten.sort.stable, aten.argsort.stable):
        d = op.kwargs.get("dim", -1)
    elif packet in (aten.sort, aten.argsort):
        d = op.arg(1, "dim", -1)
    else:  # cumsum(x, dim), cumprod(x, dim), logcumsumexp(x, dim), cummax/cummin(x, dim)
        d = op.arg(1, "dim", 0)
    return d % max(x.ndim, 1)


@register(
    aten.topk.default,
    aten.sort.default,
    aten.sort.stable,
    aten.argsort.default,
    aten.argsort.stable,
    aten.cumprod.default,
    aten.logcumsumexp.default,
    aten.cummax.default,
    aten.cummin.default,
)
def along_dim_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    dim = _dim(op)
    strategies = [op.replicated()]
    for d in range(x.ndim):
        if d != dim and x.shape[d] > 1:
            strategies.append(op.strategy({x: Shard(d)}, [Shard(d)] * len(op.outputs)))
    return strategies
