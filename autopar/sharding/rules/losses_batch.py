"""Losses whose rows (dim 0) are independent samples: margin losses, triplet loss, and nll_loss
over N-d inputs. Split rows give each rank its samples' losses: "none" keeps them split, "sum" is a
partial sum, "mean" a partial mean (the pieces are of equal size: split dims divide; nll_loss's
mean divides by the counted targets instead and uses cross-entropy's lowering, loss.py).

Example:
    >>> batch_loss_rule(op)   # multi_margin_loss(x (8, 5), t (8,), reduction=mean) -> [R], [S(0), S(0) -> P(avg)]
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.loss import cross_entropy_rule
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten
R = Replicate()

# overload -> (position and name of ``reduction``, tensors that carry the rows besides the first)
ROW_LOSSES = {
    aten.multi_margin_loss.default: ((5, "reduction"), 1),  # self, target (weight: per class, replicated)
    aten.multilabel_margin_loss.default: ((2, "reduction"), 1),
    aten.triplet_margin_loss.default: ((7, "reduction"), 2),  # anchor, positive, negative
}
REDUCED = {0: None, 1: "avg", 2: "sum"}


@register(*ROW_LOSSES)
def batch_loss_rule(op: OpInfo) -> list[Strategy]:
    (at, name), carried = ROW_LOSSES[op.op]
    rows = op.tensors[: 1 + carried]
    strategies = [op.replicated()]
    if rows[0].ndim < 2 or rows[0].shape[0] <= 1 or any(t.ndim == 0 or t.shape[0] != rows[0].shape[0] for t in rows):
        return strategies  # one unbatched sample
    kind = REDUCED[op.arg(at, name, 1)]
    out = Shard(0) if kind is None else Partial(kind)
    strategies.append(op.strategy({t: Shard(0) for t in rows}, out, note="rows split"))
    return strategies


register(aten.nll_loss_nd.default)(cross_entropy_rule)
