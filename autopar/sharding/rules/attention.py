"""scaled_dot_product_attention: split the batch, the heads or the sequence.

q is (B, H, L, E), k and v (B, Hkv, S, E). Heads split evenly keep grouped-query
attention's grouping when Hkv also divides. An attention mask follows the split on the
dims it carries and stays replicated on the dims it broadcasts.

The sequence (context parallel): q, k and v split on dim -2 (their positions), the output
split as q; the lowering (lowerings/context_attention.py) meets the local queries with every
key (all-gathered or passed around a ring) and builds the causal mask from the rank's
positions. A mask given to the op is split on its query dim and whole on its key dim. Not
offered with attention dropout (its draws would have to follow the serial ones).
"""

from __future__ import annotations

import torch

from autopar.placement import Replicate, Shard
from autopar.sharding.lowerings.context_attention import CONTEXT_ATTENTION
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
    if q.shape[d] == 1 or k.shape[k.ndim - 2] == 1 or op.arg(4, "dropout_p", 0.0):
        return None
    placed = {q: Shard(d), k: Shard(k.ndim - 2), v: Shard(v.ndim - 2)}
    if mask is not None:
        if mask.shape[-1] == 1 and k.shape[-2] != 1:
            return None  # a mask broadcast along the keys: not a key mask the lowering can narrow
        placed[mask] = Shard(mask.ndim - 2) if mask.ndim >= 2 and mask.shape[-2] != 1 else Replicate()
    return op.strategy(placed, Shard(d), lowering=CONTEXT_ATTENTION, note="sequence split")
