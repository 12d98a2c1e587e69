"""More views: flatten, unflatten, view_as, numpy_T (``w.T``), and copy_ into a like tensor.

- flatten / view_as are views of the input's shape: the view rule's dim groups apply.
- unflatten(x, dim, sizes): the view rule's groups too; its ``sizes`` are global, so the
  lowering ``unflatten_local`` divides the entry that carries a split.
- numpy_T reverses every dim (``w.T`` of a 2-D weight is t()).
- copy_(dst, src): elementwise; both split alike, or both Partial.

Example:
    >>> flatten_rule(op)   # x (4, 8, 6) flatten(1) -> [R], [S(0) -> S(0)], [S(1) -> S(1)], ...
"""

from __future__ import annotations

import torch

from autopar.sharding.lowerings.base import Lowering, register_lowering
from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register
from autopar.sharding.rules.views import _moved, view_rule

R = Replicate()

aten = torch.ops.aten


@register(aten.flatten.using_ints)
def flatten_rule(op: OpInfo) -> list[Strategy]:
    return view_rule(op)


@register(aten.view_as.default, aten.reshape_as.default)
def view_as_rule(op: OpInfo) -> list[Strategy]:
    """view's strategies; ``other`` gives only the shape, so it is split like the output (its
    local shape is the local output shape) or replicated where the output is."""
    out = []
    for s in view_rule(op):
        p = s.outputs[0]
        out.append(Strategy(s.inputs[:1] + (p if isinstance(p, Shard) else R,), s.outputs, s.lowering, s.note))
    return out


class UnflattenLocal(Lowering):
    """unflatten with its sizes made local: the output dims that carry a split shrink."""

    name = "unflatten_local"
    uneven = True  # sizes made local by Emitter.piece_of, uneven pieces included

    def emit(self, em, node, args, kwargs, axis: int):
        dim = node.args[1] % node.args[0].meta["val"].dim()
        spec = node.meta["autopar"].spec
        sizes = [em.piece_of(s, spec, dim + i) for i, s in enumerate(args[2])]
        return em.graph.call_function(node.target, (args[0], args[1], sizes), kwargs)


UNFLATTEN_LOCAL = register_lowering(UnflattenLocal())


@register(aten.unflatten.int)
def unflatten_rule(op: OpInfo) -> list[Strategy]:
    return [
        Strategy(s.inputs, s.outputs, UNFLATTEN_LOCAL if isinstance(s.outputs[0], Shard) else None, s.note)
        for s in view_rule(op)
    ]


@register(aten.numpy_T.default)
def numpy_t_rule(op: OpInfo) -> list[Strategy]:
    n = op.tensors[0].ndim
    return _moved(op, {d: n - 1 - d for d in range(n)})


@register(aten.copy_.default, aten.copy.default)
def copy_rule(op: OpInfo) -> list[Strategy]:
    dst, src = op.tensors[0], op.tensors[1]
    strategies = [op.replicated()]
    if src.shape == dst.shape:
        for d in range(dst.ndim):
            if dst.shape[d] > 1:
                strategies.append(op.strategy({dst: Shard(d), src: Shard(d)}, Shard(d)))
        strategies.append(op.strategy({dst: Partial(), src: Partial()}, Partial(), note="linear"))
    return strategies
