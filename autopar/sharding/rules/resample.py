"""Resampling and patch ops: interpolate/upsample, pixel (un)shuffle, unfold (im2col), fold (col2im).

All of them act on the trailing spatial dims of each (batch, channel) plane:
- upsample_*: batch and channel dims may stay split.
- pixel_shuffle (*, C r^2, H, W) -> (*, C, H r, W r): a split of C r^2 holds whole r^2
  blocks when it divides C, so it stays a split of C; pixel_unshuffle the reverse.
- im2col (N, C, H, W) -> (N, C kh kw, L) and col2im back: channel-major, so a split of C
  is a split of C kh kw (whole kernels per rank).

Example:
    >>> upsample_rule(op)   # upsample_nearest2d x (4, 8, 6, 6) -> [R], [S(0)], [S(1)]
"""

from __future__ import annotations

import torch

from autopar.placement import Shard
from autopar.sharding.rules.pooling import leading_dims_strategies
from autopar.sharding.rules.registry import OpInfo, Strategy, functional_overloads, register

aten = torch.ops.aten

UPSAMPLE = {
    "upsample_nearest1d": 1,
    "upsample_nearest2d": 2,
    "upsample_nearest3d": 3,
    "_upsample_nearest_exact1d": 1,
    "_upsample_nearest_exact2d": 2,
    "_upsample_nearest_exact3d": 3,
    "upsample_linear1d": 1,
    "upsample_bilinear2d": 2,
    "upsample_trilinear3d": 3,
    "_upsample_bilinear2d_aa": 2,
    "upsample_bicubic2d": 2,
    "_upsample_bicubic2d_aa": 2,
}


def upsample_rule(op: OpInfo) -> list[Strategy]:
    return leading_dims_strategies(op, UPSAMPLE[op.op.overloadpacket.__name__])


register(*functional_overloads(*UPSAMPLE))(upsample_rule)


@register(aten.pixel_shuffle.default, aten.pixel_unshuffle.default)
def pixel_shuffle_rule(op: OpInfo) -> list[Strategy]:
    """Leading dims and the channel dim (whole r^2 blocks per rank: checked on the output)."""
    return leading_dims_strategies(op, 2)


@register(aten.im2col.default, aten.col2im.default)
def im2col_rule(op: OpInfo) -> list[Strategy]:
    x, out = op.tensors[0], op.outputs[0]
    strategies = [op.replicated()]
    if x.ndim == out.ndim + 1 or x.ndim + 1 == out.ndim:  # batched (N, C, ...) <-> (N, C k, L)
        for d in (0, 1):
            if x.shape[d] > 1:
                strategies.append(op.strategy({x: Shard(d)}, Shard(d)))
    else:  # unbatched: (C, H, W) <-> (C k, L)
        strategies.append(op.strategy({x: Shard(0)}, Shard(0)))
    return strategies
