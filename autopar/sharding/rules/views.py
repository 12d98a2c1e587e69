"""Views and layout ops: view/reshape, permute, transpose, (un)squeeze, expand, slice,
select, unbind, split, cat, stack.

A shard moves with its dim. For view/reshape the input and output dims are matched in
groups of equal product (``[B, T, C] -> [B, T, H, D]`` pairs C with (H, D)); a shard on the
first dim of an input group becomes a shard on the first dim of the output group when that
size divides, which is how attention heads end up split across tensor-parallel ranks.
view/reshape/expand declare their shape argument (``shape_arg``: emission rewrites the global
shape to local sizes); every op that only reinterprets its input declares ``work=VIEW``.
"""

from __future__ import annotations

import torch

from autopar.sharding.lowerings.split_blocked import SPLIT_BLOCKED
from autopar.sharding.lowerings.view_strides import lower_view
from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import VIEW, OpInfo, Strategy, aten_ops, declare, functional_overloads, register

aten = torch.ops.aten
R = Replicate()

# ops that reinterpret their input: no FLOPs, no memory of their own (the cost model reads this)
declare(
    *functional_overloads(
        *("view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze"),
        *("alias", "slice", "select", "unbind", "split", "split_with_sizes", "chunk", "detach"),
        *("as_strided", "lift_fresh_copy", "sym_size"),
    ),
    work=VIEW,
)
# the copying views hold a global shape too (emission rewrites it to local sizes)
declare(*functional_overloads("view_copy", "expand_copy"), shape_arg=1)
# a rank's tensor may have other strides than the traced one (an export-dropped .contiguous()):
# a view runs as reshape where nothing writes its memory (sharding/lowerings/view_strides.py)
declare(aten.view.default, mode=lower_view)


def _partials(n_inputs: int, n_outputs: int) -> list[Strategy]:
    return [Strategy((Partial(k),) * n_inputs, (Partial(k),) * n_outputs, None, "linear") for k in ("sum", "avg")]


