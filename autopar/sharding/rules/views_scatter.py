"""Views that move or select along some dims, their scatters, and the ``*_copy`` forms of views.

Every op here works along a few dims and leaves the others alone: a split on an untouched dim
stays a split (``_moved``'s dim map), a split on a touched dim is gathered first.

- flip(x, dims), roll(x, shifts, dims), rot90(x, k, dims): the other dims;
- diagonal(x, offset, d1, d2): the other dims, in order, then the diagonal; diag_embed the reverse;
- unfold(x, dim, size, step) (``Tensor.unfold``): the other dims (the windows come last);
- slice_scatter / select_scatter / diagonal_scatter(x, src, ...): x and src split alike on a dim
  they share that the scatter does not index (src lacks a selected dim, and has a diagonal's
  dims as its last); linear in (x, src): both Partial stay Partial;
- ``*_copy`` (permute_copy, t_copy, unfold_copy, ...): the rule of the view they copy.

Example:
    >>> flip_rule(op)   # x (4, 6) flip([1]) -> [R], [S(0) -> S(0)], [P -> P] ...
"""

from __future__ import annotations

import torch

from autopar.errors import ShardingError
from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules.registry import OpInfo, Strategy, get_rule, register
from autopar.sharding.rules.views import _moved

aten = torch.ops.aten
R = Replicate()


def _dims(dims, ndim: int) -> set[int]:
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return {d % max(ndim, 1) for d in dims}


def _untouched(op: OpInfo, touched: set[int]) -> list[Strategy]:
    n = op.tensors[0].ndim
    return _moved(op, {d: d for d in range(n) if d not in touched})


@register(aten.flip.default)
def flip_rule(op: OpInfo) -> list[Strategy]:
    return _untouched(op, _dims(op.arg(1, "dims"), op.tensors[0].ndim))


@register(aten.roll.default)
def roll_rule(op: OpInfo) -> list[Strategy]:
    dims = op.arg(2, "dims", [])
    if not dims:  # rolls the flattened tensor: every dim moves
        return [op.replicated()] + _moved(op, {})[1:]
    return _untouched(op, _dims(dims, op.tensors[0].ndim))


@register(aten.rot90.default)
def rot90_rule(op: OpInfo) -> list[Strategy]:
    return _untouched(op, _dims(op.arg(2, "dims", [0, 1]), op.tensors[0].ndim))


@register(aten.diagonal.default)
def diagonal_rule(op: OpInfo) -> list[Strategy]:
    n = op.tensors[0].ndim
    d1, d2 = op.arg(2, "dim1", 0) % n, op.arg(3, "dim2", 1) % n
    kept = [d for d in range(n) if d not in (d1, d2)]
    return _moved(op, {d: i for i, d in enumerate(kept)})


@register(aten.diag_embed.default)
def diag_embed_rule(op: OpInfo) -> list[Strategy]:
    """x (..., k) -> (..., m, m) with the two new dims at dim1, dim2 of the output."""
    n = op.tensors[0].ndim
    d1, d2 = op.arg(2, "dim1", -2) % (n + 1), op.arg(3, "dim2", -1) % (n + 1)
    kept = [d for d in range(n + 1) if d not in (d1, d2)]
    return _moved(op, {i: d for i, d in enumerate(kept[: n - 1])})


@register(aten.unfold.default)
def unfold_rule(op: OpInfo) -> list[Strategy]:
    return _untouched(op, _dims(op.arg(1, "dimension"), op.tensors[0].ndim))


def _scatter(op: OpInfo, src_dim_of: dict[int, int]) -> list[Strategy]:
    """x and src split alike on each dim of x that ``src_dim_of`` maps to a dim of src."""
    x, src = op.tensors[0], op.tensors[1]
    strategies = [op.replicated()]
    for d, sd in src_dim_of.items():
        if x.shape[d] > 1 and src.shape[sd] == x.shape[d]:
            strategies.append(op.strategy({x: Shard(d), src: Shard(sd)}, Shard(d)))
    for kind in ("sum", "avg"):
        strategies.append(op.strategy({x: Partial(kind), src: Partial(kind)}, Partial(kind), note="linear"))
    return strategies


@register(aten.slice_scatter.default)
def slice_scatter_rule(op: OpInfo) -> list[Strategy]:
    n = op.tensors[0].ndim
    dim = op.arg(2, "dim", 0) % n
    return _scatter(op, {d: d for d in range(n) if d != dim})


@register(aten.select_scatter.default)
def select_scatter_rule(op: OpInfo) -> list[Strategy]:
    n = op.tensors[0].ndim
    dim = op.arg(2, "dim") % n
    return _scatter(op, {d: d - (d > dim) for d in range(n) if d != dim})


@register(aten.diagonal_scatter.default)
def diagonal_scatter_rule(op: OpInfo) -> list[Strategy]:
    n = op.tensors[0].ndim
    d1, d2 = op.arg(3, "dim1", 0) % n, op.arg(4, "dim2", 1) % n
    kept = [d for d in range(n) if d not in (d1, d2)]
    return _scatter(op, {d: i for i, d in enumerate(kept)})


