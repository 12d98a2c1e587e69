"""Indexed reads and writes: gather, scatter (src/value/add/reduce), index_select, index_add,
index_copy, masked_scatter (MoE routing, label lookups, cache writes).

- gather(x, dim, index) / scatter*(x, dim, index, src): every dim other than ``dim`` where all
  tensors have the same size may be split alike on all of them, and the output with them.
- index_select(x, dim, index): a split dim of x other than ``dim`` stays split; or the index is
  split and the output with it on ``dim`` (x replicated).
- index_add / index_copy(x, dim, index, source): dims other than ``dim`` split alike on x and
  source; index_add is linear in (x, source), so Partial x and source give a Partial output.
- masked_scatter(x, mask, source) fills x's masked elements from source in order: linear in
  (x, source), so Partial ones give Partial; otherwise it needs whole tensors.

Example:
    >>> gather_rule(op)    # gather(x (8, 5), -1, idx (8, 1)) -> [R], [S(0), S(0) -> S(0)]
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten
P = Partial()


def _same_dims(op: OpInfo, dim: int) -> list[Strategy]:
    out = op.outputs[0]
    strategies = [op.replicated()]
    for d in range(out.ndim):
        if d == dim or out.shape[d] < 2:
            continue
        if all(t.ndim == out.ndim and t.shape[d] == out.shape[d] for t in op.tensors):
            strategies.append(op.strategy({t: Shard(d) for t in op.tensors}, Shard(d)))
    return strategies


@register(
    aten.gather.default,
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter.reduce,
    aten.scatter.value_reduce,
    aten.scatter_add.default,
    aten.scatter_reduce.two,
    aten.scatter_.src,
    aten.scatter_.value,
    aten.scatter_add_.default,
)  # in place: the same
def gather_rule(op: OpInfo) -> list[Strategy]:
    """Dims other than ``dim`` split alike (gather's output has the index's shape)."""
    dim = op.args[1] % max(op.tensors[0].ndim, 1)
    return _same_dims(op, dim)


@register(aten.index_select.default)
def index_select_rule(op: OpInfo) -> list[Strategy]:
    x, index = op.tensors[0], op.tensors[1]
    dim = op.args[1] % max(x.ndim, 1)
    strategies = [op.replicated()]
    for d in range(x.ndim):
        if d != dim and x.shape[d] > 1:
            strategies.append(op.strategy({x: Shard(d)}, Shard(d)))
    if index.ndim == 1 and index.shape[0] > 1:
        strategies.append(op.strategy({index: Shard(0)}, Shard(dim), note="index split"))
    strategies.append(op.strategy({x: P}, P, note="linear in x"))
    return strategies


@register(aten.index_add.default, aten.index_copy.default)
def index_add_rule(op: OpInfo) -> list[Strategy]:
    x, src = op.tensors[0], op.tensors[2]
    dim = op.args[1] % max(x.ndim, 1)
    strategies = [op.replicated()]
    for d in range(x.ndim):  # the 1-D index stays whole
        if d != dim and x.shape[d] > 1 and src.ndim == x.ndim and src.shape[d] == x.shape[d]:
            strategies.append(op.strategy({x: Shard(d), src: Shard(d)}, Shard(d)))
    if op.op is aten.index_add.default:
        strategies.append(op.strategy({x: P, src: P}, P, note="linear"))
    return strategies


@register(aten.masked_scatter.default)
def masked_scatter_rule(op: OpInfo) -> list[Strategy]:
    x, mask, src = op.tensors[:3]
    return [op.replicated(), op.strategy({x: P, src: P}, P, note="linear")]
