"""Losses: cross-entropy over rows split across ranks.

With rows (the batch) split, "mean" needs the global number of counted targets (ignore_index
may drop some on one rank and not another), so the lowering all-reduces each rank's loss sum
and count together and divides: the serial mean, whole on every rank (sharding/lowerings/cross_entropy_rows.py).
"""

from __future__ import annotations

import torch

from autopar.sharding.lowerings.cross_entropy_rows import CROSS_ENTROPY_SPLIT_ROWS
from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten
R = Replicate()
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2


# cross_entropy_loss is registered in vocab_loss.py, whose rule extends this one.
@register(aten.nll_loss.default, aten.nll_loss_forward.default)
def cross_entropy_rule(op: OpInfo) -> list[Strategy]:
    logits, target = op.tensors[0], op.tensors[1]
    reduction = op.arg(3, "reduction", REDUCTION_MEAN)
    class_weight = op.tensors[2] if len(op.tensors) > 2 else None
    strategies = [op.replicated()]
    # 1-D logits are one row whose dim 0 is the classes: nothing to split by rows
    if logits.ndim < 2 or logits.shape[0] == 1 or op.op.overloadpacket is aten.nll_loss_forward:
        return strategies
    soft = target.dtype.is_floating_point  # class probabilities: the mean divides by the rows, weighted or not
    placed = {logits: Shard(0), target: Shard(0)}
    if class_weight is not None:
        placed[class_weight] = R
    if reduction == REDUCTION_NONE:
        strategies.append(op.strategy(placed, Shard(0)))
    elif reduction == REDUCTION_SUM:
        strategies.append(op.strategy(placed, Partial("sum"), note="sum of split rows"))
    elif class_weight is None or soft:
        strategies.append(
            op.strategy(
                placed,
                R,
                lowering=CROSS_ENTROPY_SPLIT_ROWS,
                note="mean over split rows: global sum / global count",
            )
        )
    return strategies
