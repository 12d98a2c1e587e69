"""Histograms: ``histc`` and ``bincount`` count the elements of their input (weighted, for
bincount's ``weights``) into bins that do not depend on where an element sits, so the counts of
a split input are each rank's partial counts: every split of the input gives a Partial output.
MoE load-balancing losses (HF's ``load_balancing_loss_func``) count the tokens routed to each
expert this way over batch-split router outputs.

Example:
    >>> histogram_rule(op)    # histc x (64,) -> [R] -> [R], [S(0)] -> [P]
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten


def histogram_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    out = [op.replicated()]
    for d in range(x.ndim):
        if x.shape[d] > 1:  # bincount's weights (same shape as x) split alike
            out.append(Strategy(tuple(Shard(d) for _ in op.tensors), (Partial(),), note="partial counts"))
    return out


register(aten.histc.default, aten.bincount.default)(histogram_rule)
