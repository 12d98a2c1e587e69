"""Layers of torch.nn.functional that had no rule: transposed convolutions, max-unpooling, grid
sampling, distances and similarities over a feature dim, GLU, PReLU, channel shuffle, KL divergence.

- conv_transpose{1,2,3}d(x (N, C_in, ...), w (C_in, C_out/g, ...), b): the batch splits (weight
  replicated); with one group the output channels split with w's dim 1 and the bias;
- max_unpool{2,3}d(x, indices, size): indices are per (sample, channel) plane: batch and
  channels split, x and indices alike;
- grid_sampler(x (N, C, ...), grid (N, ..., k)): the batch (both), the channels (x only), or an
  output position dim (the grid's);
- pairwise_distance / cosine_similarity: every dim but the reduced feature dim (both inputs);
- glu(x, dim): every dim but the halved one; channel_shuffle: the batch;
- prelu(x, w): the batch with w replicated, the channels (dim 1) with a per-channel w;
- kl_div(input, target, reduction): elementwise for "none", a partial sum for "sum", a partial
  mean for "mean" (pieces of equal size: the split dims divide).

Example:
    >>> glu_rule(op)   # glu(x (8, 6), dim=-1) -> [R], [S(0) -> S(0)]
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.pointwise import shard_strategies
from autopar.sharding.rules.registry import OpInfo, Strategy, aten_ops, register
from autopar.sharding.rules.views import _moved

aten = torch.ops.aten
R = Replicate()


@register(*aten_ops("conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input"))
def conv_transpose_rule(op: OpInfo) -> list[Strategy]:
    x, w = op.tensors[0], op.tensors[1]
    bias = op.tensors[2] if len(op.tensors) > 2 else None
    groups = op.arg(6, "groups", 1)
    strategies = [op.replicated()]
    if x.shape[0] > 1:
        strategies.append(op.strategy({x: Shard(0)}, Shard(0)))
    if groups == 1 and w.shape[1] > 1:
        placed = {w: Shard(1)} | ({bias: Shard(0)} if bias is not None else {})
        strategies.append(op.strategy(placed, Shard(1), note="output channels split"))
    return strategies


@register(aten.max_unpool2d.default, aten.max_unpool3d.default)
def max_unpool_rule(op: OpInfo) -> list[Strategy]:
    x, idx = op.tensors[0], op.tensors[1]
    return [op.replicated()] + [
        op.strategy({x: Shard(d), idx: Shard(d)}, Shard(d)) for d in (0, 1) if d < x.ndim - 2 and x.shape[d] > 1
    ]


@register(*aten_ops("grid_sampler", "grid_sampler_2d", "grid_sampler_3d"))
def grid_sampler_rule(op: OpInfo) -> list[Strategy]:
    x, grid = op.tensors[0], op.tensors[1]
    strategies = [op.replicated()]
    if x.shape[0] > 1:
        strategies.append(op.strategy({x: Shard(0), grid: Shard(0)}, Shard(0)))
    if x.shape[1] > 1:
        strategies.append(op.strategy({x: Shard(1)}, Shard(1), note="channels"))
    for d in range(1, grid.ndim - 1):  # output positions: grid (N, H_out, W_out, k) -> out (N, C, H_out, W_out)
        if grid.shape[d] > 1:
            strategies.append(op.strategy({grid: Shard(d)}, Shard(d + 1), note="output positions"))
    return strategies


def _feature_reduction(op: OpInfo, dim: int) -> list[Strategy]:
    """Two inputs broadcast together, one dim reduced: any other dim splits on both."""
    strategies = [op.replicated()]
    for s in shard_strategies(_without_reduced(op, dim))[1:]:
        d = s.outputs[0].dim
        if d != dim:
            strategies.append(Strategy(s.inputs, (Shard(d - (d > dim)),)))
    return strategies


def _without_reduced(op: OpInfo, dim: int) -> OpInfo:
    """``op`` as the elementwise op it is before the reduction over ``dim`` (the inputs' shape)."""
    shape = torch.broadcast_shapes(*(t.shape for t in op.tensors))
    from_inputs = max(op.tensors, key=lambda t: t.ndim)
    meta = type(from_inputs)(tuple(shape), from_inputs.dtype)
    return OpInfo(op.op, op.args, op.kwargs, op.tensors, [meta], op.arg_tensor_index)


@register(aten.pairwise_distance.default)
def pairwise_distance_rule(op: OpInfo) -> list[Strategy]:
    ndim = max(t.ndim for t in op.tensors)
    return _feature_reduction(op, ndim - 1)


@register(aten.cosine_similarity.default)
def cosine_similarity_rule(op: OpInfo) -> list[Strategy]:
    ndim = max(t.ndim for t in op.tensors)
    return _feature_reduction(op, op.arg(2, "dim", 1) % ndim)


@register(aten.glu.default)
def glu_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    dim = op.arg(1, "dim", -1) % x.ndim
    return _moved(op, {d: d for d in range(x.ndim) if d != dim}, partial=False)


@register(aten.channel_shuffle.default, aten.native_channel_shuffle.default)
def channel_shuffle_rule(op: OpInfo) -> list[Strategy]:
    return _moved(op, {0: 0}, partial=False)


@register(aten.prelu.default, aten._prelu_kernel.default)
def prelu_rule(op: OpInfo) -> list[Strategy]:
    x, w = op.tensors[0], op.tensors[1]
    per_channel = w.ndim > 0 and w.shape[0] > 1
    strategies = [op.replicated()]
    for d in range(x.ndim):
        if x.shape[d] <= 1:
            continue
        if d == 1 and per_channel:
            strategies.append(op.strategy({x: Shard(1), w: Shard(0)}, Shard(1), note="channels"))
        else:
            strategies.append(op.strategy({x: Shard(d)}, Shard(d)))
    return strategies


@register(aten.kl_div.default)
def kl_div_rule(op: OpInfo) -> list[Strategy]:
    reduction = op.arg(2, "reduction", 1)
    elementwise = shard_strategies(_without_reduced(op, -1)) if reduction else shard_strategies(op)
    if reduction == 0:
        return elementwise
    kind = "sum" if reduction == 2 else "avg"
    return [op.replicated()] + [Strategy(s.inputs, (Partial(kind),), None, f"partial {kind}") for s in elementwise[1:]]


@register(aten.max_pool2d_with_indices_backward.default, aten.max_pool3d_with_indices_backward.default)
def max_pool_backward_rule(op: OpInfo) -> list[Strategy]:
    """(grad_output, self, ..., indices): batch and channels split on all three alike."""
    g, x, idx = op.tensors[0], op.tensors[1], op.tensors[-1]
    spatial = 3 if op.op is aten.max_pool3d_with_indices_backward.default else 2
    dims = [d for d in range(x.ndim - spatial) if x.shape[d] > 1]
    return [op.replicated()] + [op.strategy({g: Shard(d), x: Shard(d), idx: Shard(d)}, Shard(d)) for d in dims]
