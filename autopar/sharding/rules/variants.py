"""Ops some transformer variants add: baddbmm (Bloom's ALiBi attention scores), expand_as,
index_put (MoE routing's inverse permutation, cache writes), repeat (DiffLlama's heads),
repeat_interleave and einsum (Falcon-H1's Mamba mixer), concat, view_as_complex /
view_as_real (Llama-4's rotary), and torch's other names of mul/div/sub.

- ``baddbmm(bias, b1, b2, beta, alpha) = beta * bias + alpha * (b1 @ b2)``: the bmm's
  strategies; a dim split on the output is split on ``bias`` too where ``bias`` has it (a
  broadcast dim of size 1 stays replicated). A contracted split (partial output) only where
  ``beta`` is 0 (otherwise the bias would be added on every rank).
- ``expand_as(x, other)``: expand's strategies, with ``other`` split like the output (its
  local shape is the local output shape).
- ``index_put(x, indices, values, accumulate)``: indices replicated; a dim of x after the
  indexed ones (a boolean mask indexes as many dims as it has) stays split, with the matching dim of ``values`` (or ``values`` replicated
  where it broadcasts there). Linear in (x, values) for fixed indices: both Partial -> Partial.

- ``repeat(x, reps)``: a dim repeated once keeps its split (a dim repeated r > 1 times stays
  whole: the copies of each rank's piece would interleave with the others'). Linear in x.

Example:
    >>> baddbmm_rule(op)   # bias (8, 1, 5), b1 (8, 5, 4), b2 (8, 4, 5) -> [..., S(0), S(0), S(0) -> S(0)]
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.matmul import einsum_strategies
from autopar.sharding.rules.matrix import labelled_strategies
from autopar.sharding.rules.pointwise import additive_rule, multiplicative_rule
from autopar.sharding.rules.registry import OpInfo, Strategy, Work, aten_ops, register
from autopar.sharding.rules.views import cat_rule

aten = torch.ops.aten
R = Replicate()


@register(aten.baddbmm.default, work=Work("matmul", lhs_arg=1))
def baddbmm_rule(op: OpInfo) -> list[Strategy]:
    bias, b1, b2 = op.tensors[0], op.tensors[1], op.tensors[2]
    if len(op.tensors) != 3 or b1.ndim != 3:
        return [op.replicated()]
    inner = OpInfo(op.op, (b1, b2), {}, [b1, b2], op.outputs, {id(b1): 0, id(b2): 1})
    beta = op.kwargs.get("beta", 1)
    off = 3 - bias.ndim
    strategies = [op.replicated()]
    for s in einsum_strategies(inner, "bmk", "bkn", "bmn"):
        out = s.outputs[0]
        if isinstance(out, Shard):
            bd = out.dim - off
            has = bd >= 0 and bias.shape[bd] > 1
            strategies.append(Strategy((Shard(bd) if has else R,) + s.inputs, (out,), None, s.note))
        elif out.is_partial() and beta == 0 and s.inputs[0] != R and s.inputs[1] != R:
            strategies.append(Strategy((R,) + s.inputs, (out,), None, "contracted dim split, beta 0"))
    return strategies


@register(aten.expand_as.default)
def expand_as_rule(op: OpInfo) -> list[Strategy]:
    x, other = op.tensors[0], op.tensors[1]
    dst = op.outputs[0].shape
    off = len(dst) - x.ndim
    strategies = [op.replicated(), op.strategy({x: Partial()}, Partial(), note="linear")]
    for d in range(len(dst)):
        if dst[d] <= 1:
            continue
        xd = d - off
        if xd >= 0 and x.shape[xd] == dst[d]:
            strategies.append(op.strategy({x: Shard(xd), other: Shard(d)}, Shard(d)))
        else:  # a broadcast dim comes out split: each rank expands to its part
            strategies.append(op.strategy({other: Shard(d)}, Shard(d), note="broadcast to a split"))
    return strategies


@register(aten.index_put.default, aten.index_put_.default)
def index_put_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    indices = list(op.args[1])
    values = op.arg(2, "values")
    strategies = [op.replicated()]
    if values not in op.tensors:  # a Python scalar
        return strategies
    if any(i is None for i in indices[: len([i for i in indices if i is not None])]):
        return strategies  # indexed dims not a leading run: kept whole
    # a boolean mask indexes as many dims as it has, an integer index one
    indexed = sum(i.ndim if i.dtype in (torch.bool, torch.uint8) else 1 for i in indices if i is not None)
    for d in range(indexed, x.ndim):
        vd = d - x.ndim + values.ndim
        if x.shape[d] <= 1:
            continue
        if vd >= 0 and values.shape[vd] == x.shape[d]:
            strategies.append(op.strategy({x: Shard(d), values: Shard(vd)}, Shard(d)))
        elif vd < 0 or values.shape[vd] == 1:
            strategies.append(op.strategy({x: Shard(d)}, Shard(d), note="values broadcast"))
    strategies.append(op.strategy({x: Partial(), values: Partial()}, Partial(), note="linear in (x, values)"))
    return strategies


@register(aten.repeat.default)
def repeat_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    reps = list(op.arg(1, "repeats"))
    off = len(reps) - x.ndim
    strategies = [op.replicated(), op.strategy({x: Partial()}, Partial(), note="linear")]
    for d in range(x.ndim):
        if reps[d + off] == 1 and x.shape[d] > 1:
            strategies.append(op.strategy({x: Shard(d)}, Shard(d + off)))
    return strategies


@register(aten.repeat_interleave.self_int)
def repeat_interleave_rule(op: OpInfo) -> list[Strategy]:
    """Every dim but the repeated one keeps its split (a flattened input: none)."""
    x = op.tensors[0]
    dim = op.arg(2, "dim")
    strategies = [op.replicated(), op.strategy({x: Partial()}, Partial(), note="linear")]
    if dim is None:
        return strategies
    dim %= x.ndim
    for d in range(x.ndim):
        if d != dim and x.shape[d] > 1:
            strategies.append(op.strategy({x: Shard(d)}, Shard(d)))
    return strategies


@register(aten.einsum.default)
def einsum_rule(op: OpInfo) -> list[Strategy]:
    """Any number of operands, explicit or implicit output (the labels seen once, sorted), no
    ellipsis: the contraction's dim labels (matmul.py; matrix.py beyond two operands)."""
    eq = op.args[0].replace(" ", "")
    ins, arrow, out = eq.partition("->")
    terms = ins.split(",")
    if "." in eq or len(terms) != len(op.tensors) or any(len(set(t)) != len(t) for t in terms):
        return [op.replicated()]  # a repeated label on one operand is a diagonal
    if not arrow:
        out = "".join(sorted(c for c in set(ins) if ins.count(c) == 1))
    if len(terms) == 2:
        return einsum_strategies(op, terms[0], terms[1], out)
    return labelled_strategies(op, list(zip(op.tensors, terms)), out)


register(aten.concat.default)(cat_rule)  # torch.concat: cat under another name (Phi-MoE)


@register(aten.view_as_complex.default, aten.view_as_real.default)
def complex_view_rule(op: OpInfo) -> list[Strategy]:
    """view_as_complex (..., 2) -> (...) and view_as_real back (Llama-4's rotary): every dim but
    the pair dim keeps its split. Linear: Partial stays Partial."""
    x, out = op.tensors[0], op.outputs[0]
    strategies = [op.replicated(), op.strategy({x: Partial()}, Partial(), note="linear")]
    for d in range(min(x.ndim, out.ndim)):  # the pair dim is the last of the real tensor: never here
        if x.shape[d] == out.shape[d] and x.shape[d] > 1:
            strategies.append(op.strategy({x: Shard(d)}, Shard(d)))
    return strategies


# torch's alternative names of the arithmetic ops (ConvBERT calls torch.multiply)
register(*aten_ops("multiply.Tensor", "multiply.Scalar", "divide.Tensor", "divide.Scalar"))(multiplicative_rule)
register(*aten_ops("subtract.Tensor", "subtract.Scalar"))(additive_rule)
