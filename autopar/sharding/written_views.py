"""A tensor written in place through a view must not be redistributed on the way to the write.

An ATen graph writes in place (``copy_``, ``mul_``, ``index_put_``) into a view of a tensor
(``buf[0].copy_(x)``, ``h.view(-1).mul_(2)``); serially the write lands in the tensor's memory and
every later read of the tensor sees it. On a rank, where the plan redistributes an edge of that
chain (the tensor gathered before a view that cannot keep its split, a view of a copy), the write
lands in the copy and the later reads of the tensor miss it: silently wrong numbers (ProphetNet's
``labels.new_zeros(ngram, B, S)`` on data parallel gave a NaN loss and zero gradients that way,
fixed for that op in rules/creation.py). Propagation already keeps an in-place op's own first
input where it can (propagate._solve); this guard covers the chain above it:

- ``lost_writes``: each in-place write whose chain (the written tensor, then each view up to the
  first non-view) crosses a redistributed edge, where the tensor is read again after the write;
- ``keep_written_layouts``: the plan propagated again with that tensor (the base of the views)
  pinned replicated on the axes where the edge moved (a module-output constraint: every reader
  then shares one copy, the written one, and each view of a replicated tensor stays replicated,
  whatever dims it merges or cuts), up to ``ROUNDS`` times; a write still lost is a PlanError
  naming the node.

Example:
    >>> ctx = keep_written_layouts(traced, mesh, seeds, strict=False, ctx=propagate(traced, mesh, seeds))
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.errors import PlanError
from autopar.placement import Replicate, fmt_spec
from autopar.sharding.lowerings.view_strides import _is_view
from autopar.sharding.propagate import _mutates_first, propagate
from autopar.trace.module_paths import module_path

ROUNDS = 3  # each round pins one more tensor of a chain; more than 3 writes fixed one by one is not expected


def lost_writes(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node, dict]]:
    """(the in-place write, the tensor it writes (the base of its views), {axis: placement} the
    redistributed edge wanted) for each write a later read of the tensor would miss."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or not _mutates_first(node) or not node.args:
            continue
        consumer, x, chain = node, node.args[0], [node]
        while isinstance(x, fx.Node):
            moved = _moved(consumer, x)
            if moved:
                base = _base(x)
                if _read_after(base, node, chain, order):
                    out.append((node, base, moved))
                break
            if not _is_view(x):
                break
            chain.append(x)
            consumer, x = x, x.args[0] if x.args else None
    return out


def _moved(consumer: fx.Node, x: fx.Node) -> dict:
    """{axis: placement wanted} where ``consumer`` reads ``x`` in another layout than x's own."""
    lay, have = consumer.meta.get("autopar"), x.meta.get("autopar")
    if lay is None or have is None or not have.outputs or x not in lay.inputs:
        return {}
    at = lay.inputs.index(x)
    if at >= len(lay.input_targets):  # an op whose rule set no target for this input (expert blocks' own)
        return {}
    want, spec = lay.input_targets[at], have.outputs[0]
    return {a: w for a, (w, h) in enumerate(zip(want, spec)) if w != h}


def _base(x: fx.Node) -> fx.Node:
    """The first non-view above ``x``: the tensor whose memory its views share."""
    while _is_view(x) and x.args and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return x


def _read_after(x: fx.Node, write: fx.Node, chain: list, order: dict) -> bool:
    """Whether ``x`` (or a view of it, outside the write's own chain) is read after ``write``."""
    seen, todo = set(), [x]
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        for u in t.users:
            if u in chain:
                continue
            if _is_view(u):
                todo.append(u)
            elif order.get(u, -1) > order[write] and isinstance(u.meta.get("val"), torch.Tensor | None):
                return True  # a read of its values (a size read, a SymInt, sees no write)
    return False


def keep_written_layouts(traced, mesh, seeds, strict: bool, ctx, rounds: int = ROUNDS):
    """``ctx`` (propagate's), or that of the graph propagated again with each written tensor's
    layout pinned (see the module's text); PlanError where a write is still lost after ``rounds``."""
    pinned: dict = {}
    for _ in range(rounds):
        lost = lost_writes(traced.gm.graph)
        if not lost:
            return ctx
        for _, base, wanted in lost:  # replicated there: every view of it keeps R, no edge moves
            pinned.setdefault(base, {}).update({a: Replicate() for a in wanted})
        ctx = propagate(traced, mesh, seeds, strict, pinned=pinned)
    lost = lost_writes(traced.gm.graph)
    if lost:
        write, x, wanted = lost[0]
        spec = x.meta["autopar"].outputs[0]
        where = module_path(write) or "the model's forward"
        raise PlanError(
            f"{write.target} (node {write.name}, in {where}) writes in place into a view of {x.name}, which "
            f"the plan holds as {fmt_spec(spec)}, and the view reads it redistributed (on mesh axes "
            f"{sorted(mesh.axis_names[a] for a in wanted)}): the write would land in a copy and later reads of "
            f"{x.name} would miss it. Write out of place in the model's code (e.g. `h = torch.cat([h[:, :3] * 2, "
            "h[:, 3:]], 1)` for `h[:, :3].mul_(2)`), or annotate that tensor's module so it keeps one layout."
        )
    return ctx
