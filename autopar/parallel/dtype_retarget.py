"""A precision policy's program: the model's dtype constants as it runs in ``param_dtype``.

``ap.DataParallel(param_dtype=torch.bfloat16)`` computes with parameters (and floating inputs)
cast from their fp32 pieces. The traced graph, though, froze every dtype the model computed
from its tensors in fp32 (``x.to(input_dtype)`` -> ``to(x, float32)``, metadata asserts,
``zeros(dtype=hidden.dtype)``, ``finfo(dtype).min`` masks), so HF Gemma2/Granite/Phi3 failed
their asserts and StableLM met an fp32 activation with a bf16 weight. Here the model is traced
once more as it runs under the policy (trace/in_dtype.py: meta parameters in ``param_dtype``),
the two graphs are matched node by node (the same program, another dtype), and every constant
that differs (dtypes, and the dtype's limits the model wrote as numbers) is copied into the
nodes of the emitted program that came from that node. Casts the model writes explicitly
(``.float()`` before a norm, ``softmax(dtype=float32)``) are the same in both traces and stay.

A model whose code branches on its parameters' dtype traces into another program: refused,
naming the first node that differs. So is a model whose MoE experts run as one op
(``autopar::moe_experts``, sharding/expert_blocks.py), at planning: its expert chain, copied from
the fp32 trace into the rank program by the op's lowering, keeps its fp32 casts (HF's
``input.to(weight.dtype)``), which no node of the traced graph carries here.

Example:
    >>> retarget_dtypes(plan, graph, torch.bfloat16)   # DataParallel.rewrite_program calls it
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.codegen.emit import SOURCE
from autopar.errors import DataParallelError
from autopar.sharding.expert_blocks import BLOCKS, MOE_EXPERTS
from autopar.sharding.propagate import BOUNDARY
from autopar.sharding.eager_attention import FUSED_ATTENTION, fuse_eager_attention
from autopar.trace.in_dtype import trace_in_dtype


def refuse_collapsed_experts(plan, dtype: torch.dtype) -> None:
    """Raise where the plan runs MoE experts as one op: the policy cannot retarget their chain yet."""
    paths = sorted({BLOCKS[n.args[4]].path for n in plan.graph.nodes if n.target is MOE_EXPERTS})
    if paths:
        raise DataParallelError(
            f"param_dtype={dtype}: the MoE experts of module(s) {paths} run as one op (autopar::moe_experts, "
            "docs/experts.md) whose expert chain keeps the dtypes of the fp32 trace; a precision policy does not "
            f"retarget it yet. Plan without param_dtype, or plan the model converted to {dtype} (model.to(dtype))."
        )


def retarget_dtypes(plan, graph: fx.Graph, dtype: torch.dtype) -> int:
    """Copy the policy trace's constants into ``graph`` (emitted nodes tagged with their traced
    node); returns how many nodes changed."""
    changes, tensors = policy_constants(plan, dtype)
    changed = 0
    for node in list(graph.nodes):
        if node.op == "get_attr" and node.target in tensors:  # a constant the model made in its dtype
            with graph.inserting_after(node):
                cast = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": tensors[node.target]})
            node.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)
            changed += 1
        diff = changes.get(node.meta.get(SOURCE))
        if diff is None:
            continue
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        if len(flat) != diff[0]:  # lowered into other arguments: its own nodes carry no traced constant
            continue
        for i, (how, value) in diff[1]:
            if how == "cast" and isinstance(flat[i], fx.Node):
                with graph.inserting_before(node):
                    flat[i] = graph.call_function(torch.ops.aten._to_copy.default, (flat[i],), {"dtype": value})
            elif how == "value":
                flat[i] = value
        node.args, node.kwargs = pytree.tree_unflatten(flat, spec)
        changed += 1
    return changed


def policy_constants(plan, dtype: torch.dtype) -> tuple[dict, dict]:
    """(traced node name -> (its number of argument leaves, [(leaf index, ("value", constant
    under the policy) or ("cast", dtype))]) for every node whose arguments differ when the model
    runs in ``dtype`` (see _differences); lifted
    constant tensor -> its dtype under the policy, where that differs (``torch.tensor(...,
    dtype=h.dtype)``)), made once per trace (plans of other options share it)."""
    cache = plan.traced.gm.meta.setdefault("autopar_precision", {})
    key = (dtype, plan.options.repeat_blocks)
    if key not in cache:
        t = plan.traced
        if t.example is None:
            raise DataParallelError(
                f"param_dtype={dtype}: the plan keeps no example inputs to trace the model under the policy "
                "(it was not made by ap.plan); plan it with ap.plan(..., data_parallel=DataParallel(param_dtype=...))."
            )
        low = trace_in_dtype(plan.model, t.example, dtype, t.opaque, t.dynamic, plan.options.repeat_blocks)
        if t.gm.meta.get(FUSED_ATTENTION):  # the planned trace's eager attention became SDPA: so here
            fuse_eager_attention(low)
        tensors = {
            n: low.constants[n].dtype
            for n, c in t.constants.items()
            if n in low.constants and low.constants[n].dtype != c.dtype
        }
        cache[key] = _differences(plan.graph, low.gm.graph, dtype), tensors
    return cache[key]


def _differences(graph: fx.Graph, low: fx.Graph, dtype) -> dict:
    """Per traced node, the argument leaves that differ under the policy: a constant (a dtype, a
    dtype's limit) to replace, or an edge to cast. A no-op cast in the fp32 trace (``x.float()``
    of an fp32 x returns x itself) stands for x in every later use, so a later ``type_as(out, x)``
    or residual ``x + ...`` reads the cast; under the policy it reads x, in ``param_dtype``: the
    cast's value converted back to x's dtype is x exactly, so the edge gets that conversion."""
    ours = [n for n in graph.nodes if not n.meta.get(BOUNDARY)]  # the planner's own nodes are not the model's
    theirs = list(low.nodes)
    if len(ours) != len(theirs):
        _refuse(dtype, None, None, min(len(ours), len(theirs)))
    twin = {}
    out = {}
    for i, (a, b) in enumerate(zip(ours, theirs)):
        fa, fb = pytree.tree_leaves((a.args, a.kwargs)), pytree.tree_leaves((b.args, b.kwargs))
        if a.op != b.op or a.target != b.target or len(fa) != len(fb):
            _refuse(dtype, a, b, i)
        twin[b] = a
        if a.op != "call_function":
            continue
        diff = []
        for j, (x, y) in enumerate(zip(fa, fb)):
            if isinstance(x, fx.Node) and isinstance(y, fx.Node):
                if twin.get(y) is not _traced(x) and _dtype(y) is not None and _dtype(y) != _dtype(x):
                    diff.append((j, ("cast", _dtype(y))))
            elif _differs(x, y):
                diff.append((j, ("value", y)))
        if diff:
            out[a.name] = (len(fa), diff)
    return out


def _traced(node: fx.Node) -> fx.Node:
    """The traced node behind the planner's boundary aliases (propagate.py: a module's output
    layout constraint), which read it unchanged."""
    while node.meta.get(BOUNDARY):
        node = node.args[0]
    return node


def _dtype(node: fx.Node):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _differs(x, y) -> bool:
    if isinstance(x, (torch.dtype, int, float, bool)) and isinstance(y, (torch.dtype, int, float, bool)):
        return type(x) is not type(y) or x != y
    return False


def _refuse(dtype, a, b, i):
    what = f"node #{i} is {a.name} ({a.target}) in fp32 but {b.name} ({b.target})" if a is not None else "a node count"
    raise DataParallelError(
        f"param_dtype={dtype}: traced with {dtype} parameters, the model is another program than in its own "
        f"dtype ({what}): its code branches on the parameters' dtype. Plan the model converted to {dtype} "
        "(model.to(dtype)) without param_dtype, or without a precision policy."
    )
