"""Ops that HuggingFace models emit in masks and losses: logical and/or, diff, pad, index.

- ``__and__``/``__or__``/``__xor__`` are elementwise (mask combination): see pointwise.py.
- ``diff(x, n, dim)`` and ``pad(x, pads)`` mix elements only along the dims they act on:
  every other dim may stay split.
- ``index.Tensor(x, [i0, i1, ...])`` (advanced indexing): dims of ``x`` that are not indexed
  keep their shard, at their place in the output; or the index tensors are split alike on
  one of their (broadcast) dims and the output with them, ``x`` replicated (a batch of
  per-row lookups, as in attention-mask construction).

Example:
    >>> index_rule(op)   # x (B, S) R, batch_idx (B/2, 1) S(0) -> out S(0)
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten


def _keep_dims(op: OpInfo, dims: list[int]) -> list[Strategy]:
    """Each dim in ``dims`` split on every tensor input alike and on the output."""
    strategies = [op.replicated()]
    n = op.outputs[0].ndim
    for d in dims:
        if all(t.ndim == n and t.shape[d] == op.outputs[0].shape[d] for t in op.tensors) and op.outputs[0].shape[d] > 1:
            strategies.append(Strategy((Shard(d),) * len(op.tensors), (Shard(d),)))
    return strategies


@register(aten.diff.default)
def diff_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    dim = op.arg(2, "dim", -1) % x.ndim
    return _keep_dims(op, [d for d in range(x.ndim) if d != dim])


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    pads = list(op.arg(1, "pad", []))
    padded = {x.ndim - 1 - i // 2 for i, p in enumerate(pads) if p != 0}
    return _keep_dims(op, [d for d in range(x.ndim) if d not in padded])


@register(aten.index.Tensor)
def index_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    indices = list(op.args[1])
    out = op.outputs[0]
    where = [d for d, i in enumerate(indices) if i is not None]
    idx = [i for i in indices if i is not None]
    if not where or any(getattr(i, "dtype", None) in (torch.bool, torch.uint8) for i in idx):
        return [op.replicated()]
    k = out.ndim - (x.ndim - len(where))  # dims of the broadcast index shape
    adjacent = where == list(range(where[0], where[-1] + 1))
    first = where[0] if adjacent else 0
    strategies = [op.replicated(), op.strategy({x: Partial()}, Partial(), note="a lookup is linear in x")]
    for d in range(x.ndim):  # a non-indexed dim of x keeps its shard
        if d in where or x.shape[d] == 1:
            continue
        if adjacent:  # the index shape replaces the indexed dims in place
            od = d if d < first else d - len(where) + k
        else:  # the index shape goes first
            od = d - sum(1 for w in where if w < d) + k
        strategies.append(op.strategy({x: Shard(d)}, Shard(od)))
    for j in range(k):  # the index tensors split alike on broadcast dim j
        placed = {}
        for i in idx:
            ij = j - (k - i.ndim)
            if ij < 0 or i.shape[ij] == 1:
                continue
            placed[i] = Shard(ij)
        if placed and out.shape[first + j] > 1:
            strategies.append(op.strategy(placed, Shard(first + j)))
    return strategies
