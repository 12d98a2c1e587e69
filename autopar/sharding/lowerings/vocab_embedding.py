"""Vocabulary-parallel embedding: each rank holds a range of rows; ids outside it read zeros
and the partial results are summed by the consumer's all-reduce.

Any vocabulary: rank k holds rows ``piece_start .. piece_start + piece_size`` (torch.tensor_split's
pieces: 50257 rows on 4 ranks are 12565, 12564, 12564, 12564).

Example (vocabulary split over 2 ranks, rank 1 holds rows 32..63):
    ids 40 -> local row 8; ids 5 -> masked: the rank returns zeros there, rank 0 the row.
"""

from __future__ import annotations

import operator

import torch

from autopar.runtime.uneven import pad_piece
from autopar.sharding.lowerings.base import Lowering, register_lowering

aten = torch.ops.aten


class VocabParallelEmbedding(Lowering):
    name = "vocab_parallel_embedding"
    uneven = True  # any vocabulary: each rank's range is placement.piece_start/piece_size
    contiguous = True  # reads its rows as one range (on a zig-zag axis: the plain order, piece_order.py)

    def emit(self, em, node, args, kwargs, axis: int):
        weight, ids = args[0], args[1]
        n = em.mesh.shape[axis]
        vocab = em.global_shape(node.args[0])[0]
        start, rows = em.piece_bounds(vocab, axis, em.orders.zigzag_in(node, 0, axis))
        g = em.graph
        if isinstance(vocab, int) and vocab < n:  # a rank may hold no row: look up in one zero row
            weight = g.call_function(pad_piece, (weight, 0, 1))
        below = g.call_function(aten.lt.Scalar, (ids, start))
        above = g.call_function(aten.ge.Scalar, (ids, g.call_function(operator.add, (start, rows))))
        outside = g.call_function(aten.bitwise_or.Tensor, (below, above))
        shifted = g.call_function(aten.sub.Tensor, (ids, start))
        local_ids = g.call_function(aten.masked_fill.Scalar, (shifted, outside, 0))
        rest = list(args[2:])
        if rest and rest[0] is not None and rest[0] >= 0:  # padding_idx: local on its owner, none elsewhere
            rest[0] = g.call_function(local_padding_idx, (rest[0], start, rows))
        looked_up = g.call_function(aten.embedding.default, (weight, local_ids) + tuple(rest), kwargs)
        mask = g.call_function(aten.unsqueeze.default, (outside, -1))
        return g.call_function(aten.masked_fill.Scalar, (looked_up, mask, 0.0))


def local_padding_idx(padding_idx: int, start: int, rows: int) -> int:
    """The padding row's local index on the rank holding rows start..start+rows, else -1."""
    return padding_idx - start if start <= padding_idx < start + rows else -1


VOCAB_PARALLEL_EMBEDDING = register_lowering(VocabParallelEmbedding())
