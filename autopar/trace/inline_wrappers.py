"""Inline the higher-order wrappers torch.export leaves around grad-mode and autocast regions.

HuggingFace models compute rotary tables under ``@torch.no_grad()`` and
``torch.autocast(enabled=False)``; export keeps those regions as
``wrap_with_set_grad_enabled(False, submod, *inputs)`` calls on sub-GraphModules, which
have no sharding rule and cannot be emitted per rank. Their bodies are plain ATen ops:
we splice them into the parent graph. A no-grad region's outputs are detached, so no
gradient flows through them, exactly as in the serial model; a disabled autocast region
is the identity on dtypes, so splicing it changes nothing.

Example:
    >>> inline_wrappers(ep.graph_module)   # no call of wrap_with_set_grad_enabled is left
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten


def _wrapper_parts(node: fx.Node):
    """(submodule attr node, inputs, detach outputs?) for an inlinable wrapper call, else None."""
    name = getattr(node.target, "__name__", str(node.target))
    if name == "wrap_with_set_grad_enabled":
        return node.args[1], node.args[2:], not node.args[0]
    if name == "wrap_with_autocast" and node.args[2] is False:  # (device, dtype, enabled, cache, submod, ...)
        return node.args[4], node.args[5:], False
    return None


def inline_wrappers(gm: fx.GraphModule) -> int:
    """Splice every inlinable wrapper's body into ``gm``'s graph; returns how many were inlined."""
    count = 0
    changed = True
    while changed:  # wrappers may nest
        changed = False
        for node in list(gm.graph.nodes):
            parts = _wrapper_parts(node) if node.op == "call_function" else None
            if parts is None:
                continue
            _inline_one(gm, node, *parts)
            count += 1
            changed = True
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def _inline_one(gm: fx.GraphModule, node: fx.Node, sub_attr: fx.Node, inputs, detach: bool) -> None:
    sub = getattr(gm, sub_attr.target)
    graph = gm.graph
    env: dict[fx.Node, object] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, inputs))
    outputs = None
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = fx.map_arg(n.args[0], lambda a: env[a])
                continue
            if n.op == "get_attr":  # a nested wrapper's body: move it to the parent
                new_name = f"{sub_attr.target}_{n.target}"
                setattr(gm, new_name, getattr(sub, n.target))
                env[n] = graph.get_attr(new_name)
                continue
            env[n] = graph.node_copy(n, lambda a: env[a])
        outs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        if detach:
            outs = [_detached(graph, o) for o in outs]
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
    if node.users:
        raise RuntimeError(f"autopar: cannot inline {node.name}: its result is used whole")
    graph.erase_node(node)


def _detached(graph: fx.Graph, value):
    if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        return value
    out = graph.call_function(aten.detach.default, (value,))
    out.meta = dict(value.meta)
    return out
