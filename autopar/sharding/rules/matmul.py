"""Contractions: linear, mm, bmm, matmul, as einsum-style dim labels.

Each dim label of ``lhs, rhs -> out`` gives one strategy: a batch or free label is sharded
wherever it appears; a contracted label is sharded on both operands and makes the output
Partial (row-parallel). A Partial operand times a replicated one stays Partial.
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import (
    MATMUL,
    OpInfo,
    Strategy,
    Work,
    aten_ops,
    declare,
    functional_overloads,
    register,
)

aten = torch.ops.aten
R = Replicate()


def einsum_strategies(op: OpInfo, lhs: str, rhs: str, out: str) -> list[Strategy]:
    """Strategies for a two-operand contraction with the given per-dim labels.

    A label is skipped on an operand whose size there is 1 (broadcast): it stays replicated.
    """
    a, b = op.tensors[0], op.tensors[1]
    strategies = [op.replicated()]
    for label in dict.fromkeys(lhs + rhs):
        placed = {}
        for meta, labels in ((a, lhs), (b, rhs)):
            if label in labels and meta.shape[labels.index(label)] != 1:
                placed[meta] = Shard(labels.index(label))
        if not placed:
            continue
        if label in out:
            output = Shard(out.index(label))
        elif len(placed) == 2:
            output = Partial()
        else:
            continue
        strategies.append(
            Strategy(
                tuple(placed.get(t, R) for t in (a, b)),
                (output,),
                None,
                "contracted dim split" if label not in out else "",
            )
        )
    for kind in ("sum", "avg"):
        strategies.append(Strategy((Partial(kind), R), (Partial(kind),), None, "partial lhs"))
        strategies.append(Strategy((R, Partial(kind)), (Partial(kind),), None, "partial rhs"))
    return strategies


BATCH_LABELS = "abcdefgh"


def matmul_labels(a_ndim: int, b_ndim: int) -> tuple[str, str, str]:
    """Labels for torch.matmul's broadcasting semantics; m, n free, k contracted."""
    lhs = "k" if a_ndim == 1 else "mk"
    rhs = "k" if b_ndim == 1 else "kn"
    nb = max(a_ndim - len(lhs), b_ndim - len(rhs), 0)
    batch = BATCH_LABELS[:nb]
    lhs = batch[nb - (a_ndim - len(lhs)) :] + lhs
    rhs = batch[nb - (b_ndim - len(rhs)) :] + rhs
    out = batch + ("m" if a_ndim > 1 else "") + ("n" if b_ndim > 1 else "")
    return lhs, rhs, out


@register(*aten_ops("matmul", "mm", "mm.dtype", "bmm", "bmm.dtype"), work=MATMUL)
def matmul_rule(op: OpInfo) -> list[Strategy]:
    lhs, rhs, out = matmul_labels(op.tensors[0].ndim, op.tensors[1].ndim)
    return einsum_strategies(op, lhs, rhs, out)


@register(aten.linear.default, work=MATMUL)
def linear_rule(op: OpInfo) -> list[Strategy]:
    """y = x @ w.T (the bias is split off into an add when the graph is prepared)."""
    x = op.tensors[0]
    batch = BATCH_LABELS[: x.ndim - 1]
    return einsum_strategies(op, batch + "k", "nk", batch + "n")


# addmm(bias, a, b): a matmul whose left operand is its second argument (no rule yet: the cost
# model still counts its work)
declare(*functional_overloads("addmm"), work=Work("matmul", lhs_arg=1))
