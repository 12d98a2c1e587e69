"""scaled_dot_product_attention: split the batch, the heads or the sequence.

q is (B, H, L, E), k and v (B, Hkv, S, E). Heads split evenly keep grouped-query
attention's grouping when Hkv also divides. An attention mask follows the split on the
dims it carries and stays replicated on the dims it broadcasts.

The sequence (context parallel): q, k and v split on dim -2 (their positions), the output
split as q; the lowering that meets the local queries with every key (all-gathered, passed
around a ring, or by Ulysses' all-to-alls) belongs to the technique that splits sequences,
which registers it here at import (``register_sequence_lowering``); without one the sequence
split is not offered. A mask given to the op is split on its query dim and whole on its key dim. Not
offered with attention dropout (its draws would have to follow the serial ones).
"""

from __future__ import annotations

import torch

from autopar.placement import Replicate, Shard
from autopar.sharding.rules.registry import ATTENTION, OpInfo, Strategy, declare, functional_overloads, register

aten = torch.ops.aten


# every attention kernel export may leave (flash, efficient, math, cudnn): two matmuls per head
ATTENTION_KERNELS = (
    "scaled_dot_product_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
declare(*functional_overloads(*ATTENTION_KERNELS), work=ATTENTION)

# the lowering of attention on a split sequence: filled at import by the technique that owns it
_SEQUENCE_LOWERING: list = []


def register_sequence_lowering(lowering):
    """Make ``lowering`` the one that runs attention whose q, k and v are split on their positions
    (once: a second registration is an error). Returns it.

    Example:
        >>> SEQUENCE_ATTENTION = register_sequence_lowering(register_lowering(MyAttentionLowering()))
    """
    if _SEQUENCE_LOWERING:
        raise ValueError(f"a sequence-split attention lowering is registered twice ({_SEQUENCE_LOWERING[0].name})")
    _SEQUENCE_LOWERING.append(lowering)
    return lowering


@register(aten.scaled_dot_product_attention.default)
def sdpa_rule(op: OpInfo) -> list[Strategy]:
    q, k, v = op.tensors[:3]
    mask = op.tensors[3] if len(op.tensors) > 3 else None
    strategies = [op.replicated()]
    for d in (0, 1):
        if q.shape[d] == 1 or k.shape[d] == 1:
            continue
        placed = {q: Shard(d), k: Shard(d), v: Shard(d)}
        if mask is not None:
            md = d - (4 - mask.ndim)
            if md >= 0 and mask.shape[md] != 1:
                placed[mask] = Shard(md)
        strategies.append(op.strategy(placed, Shard(d), note="heads split" if d == 1 else "batch split"))
    sequence = _sequence_split(op, q, k, v, mask)
    return strategies + ([sequence] if sequence is not None else [])


def _sequence_split(op: OpInfo, q, k, v, mask) -> Strategy | None:
    """q, k, v split on their positions (dim -2), the mask on its query dim (context parallel)."""
    d = q.ndim - 2
    if not _SEQUENCE_LOWERING or q.shape[d] == 1 or k.shape[k.ndim - 2] == 1 or op.arg(4, "dropout_p", 0.0):
        return None
    placed = {q: Shard(d), k: Shard(k.ndim - 2), v: Shard(v.ndim - 2)}
    if mask is not None:
        if mask.shape[-1] == 1 and k.shape[-2] != 1:
            return None  # a mask broadcast along the keys: not a key mask the lowering can narrow
        placed[mask] = Shard(mask.ndim - 2) if mask.ndim >= 2 and mask.shape[-2] != 1 else Replicate()
    return op.strategy(placed, Shard(d), lowering=_SEQUENCE_LOWERING[0], note="sequence split")
