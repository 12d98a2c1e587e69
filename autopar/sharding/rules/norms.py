"""Normalisations over trailing dims: layer_norm, rms_norm.

The normalised dims must be whole on every rank; leading (batch, sequence) dims may be
split, and then the replicated weight and bias get partial gradients that the gradient
sync reduces.
"""

from __future__ import annotations

import torch

from autopar.placement import Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, aten_ops, register

aten = torch.ops.aten


@register(*aten_ops("layer_norm", "rms_norm", "native_layer_norm"))
def norm_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    lead = x.ndim - len(op.args[1])
    n_out = len(op.outputs)
    strategies = [op.replicated()]
    for d in range(lead):
        if x.shape[d] == 1:
            continue
        outs = tuple(Shard(d) for _ in range(n_out))  # native_layer_norm's mean/rstd keep lead dims
        strategies.append(op.strategy({x: Shard(d)}, outs))
    return strategies
