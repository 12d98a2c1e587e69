"""Ops that make tensors from sizes alone (arange, ones, full, ...): always replicated.

A sharded consumer slices them locally (R -> S costs no communication).
"""
from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten


@register(aten.arange, aten.ones, aten.zeros, aten.full, aten.empty, aten.scalar_tensor,
          aten.eye, aten.tensor, aten.new_ones, aten.new_zeros, aten.new_full,
          aten.new_empty, aten.randn, aten.rand, aten.randint, aten.linspace)
def creation_rule(op: OpInfo) -> list[Strategy]:
    strategies = [op.replicated()]
    if len(op.tensors) == 1:  # new_zeros(self, size): only self's dtype and device matter
        x = op.tensors[0]
        others = [Shard(d) for d in range(x.ndim)] + [Partial("sum"), Partial("avg")]
        strategies += [Strategy((p,), (Replicate(),), None, "size only") for p in others]
    return strategies
