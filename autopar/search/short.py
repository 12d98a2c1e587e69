"""The probes' graph for a repeated stack: the traced graph with blocks 2..n-1 left out.

trace() exports a list of n identical blocks two deep and copies block 1 for the rest
(trace/repeat_blocks.py), so blocks 1..n-1 are op for op the same, read the same layouts and get the same
strategies (propagation's choice cache relies on the same fact). A probe therefore plans
the graph with blocks 0 and 1 only - the tail reading what block n-1 gave now reads block 1 -
and counts each of block 1's ops and parameters n-1 times (``weights``). Edges are charged to
their consumer, so block 0 -> 1 edges count n-1 times and the edge out of the last block
once: the same totals as the full graph. The cost of a probe no longer grows with depth.

Example:
    >>> short, node_w, param_w = shortened(traced)     # None when the model has no copied stack
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from autopar.trace.repeat_blocks import _block_index


def shortened(traced):
    """(Traced with two blocks, node name -> weight, parameter name -> weight) or None."""
    found = getattr(traced, "repeated", None)
    if found is None or found.count <= 2:
        return None
    prefix, n = found.prefix, found.count
    graph = traced.gm.graph
    where, b1 = {}, []
    for node in graph.nodes:
        k = _block_index(node, prefix) if node.op not in ("placeholder", "output") else None
        if k is not None:
            where[node] = k
            if k == 1:
                b1.append(node)
    count = sum(1 for k in where.values() if k == n - 1)
    if count != len(b1):
        return None
    last = [node for node, k in where.items() if k == n - 1]
    to_b1 = dict(zip(last, b1))
    dropped = {
        name
        for table in (traced.param_fqn, traced.buffer_fqn, traced.constant_fqn)
        for name, fqn in table.items()
        if _index(fqn, prefix) not in (None, 0, 1)
    }
    new, env = fx.Graph(), {}

    def arg(a):
        return env[a] if a in env else env[to_b1[a]]

    for node in graph.nodes:
        if node.name in dropped or where.get(node, 0) >= 2:
            continue
        env[node] = _same_name(new.node_copy(node, arg), node)
    keep = lambda table: {k: v for k, v in table.items() if k not in dropped}  # noqa: E731
    short = dataclasses.replace(
        traced,
        gm=fx.GraphModule(traced.gm, new),
        param_fqn=keep(traced.param_fqn),
        buffer_fqn=keep(traced.buffer_fqn),
        constant_fqn=keep(traced.constant_fqn),
        # kept: checkpointing's probes find their blocks (0 and 1 here) from it; without it each
        # probe variant looked for the repeated stack in the whole model again (0.3 s on 405B)
        repeated=found,
    )
    node_w = {node.name: float(n - 1) for node in b1}
    param_w = {}
    for fqn in traced.param_fqn.values():
        k = _index(fqn, prefix)
        if k is not None and k >= 1:
            param_w[fqn] = float(n - 1) if k == 1 else 0.0
    return short, node_w, param_w


def reweighed(short, weights: tuple) -> tuple:
    """``weights`` (node, parameter) for ``short`` after a technique rewrote its graph
    (Technique.prepare_graph: context parallel fuses eager attention into new SDPA nodes): the
    new nodes of block 1 stand for blocks 1..n-1 as the old ones did."""
    node_w, param_w = weights
    found = getattr(short, "repeated", None)
    if not node_w or found is None:
        return weights
    new = {
        node.name: float(found.count - 1)
        for node in short.gm.graph.nodes
        if node.op not in ("placeholder", "output")
        and node.name not in node_w
        and _block_index(node, found.prefix) == 1
    }
    return {**node_w, **new}, param_w


def _index(fqn: str, prefix: str) -> int | None:
    if not fqn.startswith(prefix + "."):
        return None
    head = fqn[len(prefix) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def copied(traced):
    """A copy of ``traced`` with its own graph (same node names): probes insert and erase
    boundary nodes, which would leave the final plan's graph with other names than a fresh
    trace gives (and load_plan compares names)."""
    new, env = fx.Graph(), {}
    for node in traced.gm.graph.nodes:
        env[node] = _same_name(new.node_copy(node, lambda a: env[a]), node)
    return dataclasses.replace(traced, gm=fx.GraphModule(traced.gm, new))


def _same_name(copy: fx.Node, node: fx.Node) -> fx.Node:
    """The copy under the original's name: fx renames a copy whose name is a Python builtin
    (nn.Sequential's ``input`` became ``input_1``), and then the traced inputs' names no longer
    match, so the probes split no batch and the search costed data parallel as replicated."""
    copy.name = node.name
    return copy
