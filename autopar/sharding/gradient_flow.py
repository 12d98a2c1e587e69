"""Where gradients need a reduction, decided from the placements (a backward pass over the graph).

On each mesh axis, the gradient of a replicated value arrives either *whole* on every rank
or as *parts* whose sum over the axis is the whole. It arrives in parts where the value
feeds computation whose result is split on that axis (each rank's result depends on the
value only through its own piece). Activations need whole gradients: such a use gets
Megatron's "f" (identity forward, all-reduce backward). Values computed from parameters
alone may keep their gradients in parts back to the parameters, whose gradients are then
summed once, in buckets, by the gradient sync: the data-parallel all-reduce is this case.

Example:
    >>> flow = analyse(graph, mesh)
    >>> flow.param_sync_axes["p_fc_weight"]        # the fc weight's gradient is summed over dp
    (0,)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.sharding.propagate import layout_of

WHOLE, PARTS = "whole", "parts"


@dataclass
class GradFlow:
    f_edges: dict[tuple[str, int], set[int]] = field(default_factory=dict)  # (consumer, input idx) -> axes
    param_sync_axes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # placeholder -> axes
    forms: dict[tuple[str, int], str] = field(default_factory=dict)  # (node, axis) -> whole|parts


def analyse(graph: fx.Graph, mesh, needs_grad: dict, param_derived: dict, param_nodes: set) -> GradFlow:
    flow = GradFlow()
    nodes = [n for n in graph.nodes if "autopar" in n.meta]
    for axis in range(mesh.ndim):
        for node in reversed(nodes):
            if not needs_grad.get(node) or not layout_of(node).outputs:
                continue
            if not all(spec[axis].is_replicate() for spec in layout_of(node).outputs):
                continue
            _decide(node, axis, flow, param_derived, param_nodes)
        _redistributed_edges(nodes, axis, flow, needs_grad)
    return flow


def _redistributed_edges(nodes, axis, flow, needs_grad) -> None:
    """A value gathered or reduced to R on an edge is a collective's output, whose backward
    wants a whole gradient: where split compute consumes it, it needs "f" too."""
    for user in nodes:
        lay = layout_of(user)
        if user.op != "call_function" or not lay.input_targets:
            continue
        if all(spec[axis].is_replicate() for spec in lay.outputs):
            continue
        for i, (inp, tgt) in enumerate(zip(lay.inputs, lay.input_targets)):
            src = layout_of(inp).spec[axis]
            if needs_grad.get(inp) and tgt[axis].is_replicate() and not src.is_replicate():
                flow.f_edges.setdefault((user.name, i), set()).add(axis)


def _uses(node: fx.Node):
    """(consumer, input index) for each tensor use of ``node``; getitem/output as pass-through."""
    for user in node.users:
        if user.op == "output":
            yield user, None
        elif user.target is operator.getitem:
            yield user, None
        elif "autopar" in user.meta and layout_of(user).input_targets:  # asserts carry no gradient
            lay = layout_of(user)
            for i, inp in enumerate(lay.inputs):
                if inp is node:
                    yield user, i


def _contribution(node, user, i, axis, flow) -> str:
    if user.op == "output":
        return WHOLE
    lay = layout_of(user)
    if i is None:  # getitem: the item's own form
        return flow.forms.get((user.name, axis), WHOLE)
    if lay.input_targets[i][axis] != layout_of(node).spec[axis]:
        return WHOLE  # a redistribution: its backward is written for whole gradients
    if any(not spec[axis].is_replicate() for spec in lay.outputs):
        return PARTS
    return flow.forms.get((user.name, axis), WHOLE)


def _eligible(node: fx.Node, axis: int, param_derived: dict) -> bool:
    """May this value's gradient stay in parts? Only if computed from parameters alone and
    without redistributing anything on this axis (a collective's backward wants whole)."""
    if not param_derived.get(node):
        return False
    if node.op == "placeholder":
        return True
    lay = layout_of(node)
    return all(t[axis] == layout_of(i).spec[axis] for i, t in zip(lay.inputs, lay.input_targets)) and not lay.fallback


def _decide(node, axis, flow, param_derived, param_nodes) -> None:
    contribs = [(u, i, _contribution(node, u, i, axis, flow)) for u, i in _uses(node)]
    parts = bool(contribs) and all(c == PARTS for _, _, c in contribs) and _eligible(node, axis, param_derived)
    flow.forms[(node.name, axis)] = PARTS if parts else WHOLE
    if parts:
        if node in param_nodes:
            flow.param_sync_axes[node.name] = tuple(sorted(set(flow.param_sync_axes.get(node.name, ())) | {axis}))
        return
    for user, i, c in contribs:
        if c == PARTS and i is not None:
            flow.f_edges.setdefault((user.name, i), set()).add(axis)
