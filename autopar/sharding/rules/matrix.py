"""Matrix ops beyond matmul.py: products with a bias (addmm, addmv, addbmm, addr), mv, dot and
vdot, and the three-operand ``_trilinear`` (bilinear layers), all as dim labels.

Each label of the contraction gives one strategy: a label the output keeps is split wherever an
operand carries it; a contracted label split on every operand that carries it leaves the output
a partial sum. ``bias`` (the ``self`` of the add* ops: ``beta * bias + alpha * product``) carries
the output's labels where its size is not 1 and follows the output's split; a partial product is
offered only where ``beta`` is 0, since each rank would otherwise add the bias once.

Example:
    >>> addmm_rule(op)   # bias (6,), m1 (4, 8), m2 (8, 6) -> ..., [S(0), R, S(1)] -> [S(1)], ...
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import MATMUL, OpInfo, Strategy, TensorMeta, Work, aten_ops, register

aten = torch.ops.aten
R = Replicate()


def labelled_strategies(op: OpInfo, operands: list[tuple[TensorMeta, str]], out: str) -> list[Strategy]:
    """One strategy per label of ``operands -> out`` (any number of operands; a label on an operand
    of size 1 there is a broadcast and stays replicated). Tensors of ``op`` not among the operands
    stay replicated."""
    strategies = [op.replicated()]
    for label in dict.fromkeys("".join(labels for _, labels in operands)):
        placed = {
            m: Shard(labels.index(label))
            for m, labels in operands
            if label in labels and m.shape[labels.index(label)] != 1
        }
        if not placed:
            continue
        carriers = [m for m, labels in operands if label in labels]
        if label in out:
            strategies.append(op.strategy(placed, Shard(out.index(label))))
        elif len(placed) == len(carriers):
            strategies.append(op.strategy(placed, Partial(), note="contracted dim split"))
    return strategies


def with_bias(op: OpInfo, product: list[Strategy], out: str) -> list[Strategy]:
    """``beta * bias + alpha * product``: the bias (tensor 0, broadcast to the output) split like the
    output where it carries that dim; partial products only with ``beta`` 0."""
    bias = op.tensors[0]
    beta = op.kwargs.get("beta", 1)
    off = len(out) - bias.ndim
    strategies = [op.replicated()]
    for s in product[1:]:
        p = s.outputs[0]
        if isinstance(p, Shard):
            bd = p.dim - off
            carries = bd >= 0 and bias.shape[bd] > 1
            strategies.append(Strategy((Shard(bd) if carries else R,) + s.inputs[1:], s.outputs, None, s.note))
        elif beta == 0:
            strategies.append(Strategy((R,) + s.inputs[1:], s.outputs, None, s.note + ", beta 0"))
    return strategies


def _product(op: OpInfo, labels: tuple[str, ...], out: str) -> list[Strategy]:
    """The product's strategies over the tensors after the bias (the bias replicated in them)."""
    operands = list(zip(op.tensors[1:], labels))
    return labelled_strategies(op, operands, out)


@register(aten.addmm.default)
def addmm_rule(op: OpInfo) -> list[Strategy]:
    return with_bias(op, _product(op, ("mk", "kn"), "mn"), "mn")


@register(aten.addmv.default, work=Work("matmul", lhs_arg=1))
def addmv_rule(op: OpInfo) -> list[Strategy]:
    return with_bias(op, _product(op, ("nk", "k"), "n"), "n")


@register(aten.addbmm.default)
def addbmm_rule(op: OpInfo) -> list[Strategy]:
    """bias (n, p) + sum over b of b1 (b, n, m) @ b2 (b, m, p): b and m are contracted."""
    return with_bias(op, _product(op, ("bnm", "bmp"), "np"), "np")


@register(aten.addr.default)
def addr_rule(op: OpInfo) -> list[Strategy]:
    """bias (n, m) + outer(v1 (n), v2 (m)): nothing contracted."""
    return with_bias(op, _product(op, ("n", "m"), "nm"), "nm")


@register(aten.mv.default, work=MATMUL)
def mv_rule(op: OpInfo) -> list[Strategy]:
    a, v = op.tensors
    return labelled_strategies(op, [(a, "nk"), (v, "k")], "n") + _partial_operands(op)


@register(*aten_ops("dot", "vdot"), work=MATMUL)
def dot_rule(op: OpInfo) -> list[Strategy]:
    a, b = op.tensors
    return labelled_strategies(op, [(a, "k"), (b, "k")], "") + _partial_operands(op)


def _partial_operands(op: OpInfo) -> list[Strategy]:
    """A product is linear in each operand: one partial operand (the other replicated) stays partial."""
    out = []
    for i in range(len(op.tensors)):
        for kind in ("sum", "avg"):
            ins = [R] * len(op.tensors)
            ins[i] = Partial(kind)
            out.append(Strategy(tuple(ins), (Partial(kind),), None, "linear in a partial operand"))
    return out


