"""Elementwise ops with broadcasting: activations, arithmetic, comparisons, masks, dropout.

Any output dim can be sharded: inputs that carry that dim are sharded alike, inputs that
broadcast along it stay replicated. Ops that are linear in one operand also pass a
Partial through (P + P -> P, P * R -> P), which lets a row-parallel output reach its
reduction later, or never when a partial sum is all that is needed.
"""
from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, register

aten = torch.ops.aten
R = Replicate()

NONLINEAR = [
    aten.relu, aten.gelu, aten.silu, aten.tanh, aten.sigmoid, aten.exp, aten.log, aten.sqrt,
    aten.rsqrt, aten.pow, aten.abs, aten.erf, aten.sin, aten.cos, aten.reciprocal, aten.log1p,
    aten.masked_fill, aten.where, aten.clamp, aten.clamp_min, aten.clamp_max, aten.maximum,
    aten.minimum, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.bitwise_not,
    aten.bitwise_and, aten.bitwise_or, aten.logical_not, aten.logical_and, aten.logical_or,
    aten.dropout, aten.leaky_relu, aten.hardtanh, aten.softplus, aten.elu, aten.mish,
    aten.ones_like, aten.full_like, aten.empty_like, aten.rand_like, aten.randn_like, aten.floor, aten.ceil,
    aten.round, aten.sign, aten.isnan, aten.isinf, aten.fill, aten.square, aten.relu_,
    aten.gelu_, aten.silu_, aten.masked_fill_, aten.tril, aten.triu,
]
# Linear in every tensor operand at once: P + P stays P.
ADDITIVE = [aten.add, aten.sub, aten.add_, aten.sub_]
# Linear in each operand alone: P * R stays P; for div only the numerator may be P.
MULTIPLICATIVE = [aten.mul, aten.mul_, aten.div, aten.div_]
# Unary and linear: P stays P.
UNARY_LINEAR = [aten.neg, aten.clone, aten.contiguous, aten.alias, aten.detach, aten._to_copy,
                aten.to, aten.type_as, aten.zeros_like, aten.lift_fresh_copy]


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


def _tril_triu_ok(op: OpInfo, s: Strategy) -> bool:
    # tril/triu look at the last two dims: those cannot be split.
    p = s.outputs[0]
    return not (isinstance(p, Shard) and p.dim >= op.outputs[0].ndim - 2)


@register(*NONLINEAR)
def elementwise_rule(op: OpInfo) -> list[Strategy]:
    strategies = shard_strategies(op)
    if op.op in (aten.tril.default, aten.triu.default):
        strategies = [s for s in strategies if _tril_triu_ok(op, s)]
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
    is_div = op.op.overloadpacket in (aten.div, aten.div_)
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
