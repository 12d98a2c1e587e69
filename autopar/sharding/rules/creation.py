"""Ops that make tensors from sizes alone (arange, ones, full, ...): always replicated.

A sharded consumer slices them locally (R -> S costs no communication).
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, aten_ops, register

aten = torch.ops.aten


# Not linspace.Tensor_*: their start/end tensors carry values, not only a dtype.
@register(
    *aten_ops(
        "arange",
        "arange.start",
        "arange.start_step",
        "ones",
        "zeros",
        "full",
        "empty.memory_format",
        "scalar_tensor",
        "eye",
        "eye.m",
        "tensor",
        "tensor.bool",
        "tensor.float",
        "tensor.int",
        "new_ones",
        "new_zeros",
        "new_full",
        "new_empty",
        "randn",
        "randn.generator",
        "rand",
        "rand.generator",
        "randint",
        "randint.generator",
        "randint.low",
        "randint.low_generator",
        "linspace",
    )
)
def creation_rule(op: OpInfo) -> list[Strategy]:
    strategies = [op.replicated()]
    if len(op.tensors) == 1:  # new_zeros(self, size): only self's dtype and device matter
        x = op.tensors[0]
        others = [Shard(d) for d in range(x.ndim)] + [Partial("sum"), Partial("avg")]
        strategies += [Strategy((p,), (Replicate(),), None, "size only") for p in others]
    return strategies
