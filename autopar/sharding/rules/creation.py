"""Ops that make tensors from sizes alone (arange, ones, full, ...): replicated.

A sharded consumer slices them locally (R -> S costs no communication). ``x.new_empty(size)``
and kin may also be made split like ``x`` (each rank its piece, one value everywhere).
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, aten_ops, register

aten = torch.ops.aten


# Not linspace.Tensor_*: their start/end tensors carry values, not only a dtype.
@register(
    *aten_ops(
        "arange",
        "arange.start",
        "arange.start_step",
        "ones",
        "zeros",
        "full",
        "empty.memory_format",
        "scalar_tensor",
        "eye",
        "eye.m",
        "tensor",
        "tensor.bool",
        "tensor.float",
        "tensor.int",
        "randn",
        "randn.generator",
        "rand",
        "rand.generator",
        "randint",
        "randint.generator",
        "randint.low",
        "randint.low_generator",
        "linspace",
    )
)
def creation_rule(op: OpInfo) -> list[Strategy]:
    strategies = [op.replicated()]
    if len(op.tensors) == 1:  # new_zeros(self, size): only self's dtype and device matter
        x = op.tensors[0]
        others = [Shard(d) for d in range(x.ndim)] + [Partial("sum"), Partial("avg")]
        strategies += [Strategy((p,), (Replicate(),), None, "size only") for p in others]
    return strategies


@register(*aten_ops("new_ones", "new_zeros", "new_full", "new_empty"), shape_arg=1)
def new_filled_rule(op: OpInfo) -> list[Strategy]:
    """``x.new_empty(size)`` and kin: one value everywhere (or none), so a rank can make its own
    piece of the output (its size made local by the emitter: ``shape_arg``) where ``x`` is split
    on the same dim: DeepSeek-V3's attention makes its keys with ``new_empty(B, H, S, D)`` and
    copies the batch-split parts in; replicated, it was gathered over dp."""
    strategies = creation_rule(op)
    x, out = op.tensors[0], op.outputs[0]
    # only a dim of the same size in both: the same dim of the data (batch for batch). ProphetNet's
    # labels.new_zeros(ngram, B, S) split its ngram dim like labels' batch dim, and the in-place
    # copy of labels into each ngram row then wrote into a redistributed copy (a NaN loss)
    split = [
        Strategy((Shard(d),), (Shard(d),), None, "each rank its piece")
        for d in range(min(x.ndim, out.ndim))
        if _same_dim(x, out, d)
    ]
    return strategies[:1] + split + strategies[1:]


def _same_dim(x, out, d: int) -> bool:
    """Dim ``d`` of ``x`` and of ``out`` is the same dim of the data: one size, and both dynamic
    (a batch) or both static."""
    dynamic = lambda t: t.dynamic[d] if d < len(t.dynamic) else False  # noqa: E731
    return x.shape[d] == out.shape[d] and dynamic(x) == dynamic(out)
