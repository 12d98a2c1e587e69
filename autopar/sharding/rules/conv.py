"""Convolutions: conv1d/2d/3d, grouped and depthwise (aten.convolution and the convNd ops).

x (N, C_in, *spatial), w (C_out, C_in / groups, *kernel), b (C_out,):
- batch split: x S(0), w and b replicated -> out S(0) (data parallel; w's gradient is partial).
- output channels split (column-parallel), groups == 1: w S(0), b S(0) -> out S(1).
- input channels split (row-parallel), groups == 1, no bias: x S(1), w S(1) -> out Partial.
- channels split with groups > 1 (depthwise, grouped) when every rank holds whole groups:
  x S(1), w S(0), b S(0) -> out S(1), run with groups / n on each rank (lowering ``conv_groups``).

Example:
    >>> conv_rule(op)    # x (4, 8, 6, 6), w (8, 1, 3, 3), groups 8 -> [..., x S(1), w S(0) -> S(1) via conv_groups]
"""

from __future__ import annotations

import torch

from autopar.errors import ShardingError
from autopar.sharding.lowerings.base import Lowering, register_lowering
from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten
R = Replicate()
CONVS = [
    aten.conv1d.default,
    aten.conv2d.default,
    aten.conv3d.default,
    aten.conv1d.padding,
    aten.conv2d.padding,
    aten.conv3d.padding,
]


def _groups(op: OpInfo) -> int:
    if op.op is aten.convolution.default:
        return op.args[8]
    return op.arg(6, "groups", 1)


def _bias(op: OpInfo):
    b = op.arg(2, "bias")
    return b if b is not None and b in op.tensors else None


def conv_strategies(op: OpInfo) -> list[Strategy]:
    x, w = op.tensors[0], op.tensors[1]
    b = _bias(op)
    groups = _groups(op)
    batched = x.ndim == w.ndim  # an unbatched input (C, *spatial) has no batch dim
    c = 1 if batched else 0
    strategies = [op.replicated()]
    if batched and x.shape[0] > 1:
        strategies.append(op.strategy({x: Shard(0)}, Shard(0), note="batch split"))
    if groups == 1:
        placed = {w: Shard(0)} | ({b: Shard(0)} if b is not None else {})
        strategies.append(op.strategy(placed, Shard(c), note="output channels split"))
        if b is None and w.shape[1] > 1:
            strategies.append(op.strategy({x: Shard(c), w: Shard(1)}, Partial(), note="input channels split"))
    else:
        placed = {x: Shard(c), w: Shard(0)} | ({b: Shard(0)} if b is not None else {})
        strategies.append(op.strategy(placed, Shard(c), lowering=CONV_GROUPS, note="whole groups per rank"))
    if b is None:  # linear in x: a partial sum stays one
        strategies.append(op.strategy({x: Partial()}, Partial(), note="partial input"))
    return strategies


register(*CONVS)(conv_strategies)
register(aten.convolution.default)(conv_strategies)


class ConvGroups(Lowering):
    """A grouped conv on whole groups: each rank runs groups / (ranks splitting the channels)."""

    name = "conv_groups"

    def emit(self, em, node, args, kwargs, axis: int):
        return _conv_groups(em, node, args, kwargs)


CONV_GROUPS = register_lowering(ConvGroups())


def _conv_groups(em, node, args, kwargs):
    n = 1
    for a, s in enumerate(node.meta["autopar"].strategies):
        if s is not None and s.lowering is CONV_GROUPS:
            n *= em.mesh.shape[a]
    groups = _groups_of(node)
    if groups % n:
        raise ShardingError(
            f"node {node.name!r}: a conv with {groups} groups cannot run on {n} ranks with whole "
            f"groups each; split its channels over fewer ranks or replicate it."
        )
    args = list(args)
    if node.target is aten.convolution.default:
        args[8] = args[8] // n
    elif len(args) > 6:
        args[6] = args[6] // n
    else:
        kwargs = {**kwargs, "groups": kwargs.get("groups", 1) // n}
    return em.graph.call_function(node.target, tuple(args), kwargs)


def _groups_of(node) -> int:
    if node.target is aten.convolution.default:
        return node.args[8]
    return node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