@register(aten._trilinear.default)
def trilinear_rule(op: OpInfo) -> list[Strategy]:
    """``_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim)`` (nn.Bilinear): each input is
    the full index space less its ``expand`` dims; the output is the space less ``sumdim``."""
    i1, i2, i3 = op.tensors[:3]
    expands = [list(op.args[3]), list(op.args[4]), list(op.args[5])]
    sumdim = set(op.args[6])
    space = "abcdefghij"[: i1.ndim + len(expands[0])]
    operands = [(m, "".join(c for d, c in enumerate(space) if d not in e)) for m, e in zip((i1, i2, i3), expands)]
    out = "".join(c for d, c in enumerate(space) if d not in sumdim)
    return labelled_strategies(op, operands, out)


@register(aten.bilinear.default)
def bilinear_rule(op: OpInfo) -> list[Strategy]:
    """``bilinear(x1 (..., i), x2 (..., j), w (o, i, j), bias (o)?)``: batch dims and ``o`` split
    (the bias with ``o``); ``i`` or ``j`` split makes a partial sum, only without a bias."""
    x1, x2, w = op.tensors[:3]
    bias = op.tensors[3] if len(op.tensors) > 3 else None
    batch = "abcdefgh"[: x1.ndim - 1]
    strategies = []
    for s in labelled_strategies(op, [(x1, batch + "i"), (x2, batch + "j"), (w, "oij")], batch + "o"):
        p = s.outputs[0]
        if bias is None or not p.is_partial():
            split_o = isinstance(p, Shard) and p.dim == len(batch)
            ins = s.inputs[:3] + ((Shard(0) if split_o else R,) if bias is not None else ())
            strategies.append(Strategy(ins, s.outputs, None, s.note))
    return strategies


@register(aten.tensordot.default)
def tensordot_rule(op: OpInfo) -> list[Strategy]:
    """tensordot(a, b, dims_a, dims_b): a's free dims, then b's; the paired dims contracted."""
    a, b = op.tensors[:2]
    dims_a = [d % a.ndim for d in op.arg(2, "dims_self")]
    dims_b = [d % b.ndim for d in op.arg(3, "dims_other")]
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    la = [next(letters) for _ in range(a.ndim)]
    lb = [next(letters) for _ in range(b.ndim)]
    for da, db in zip(dims_a, dims_b):
        lb[db] = la[da]
    out = [c for d, c in enumerate(la) if d not in dims_a] + [c for d, c in enumerate(lb) if d not in dims_b]
    return labelled_strategies(op, [(a, "".join(la)), (b, "".join(lb))], "".join(out))


@register(aten.cdist.default, aten._cdist_forward.default)
def cdist_rule(op: OpInfo) -> list[Strategy]:
    """cdist(x1 (..., P, M), x2 (..., R, M)) -> (..., P, R): batch dims split on both, P on x1,
    R on x2; the feature dim M is inside a norm (nonlinear): never split."""
    x1, x2 = op.tensors[:2]
    n = x1.ndim
    strategies = [op.replicated()]
    for d in range(n - 2):
        if x1.shape[d] > 1 and x1.shape[d] == x2.shape[d]:
            strategies.append(op.strategy({x1: Shard(d), x2: Shard(d)}, Shard(d)))
    if x1.shape[n - 2] > 1:
        strategies.append(op.strategy({x1: Shard(n - 2)}, Shard(n - 2)))
    if x2.shape[n - 2] > 1:
        strategies.append(op.strategy({x2: Shard(n - 2)}, Shard(n - 1)))
    return strategies


@register(aten.linalg_multi_dot.default)
def multi_dot_rule(op: OpInfo) -> list[Strategy]:
    """A chain of matrix products: the first matrix's rows and the last one's columns split (a 1-D
    end of the chain is a vector: nothing of it in the output)."""
    first, last = op.tensors[0], op.tensors[-1]
    strategies = [op.replicated()]
    if first.ndim == 2 and first.shape[0] > 1:
        strategies.append(op.strategy({first: Shard(0)}, Shard(0)))
    if last.ndim == 2 and last.shape[1] > 1 and len(op.tensors) > 1:
        strategies.append(op.strategy({last: Shard(1)}, Shard(op.outputs[0].ndim - 1)))
    return strategies


@register(aten.linalg_vander.default)
def vander_rule(op: OpInfo) -> list[Strategy]:
    """x (..., n) -> (..., n, N): every dim of x keeps its split (the powers come last)."""
    x = op.tensors[0]
    return [op.replicated()] + [op.strategy({x: Shard(d)}, Shard(d)) for d in range(x.ndim) if x.shape[d] > 1]
