"""Cross-entropy over logits whose class dim is split (a vocab-parallel LM head).

No rank ever holds a full row of logits: each computes, over its slice of the classes,
the row maxima (gathered, then the max taken locally: a stable shift, no gradient), the
sum of exponentials and the target's logit where it falls in its range, and two
all-reduces of one value per row give every rank the same loss (Megatron's
vocab-parallel cross-entropy). Autograd through those sums (identity backward) leaves
each rank the gradient of its own slice: softmax minus one-hot, restricted to it.
Combines with rows split on another axis (data parallel): see sharding/lowerings/vocab_cross_entropy.py.
"""

from __future__ import annotations

import torch

from autopar.sharding.lowerings.vocab_cross_entropy import CROSS_ENTROPY_VOCAB_PARALLEL
from autopar.placement import Replicate, Shard  # noqa: F401
from autopar.sharding.rules.loss import cross_entropy_rule
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten
R = Replicate()


@register(aten.cross_entropy_loss.default)
def vocab_cross_entropy_rule(op: OpInfo) -> list[Strategy]:
    strategies = cross_entropy_rule(op)
    logits, target = op.tensors[0], op.tensors[1]
    weight = op.arg(2, "weight", None)
    smoothing = op.arg(5, "label_smoothing", 0.0)
    if logits.ndim != 2 or target.ndim != 1 or weight is not None or smoothing:
        return strategies
    strategies.append(
        op.strategy({logits: Shard(1), target: R}, R, lowering=CROSS_ENTROPY_VOCAB_PARALLEL, note="classes split")
    )
    return strategies
