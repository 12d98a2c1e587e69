"""Elementwise ops with broadcasting: activations, arithmetic, comparisons, masks, dropout.

Any output dim can be sharded: inputs that carry that dim are sharded alike, inputs that
broadcast along it stay replicated. Ops that are linear in one operand also pass a
Partial through (P + P -> P, P * R -> P), which lets a row-parallel output reach its
reduction later, or never when a partial sum is all that is needed.
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.lowerings.train_modes import lower_add_, lower_dropout
from autopar.sharding.rules.registry import OpInfo, Strategy, aten_ops, declare, register
from autopar.sharding.rules.triangular import triangular_strategies

aten = torch.ops.aten
R = Replicate()

# One entry per overload (registry.aten_ops): "max.other" is elementwise, "max.dim" is not.
NONLINEAR = aten_ops(
    "relu",
    "gelu",
    "silu",
    "tanh",
    "sigmoid",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "pow.Tensor_Tensor",
    "pow.Tensor_Scalar",
    "pow.Scalar",
    "abs",
    "erf",
    "sin",
    "cos",
    "reciprocal",
    "log1p",
    "expm1",
    "log_sigmoid",
    "rsub.Scalar",
    "masked_fill.Scalar",
    "masked_fill.Tensor",
    "where.self",
    "where.ScalarOther",
    "where.ScalarSelf",
    "where.Scalar",  # not where(cond): nonzero
    "clamp",
    "clamp.Tensor",
    "clamp_min",
    "clamp_min.Tensor",
    "clamp_max",
    "clamp_max.Tensor",
    "maximum",
    "minimum",
    "max.other",
    "min.other",
    "eq.Tensor",
    "eq.Scalar",
    "ne.Tensor",
    "ne.Scalar",
    "lt.Tensor",
    "lt.Scalar",
    "le.Tensor",
    "le.Scalar",
    "gt.Tensor",
    "gt.Scalar",
    "ge.Tensor",
    "ge.Scalar",
    "bitwise_not",
    "bitwise_and.Tensor",
    "bitwise_and.Scalar",
    "bitwise_and.Scalar_Tensor",
    "bitwise_or.Tensor",
    "bitwise_or.Scalar",
    "bitwise_or.Scalar_Tensor",
    "logical_not",
    "logical_and",
    "logical_or",
    "__and__.Tensor",
    "__and__.Scalar",
    "__or__.Tensor",
    "__or__.Scalar",
    "__xor__.Tensor",
    "__xor__.Scalar",
    "dropout",
    "leaky_relu",
    "hardtanh",
    "softplus",
    "elu",
    "mish",
    "ones_like",
    "full_like",
    "empty_like",
    "rand_like",
    "rand_like.generator",
    "randn_like",
    "randn_like.generator",
    "floor",
    "ceil",
    "round",
    "round.decimals",
    "sign",
    "isnan",
    "isinf",
    "fill.Scalar",
    "fill.Tensor",
    "square",
    "relu_",
    "gelu_",
    "silu_",
    "masked_fill_.Scalar",
    "masked_fill_.Tensor",
    "fill_.Scalar",  # in place: BART's shift_tokens_right writes the start token into a select
    "fill_.Tensor",
    "tril",
    "triu",
    # more activations and elementwise math (vision models: MobileNet's hardswish, in-place forms)
    "hardswish",
    "hardsigmoid",
    "hardswish_",
    "hardsigmoid_",
    "hardtanh_",
    "leaky_relu_",
    "elu_",
    "dropout_",
    "relu6",
    "sigmoid_",
    "tanh_",
    "mish_",
    "celu",
    "selu",
    "logit",
    "sinh",
    "cosh",
    "atan",
    "tan",
    "asin",
    "acos",
    "exp2",
    "log2",
    "log10",
    "trunc",
    "frac",
    "sgn",
    "erfinv",
    "softshrink",
    "hardshrink",
    "threshold",
    "nan_to_num",
    "lerp.Scalar",
    "lerp.Tensor",
    "xlogy.Tensor",
    "fmod.Scalar",
    "remainder.Scalar",
    "remainder.Tensor",
    "atan2",
    "floor_divide",
    "floor_divide.Scalar",
    "logical_xor",
    "isfinite",
    "bitwise_xor.Tensor",
)
# Linear in every tensor operand at once: P + P stays P.
ADDITIVE = aten_ops(
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "add_.Tensor", "add_.Scalar", "sub_.Tensor", "sub_.Scalar"
)
# Linear in each operand alone: P * R stays P; for div only the numerator may be P.
MULTIPLICATIVE = aten_ops(
    "mul.Tensor",
    "mul.Scalar",
    "mul_.Tensor",
    "mul_.Scalar",
    "div.Tensor",
    "div.Scalar",
    "div.Tensor_mode",
    "div.Scalar_mode",
    "div_.Tensor",
    "div_.Scalar",
    "div_.Tensor_mode",
    "div_.Scalar_mode",
)
# Unary and linear: P stays P.
UNARY_LINEAR = aten_ops(
    "neg",
    "clone",
    "contiguous",
    "alias",
    "detach",
    "_to_copy",
    "to.device",
    "to.dtype_layout",
    "to.dtype",
    "to.other",
    "type_as",
    "zeros_like",
    "lift_fresh_copy",
)


def shard_strategies(op: OpInfo) -> list[Strategy]:
    """All-R, plus for each output dim: that dim sharded on every input that carries it."""
    out = op.outputs[0]
    strategies = [op.replicated()]
    for d in range(out.ndim):
        placed = {}
        for t in op.tensors:
            td = d - (out.ndim - t.ndim)
            if td >= 0 and t.shape[td] == out.shape[d] and out.shape[d] != 1:
                placed[t] = Shard(td)
        if placed:
            strategies.append(op.strategy(placed, Shard(d)))
    return strategies


@register(*NONLINEAR)
def elementwise_rule(op: OpInfo) -> list[Strategy]:
    strategies = shard_strategies(op)
    if op.op in (aten.tril.default, aten.triu.default):
        strategies = triangular_strategies(op, strategies)
    return strategies


def _all_operands_tensors(op: OpInfo) -> bool:
    return all(hasattr(a, "shape") for a in op.args[:2])


@register(*ADDITIVE)
def additive_rule(op: OpInfo) -> list[Strategy]:
    strategies = shard_strategies(op)
    # P + scalar would add the scalar once per rank: only tensor + tensor stays partial.
    if len(op.tensors) == 2 and _all_operands_tensors(op):
        for kind in ("sum", "avg"):
            p = Partial(kind)
            strategies.append(Strategy((p, p), (p,), None, "partial sum"))
    return strategies


@register(*MULTIPLICATIVE)
def multiplicative_rule(op: OpInfo) -> list[Strategy]:
    strategies = shard_strategies(op)
    is_div = op.op.overloadpacket in (aten.div, aten.div_, aten.divide)
    if op.kwargs.get("rounding_mode") is not None:
        return strategies
    for i in range(len(op.tensors)):
        if is_div and i > 0:
            break
        for kind in ("sum", "avg"):
            ins = [R] * len(op.tensors)
            ins[i] = Partial(kind)
            strategies.append(Strategy(tuple(ins), (Partial(kind),), None, "linear in a partial operand"))
    return strategies


@register(*UNARY_LINEAR)
def unary_linear_rule(op: OpInfo) -> list[Strategy]:
    strategies = shard_strategies(op)
    if len(op.tensors) == 1 and op.op.overloadpacket is not aten.zeros_like:
        for kind in ("sum", "avg"):
            strategies.append(Strategy((Partial(kind),), (Partial(kind),), None, "linear"))
    return strategies


# dropout draws by the placements and follows train()/eval(); BatchNorm's batch counter (an add_)
# counts in training mode only (sharding/lowerings/train_modes.py)
declare(aten.dropout.default, mode=lower_dropout)
declare(aten.add_.Tensor, mode=lower_add_)
