"""scaled_dot_product_attention: split the batch or the heads.

q is (B, H, L, E), k and v (B, Hkv, S, E). Heads split evenly keep grouped-query
attention's grouping when Hkv also divides. An attention mask follows the split on the
dims it carries and stays replicated on the dims it broadcasts.
"""

from __future__ import annotations

import torch

from autopar.placement import Shard
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
    return strategies
