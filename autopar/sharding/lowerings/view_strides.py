"""A traced ``view`` runs as ``reshape`` on a rank, unless its memory is written in place.

torch.export drops a ``.contiguous()`` that is a no-op on the traced tensor, so torchtitan's
attention, ``sdpa(q, k, v).transpose(1, 2).contiguous().view(bs, s, -1)``, is traced as
``transpose`` then ``view``: serial SDPA returns its output laid out as (bs, s, heads, dim), and
the view of the transpose is legal there. On a rank the same value can come from another op
(a lowering, a collective, a piece cut out of a larger tensor) with other strides, and the
view fails ("view size is not compatible with input tensor's size and stride"). ``reshape``
is that view wherever the strides allow one and a copy elsewhere, so it gives the serial
values in both cases. A copy differs from a view only where the memory is written in place
later (through the view or through the tensor it views): such a view stays a view, as traced.

Example:
    >>> declare(aten.view.default, mode=lower_view)   # rules/views.py
    # emitted: view_3 = torch.reshape(transpose_3, [s0, s1 // 4, -1])
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.sharding.rules.registry import VIEW, op_traits

aten = torch.ops.aten


def lower_view(em, node: fx.Node, args: tuple, kwargs: dict) -> fx.Node | None:
    """``aten.view(x, sizes)`` -> ``aten.reshape(x, sizes)`` where no op writes its memory."""
    if _written_in_place(node):
        return None
    return em.graph.call_function(aten.reshape.default, args, kwargs)


def _written_in_place(node: fx.Node) -> bool:
    """Whether an in-place op of the traced graph writes a tensor sharing ``node``'s memory:
    the views reachable from the first non-view op above it (its base), and ops that alias
    their input in their schema, such as ``add_``."""
    base = node
    while _is_view(base) and base.args and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    seen, todo = set(), [base]
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        for user in x.users:
            if _writes(user, x):
                return True
            if _is_view(user):
                todo.append(user)
    return False


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and op_traits(node.target).work is VIEW


def _writes(user: fx.Node, x: fx.Node) -> bool:
    """``user`` writes argument ``x`` in place (its schema marks the argument written)."""
    schema = getattr(user.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return False
    for i, a in enumerate(schema.arguments):
        value = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
        if a.alias_info is not None and a.alias_info.is_write and _holds(value, x):
            return True
    return False


def _holds(value, x: fx.Node) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds(v, x) for v in value)
    return value is x