def _register_copies() -> None:
    """``name_copy.overload`` gets the rule of ``name.overload`` (the view it copies)."""
    for packet_name in dir(aten):
        if not packet_name.endswith("_copy") or packet_name in ("copy", "_copy"):
            continue
        base = getattr(aten, packet_name[: -len("_copy")], None)
        packet = getattr(aten, packet_name, None)
        if base is None or not hasattr(packet, "overloads"):
            continue
        for name in packet.overloads():
            op = getattr(packet, name)
            view = getattr(base, name, None) if name in base.overloads() else None
            rule = get_rule(view) if view is not None else None
            if rule is not None and get_rule(op) is None and "out" not in name:
                register(op)(rule)


_register_copies()


@register(aten.msort.default)
def msort_rule(op: OpInfo) -> list[Strategy]:
    """Sorts along dim 0: every other dim keeps its split."""
    return _moved(op, {d: d for d in range(1, op.tensors[0].ndim)}, partial=False)


@register(aten.mT.default, aten.mH.default, aten.matrix_H.default, aten.adjoint.default)
def matrix_transpose_rule(op: OpInfo) -> list[Strategy]:
    """The last two dims swap (``mH``/``H``/``adjoint`` conjugate too: elementwise)."""
    n = op.tensors[0].ndim
    perm = {d: d for d in range(n - 2)} | ({n - 2: n - 1, n - 1: n - 2} if n >= 2 else {0: 0})
    return _moved(op, perm)


@register(aten.movedim.intlist, aten.movedim.int, aten.moveaxis.intlist, aten.moveaxis.int)
def movedim_rule(op: OpInfo) -> list[Strategy]:
    n = op.tensors[0].ndim
    src, dst = op.arg(1, "source"), op.arg(2, "destination")
    src = [s % n for s in ([src] if isinstance(src, int) else src)]
    dst = [d % n for d in ([dst] if isinstance(dst, int) else dst)]
    order = [None] * n
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(d for d in range(n) if d not in src)
    order = [o if o is not None else next(rest) for o in order]
    return _moved(op, {d_in: d_out for d_out, d_in in enumerate(order)})


@register(aten.fliplr.default, aten.flipud.default)
def flip_lr_ud_rule(op: OpInfo) -> list[Strategy]:
    return _untouched(op, {1 if op.op is aten.fliplr.default else 0})


@register(aten.tile.default)
def tile_rule(op: OpInfo) -> list[Strategy]:
    """tile(x, reps): reps padded with leading 1s to x's dims (x gets leading 1-dims where reps is
    longer); a dim tiled once keeps its split, one tiled r > 1 times stays whole."""
    x = op.tensors[0]
    reps = list(op.arg(1, "dims"))
    reps = [1] * (x.ndim - len(reps)) + reps
    off = len(reps) - x.ndim
    return _moved(op, {d: d + off for d in range(x.ndim) if reps[d + off] == 1})


@register(*[getattr(aten, f"{k}split").int for k in "hvd"], *[getattr(aten, f"{k}split").array for k in "hvd"])
def hvd_split_rule(op: OpInfo) -> list[Strategy]:
    """hsplit (dim 1, or 0 for 1-D), vsplit (dim 0), dsplit (dim 2): every other dim keeps its split."""
    n = op.tensors[0].ndim
    kind = op.op.overloadpacket.__name__[0]
    dim = {"h": 1 if n > 1 else 0, "v": 0, "d": 2}[kind]
    return _moved(op, {d: d for d in range(n) if d != dim}, len(op.outputs))


@register(aten.column_stack.default)
def column_stack_rule(op: OpInfo) -> list[Strategy]:
    """Columns side by side: dim 0 of every input (a 1-D input is one column) stays split."""
    k = len(op.tensors)
    strategies = [op.replicated()]
    if all(t.shape[0] == op.outputs[0].shape[0] for t in op.tensors):
        strategies.append(Strategy((Shard(0),) * k, (Shard(0),)))
    return strategies


@register(aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default)
def as_strided_rule(op: OpInfo) -> list[Strategy] | None:
    """A strided view addresses the input's storage, not its elements: no piece of it can be
    computed from a piece of the input. One that stays within the input's own elements runs
    replicated as an op without a rule does (None: gathered, with the warning); one that reads
    past them (a view of a larger storage) cannot be reproduced from the input's values at all."""
    x = op.tensors[0]
    at = 2 if op.op is aten.as_strided_scatter.default else 1  # the scatter takes src first
    size, stride = op.arg(at, "size"), op.arg(at + 1, "stride")
    offset = op.arg(at + 2, "storage_offset", 0) or 0
    last = offset + sum((s - 1) * st for s, st in zip(size, stride) if s > 0)
    numel = 1
    for s in x.shape:
        numel *= s
    if last >= numel:
        raise ShardingError(
            f"{op.op} reads element {last} of its input's storage, which holds {numel} elements: the input "
            "is a view of a larger tensor, and each rank gets the input's values, not that storage. "
            "Pass the whole tensor the view is taken of and take the view inside the model."
        )
    return None