def _moved(op: OpInfo, dim_map: dict[int, int], n_outputs: int = 1, partial=True) -> list[Strategy]:
    """Strategies for a one-input op whose input dim d becomes output dim dim_map[d]."""
    strategies = [op.replicated()]
    for d_in, d_out in dim_map.items():
        if op.tensors[0].shape[d_in] != 1:
            strategies.append(Strategy((Shard(d_in),), (Shard(d_out),) * n_outputs))
    if partial:
        strategies += _partials(1, n_outputs)
    return strategies


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims of equal product."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj, pa, pb = [], [], 1, 1
        if i < len(src):
            gi.append(i)
            pa *= src[i]
            i += 1
        if j < len(dst):
            gj.append(j)
            pb *= dst[j]
            j += 1
        while pa != pb:
            if (pa < pb and i < len(src)) or j >= len(dst):
                if i >= len(src):
                    break
                gi.append(i)
                pa *= src[i]
                i += 1
            else:
                gj.append(j)
                pb *= dst[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _first_big(dims: list[int], shape) -> int | None:
    for d in dims:
        if shape[d] != 1:
            return d
    return None


def view_dim_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """Input dim -> output dim for every input dim whose shard survives the view."""
    out = {}
    for gi, gj in view_groups(src, dst):
        a, b = _first_big(gi, src), _first_big(gj, dst)
        if a is not None and b is not None:
            out[a] = b
    return out


@register(*aten_ops("view", "reshape", "_unsafe_view"), shape_arg=1)  # not view.dtype: a bit cast
def view_rule(op: OpInfo) -> list[Strategy]:
    src, dst = op.tensors[0].shape, op.outputs[0].shape
    strategies = [op.replicated()] + _partials(1, 1)
    for gi, gj in view_groups(src, dst):
        a, b = _first_big(gi, src), _first_big(gj, dst)
        if a is None or b is None:
            continue
        # the shard of input dim a is a contiguous block of the group: it must start an
        # output dim whose size takes the split; the propagator checks divisibility.
        strategies.append(Strategy((Shard(a),), (Shard(b),)))
    return strategies + _blocked_view(src, dst)


def _blocked_view(src, dst) -> list[Strategy]:
    """A dim of k blocks viewed as (k, rest...): S(d, blocks=k) is a plain shard of ``rest``.

    (B, T, 3C) -> (B, T, 3, H, D): GPT-2's fused q|k|v split by heads. And the reverse.
    """
    out = []
    for gi, gj in view_groups(src, dst):
        for one, many, fwd in ((gi, gj, True), (gj, gi, False)):
            shape = dst if fwd else src
            if len(one) != 1 or len(many) < 2 or shape[many[0]] < 2:
                continue
            rest = _first_big(many[1:], shape)
            if rest is None:
                continue
            blocked, plain = Shard(one[0], blocks=shape[many[0]]), Shard(rest)
            out.append(Strategy((blocked,), (plain,)) if fwd else Strategy((plain,), (blocked,)))
    return out


@register(aten.permute.default)
def permute_rule(op: OpInfo) -> list[Strategy]:
    dims = [d % op.tensors[0].ndim for d in op.args[1]]
    return _moved(op, {d_in: d_out for d_out, d_in in enumerate(dims)})


@register(aten.transpose.int)
def transpose_rule(op: OpInfo) -> list[Strategy]:
    n = op.tensors[0].ndim
    d0, d1 = op.args[1] % n, op.args[2] % n
    perm = list(range(n))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _moved(op, {d_in: d_out for d_out, d_in in enumerate(perm)})


@register(aten.t.default)
def t_rule(op: OpInfo) -> list[Strategy]:
    n = op.tensors[0].ndim
    return _moved(op, {0: n - 1, n - 1: 0} if n == 2 else {0: 0})


@register(aten.unsqueeze.default)
def unsqueeze_rule(op: OpInfo) -> list[Strategy]:
    n = op.tensors[0].ndim
    at = op.args[1] % (n + 1)
    return _moved(op, {d: d + (d >= at) for d in range(n)})


@register(*aten_ops("squeeze", "squeeze.dim", "squeeze.dims"))
def squeeze_rule(op: OpInfo) -> list[Strategy]:
    src, dst = op.tensors[0].shape, op.outputs[0].shape
    return _moved(op, view_dim_map(src, dst))


@register(aten.expand.default, shape_arg=1)
def expand_rule(op: OpInfo) -> list[Strategy]:
    src, dst = op.tensors[0].shape, op.outputs[0].shape
    off = len(dst) - len(src)
    strategies = _moved(op, {d: d + off for d in range(len(src)) if src[d] == dst[d + off]}, partial=False)
    for d in range(len(dst)):  # a broadcast dim comes out split: each rank expands to its part
        if (d < off or src[d - off] == 1) and dst[d] > 1:
            strategies.append(Strategy((R,), (Shard(d),), None, "broadcast to a split"))
    return strategies


@register(aten.slice.Tensor)
def slice_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    dim = op.arg(1, "dim", 0) % x.ndim
    keep = {d: d for d in range(x.ndim) if d != dim}
    if x.shape[dim] == op.outputs[0].shape[dim]:
        keep[dim] = dim  # a slice that keeps the whole dim
    return _moved(op, keep)


@register(aten.select.int)
def select_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    dim = op.args[1] % x.ndim
    return _moved(op, {d: d - (d > dim) for d in range(x.ndim) if d != dim})


@register(aten.unbind.int)
def unbind_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    dim = op.arg(1, "dim", 0) % x.ndim
    return _moved(op, {d: d - (d > dim) for d in range(x.ndim) if d != dim}, len(op.outputs))


@register(*aten_ops("split.Tensor", "split.sizes", "split", "split_with_sizes", "chunk"))
def split_rule(op: OpInfo) -> list[Strategy]:
    x = op.tensors[0]
    dim = op.arg(2, "dim", 0) % x.ndim
    strategies = _moved(op, {d: d for d in range(x.ndim) if d != dim}, len(op.outputs))
    k = len(op.outputs)
    if k > 1 and all(o.shape[dim] * k == x.shape[dim] for o in op.outputs):
        # into its k equal blocks: a blocked shard becomes a plain shard of every piece
        lowering = None if op.op.overloadpacket is aten.chunk else SPLIT_BLOCKED
        strategies.append(Strategy((Shard(dim, blocks=k),), (Shard(dim),) * k, lowering, "blocks split"))
    return strategies


@register(aten.cat.default)
def cat_rule(op: OpInfo) -> list[Strategy]:
    n = op.outputs[0].ndim
    dim = op.arg(1, "dim", 0) % n
    k = len(op.tensors)
    strategies = [op.replicated()] + _partials(k, 1)
    for d in range(n):
        if d != dim and all(t.ndim == n for t in op.tensors):
            strategies.append(Strategy((Shard(d),) * k, (Shard(d),)))
    return strategies


@register(aten.stack.default)
def stack_rule(op: OpInfo) -> list[Strategy]:
    n = op.tensors[0].ndim
    dim = op.arg(1, "dim", 0) % (n + 1)
    k = len(op.tensors)
    strategies = [op.replicated()] + _partials(k, 1)
    for d in range(n):
        strategies.append(Strategy((Shard(d),) * k, (Shard(d + (d >= dim)),)))
    return strategies
