"""A stage's backward in two parts: input gradients now (B), weight gradients later (W).

Zero-bubble schedules send a stage's input gradients upstream as soon as they exist and compute
the weights' gradients later, in what would be idle time. The split is done on the autograd graph
the stage's forward recorded, not by emitting two fx programs: the stage module is an ordinary
GraphModule run eagerly, so its forward already holds every saved tensor both parts need, and
autograd already knows which outputs of each backward node lead where. Emitting B and W as fx
programs would mean a joint forward-backward trace of every stage (AOT autograd), partitioned,
with its own saved-tensor plumbing and every technique's backward hooks (grad sync, ZeRO)
written again; this way B and W run the very nodes the plain backward runs, so they sum to it.

B: ``torch.autograd.grad`` w.r.t. the stage's received tensors only, keeping the graph. Autograd
runs only the nodes on a path to those inputs, and each computes only the gradients that lead
there (a matmul's backward computes its input's gradient, not its weight's). A pre-hook on each
"frontier" node (one on that path with an edge off it, towards parameters) keeps the gradient it
received. W: ``torch.autograd.backward`` from those frontier nodes with the kept gradients
(``GradientEdge``), w.r.t. the parameters only: each frontier node now computes the gradients
towards the weights. Parameters accumulate into ``.grad`` through autograd's own AccumulateGrad,
so post-accumulate hooks (data-parallel buckets) fire as in a plain backward. Roots off the path
to the inputs (a stage output made from parameters and user inputs alone; on the first stage,
every output) are left wholly to W, from their seed gradients.

A frontier node reachable from another frontier node (a weight read twice on the path) would get
its gradient twice in W: a pre-hook in W replaces what it receives with what it kept in B (as
torch.distributed.pipelining does; each group of frontier nodes sharing parameters is one call).

Example:
    >>> wgrad, input_grads = backward_input(outputs, grads, received)
    >>> send(input_grads)                       # upstream, now
    >>> backward_weight(wgrad)                  # later: params' .grad accumulate
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class WeightGrad:
    """What W needs from B: per group, frontier nodes (with the gradients they received in B) and
    the parameters they lead to; ``roots``: (output tensor, seed gradient) off the inputs' path."""

    groups: list = field(default_factory=list)  # [{"nodes": [...], "grads": [...], "params": [...]}]
    roots: list = field(default_factory=list)
    params: list = field(default_factory=list)  # every leaf needing a gradient (the roots' W)


def backward_input(outputs: list, grads: list, inputs: list) -> tuple[WeightGrad, list]:
    """Input gradients of ``inputs`` (received tensors, requires_grad leaves; None where unused) from
    ``outputs`` seeded with ``grads``; and what ``backward_weight`` needs for the gradients of every
    other leaf the outputs reach (the parameters; a user input that asks for its gradient too)."""
    out_nodes = [_node(t) for t in outputs]
    in_nodes = {_node(t) for t in inputs}
    users = _users(out_nodes)
    on_path = _reaching(in_nodes, users)  # nodes from which an input is reached: B runs these
    # leaves in the order the walk found them: every rank of a stage calls W's groups alike
    param_nodes = {n: n.variable for n in [*dict.fromkeys(out_nodes), *users] if _is_leaf(n) and n not in in_nodes}
    groups = _groups(on_path, param_nodes, users)
    wg = WeightGrad(
        groups=groups,
        roots=[(t, g) for t, n, g in zip(outputs, out_nodes, grads) if n not in on_path],
        params=list(param_nodes.values()),
    )
    handles = []
    for group in groups:
        group["grads"] = [None] * len(group["nodes"])
        for i, node in enumerate(group["nodes"]):
            handles.append(node.register_prehook(_keeper(group["grads"], i)))
    try:
        tensors = [(t, g) for t, n, g in zip(outputs, out_nodes, grads) if n in on_path]
        if tensors and inputs:
            got = torch.autograd.grad(
                [t for t, _ in tensors], inputs, [g for _, g in tensors], retain_graph=True, allow_unused=True
            )
        else:
            got = [None] * len(inputs)
    finally:
        for h in handles:
            h.remove()
    return wg, list(got)


def backward_weight(wg: WeightGrad) -> None:
    """The parameters' gradients, accumulated into ``.grad``; frees the stage's graph."""
    for group in wg.groups:
        edges, grads = [], []
        for node, kept in zip(group["nodes"], group["grads"]):
            for i, g in enumerate(kept or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        handles = []
        if len(group["nodes"]) > 1:  # a frontier node below another: what it kept, not twice
            handles = [n.register_prehook(lambda _, k=k: k) for n, k in zip(group["nodes"], group["grads"]) if k]
        try:
            # the graph kept: a frontier node below another (a weight read twice) runs in more than
            # one call's walk (the clamp above keeps its sum right); freed with ``wg`` after W
            torch.autograd.backward(edges, grads, inputs=group["params"], retain_graph=True)
        finally:
            for h in handles:
                h.remove()
    if wg.roots:
        if wg.params:
            torch.autograd.backward([t for t, _ in wg.roots], [g for _, g in wg.roots], inputs=wg.params)
    wg.groups, wg.roots, wg.params = [], [], []


def _is_leaf(node) -> bool:
    """An AccumulateGrad node: where a leaf tensor's gradient is accumulated into ``.grad``."""
    return hasattr(node, "variable")


def _node(t: torch.Tensor):
    return get_gradient_edge(t).node


def _keeper(store: list, i: int):
    def hook(grad_outputs):
        store[i] = grad_outputs

    return hook


def _users(roots: list) -> dict:
    """Node -> the nodes whose backward feeds it (the reverse of next_functions), from ``roots``."""
    users: dict = collections.defaultdict(list)
    seen, todo = set(roots), list(roots)
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            users[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return users


def _reaching(targets: set, users: dict, stop: set = frozenset()) -> set:
    """``targets`` and every node from which one of them is reached (walking users upwards)."""
    found, todo = set(targets), list(targets)
    while todo:
        for u in users.get(todo.pop(), ()):
            if u not in found and u not in stop:
                found.add(u)
                todo.append(u)
    return found


def _groups(on_path: set, param_nodes: dict, users: dict) -> list:
    """Parameters grouped by the frontier nodes (on the inputs' path) their gradients come through:
    [{"nodes": [frontier node, ...], "params": [parameter, ...]}], groups sharing a node merged."""
    by_node: dict = {}  # frontier node -> its group
    groups: dict = {}  # id(group) -> group, the ones alive
    for pnode, p in param_nodes.items():
        frontier, todo, seen = [], [pnode], {pnode}
        while todo:
            for u in users.get(todo.pop(), ()):
                if u in on_path:
                    if u not in frontier:
                        frontier.append(u)
                elif u not in seen:
                    seen.add(u)
                    todo.append(u)
        group = {"nodes": [], "params": [p]}
        for node in frontier:
            other = by_node.get(node)
            if other is not None and other is not group:  # merge: one W call for both
                groups.pop(id(other))
                group["params"] += other["params"]
                group["nodes"] += [n for n in other["nodes"] if n not in group["nodes"]]
                for n in other["nodes"]:
                    by_node[n] = group
            if node not in group["nodes"]:
                group["nodes"].append(node)
            by_node[node] = group
        groups[id(group)] = group  # without frontier: reached from roots off the path only, or not at all
    return list(groups.values())
