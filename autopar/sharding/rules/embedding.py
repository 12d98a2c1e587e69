"""Embedding lookups: split the batch of ids, the embedding dim, or the vocabulary.

A vocabulary split (weight rows on an axis, ids replicated) needs a masked local lookup:
each rank looks up only the ids in its row range and returns zeros elsewhere, so the
per-rank results sum to the full embedding (Partial, then all-reduced where needed).
"""

from __future__ import annotations

import torch

from autopar.sharding.lowerings.vocab_embedding import VOCAB_PARALLEL_EMBEDDING
from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten
R = Replicate()


@register(aten.embedding.default)
def embedding_rule(op: OpInfo) -> list[Strategy]:
    weight, ids = op.tensors[0], op.tensors[1]
    out_ndim = op.outputs[0].ndim
    strategies = [op.replicated(), op.strategy({weight: Shard(1)}, Shard(out_ndim - 1), note="embedding dim split")]
    for d in range(ids.ndim):
        if ids.shape[d] != 1:
            strategies.append(op.strategy({ids: Shard(d)}, Shard(d)))
    # (a padding_idx is translated to its owner's local row by the lowering)
    strategies.append(
        op.strategy({weight: Shard(0)}, Partial(), lowering=VOCAB_PARALLEL_EMBEDDING, note="vocabulary split")
    )
    return strategies
