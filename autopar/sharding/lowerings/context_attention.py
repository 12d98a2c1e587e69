"""Attention with the sequence split on a mesh axis (context parallel): the rank's queries
against every key, by all-gathered K/V or by a ring of K/V blocks (runtime/context_attention.py).

The rule (rules/attention.py) offers it when q, k and v arrive split on their sequence dim
(dim -2): the technique that split the sequence (``ap.ContextParallel``) answers
``attention_method(axis)`` with "allgather" or "ring"; without one the lowering all-gathers.

Collectives per attention call, K and V of ``kv`` bytes per rank each, ``n`` ranks on the axis:
    allgather: forward 2 all-gathers ((n-1) kv each), backward 2 reduce-scatters of the gathered
               gradients ((n-1) kv each)
    ring:      forward a ring pass (n-1 shifts, n-1 steps) of K and of V; backward a pass of K and
               V again and of their fp32 gradients (they travel with the blocks), plus one shift
               of each gradient home. ap.comm_stats() records every shift as ring_shift.

Example:
    >>> CONTEXT_ATTENTION.comms(plan, node, axis, symbols)   # ring: ('ring_pass', axis, 'forward', ...)
"""

from __future__ import annotations


from autopar.runtime.context_attention import cp_attention
from autopar.runtime.ring import ring_bytes
from autopar.sharding.lowerings.base import Lowering, register_lowering

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def sdpa_arg(node_or_args, kwargs, i: int, name: str, default=None):
    """Argument ``i`` (or keyword ``name``) of a scaled_dot_product_attention call."""
    return node_or_args[i] if i < len(node_or_args) else kwargs.get(name, default)


def attention_method(plan, axis: int) -> str:
    """ "allgather" or "ring": what a technique splitting the sequence on ``axis`` asks for."""
    name = plan.mesh.axis_names[axis]
    for technique in plan.options.techniques:
        method = technique.attention_method(name)
        if method is not None:
            return method
    return "allgather"


class ContextAttention(Lowering):
    """scaled_dot_product_attention on sequence pieces: local queries against all keys."""

    name = "context_parallel_attention"
    priority = 2  # the other axes (heads, batch) run it as-is on their pieces

    def emit(self, em, node, args, kwargs, axis: int):
        q, k, v = args[0], args[1], args[2]
        mask = sdpa_arg(args, kwargs, 3, "attn_mask")
        is_causal = bool(sdpa_arg(node.args, node.kwargs, 5, "is_causal", False))
        scale = node.kwargs.get("scale")
        gqa = bool(node.kwargs.get("enable_gqa", False))
        method = attention_method(em.plan, axis)
        group, rank = em.rank_value(f"autopar_group_{axis}"), em.rank_value("autopar_rank")
        name = em.mesh.axis_names[axis]
        zigzag = axis in em.zigzag  # load balanced: each rank's positions are two chunks
        return em.graph.call_function(
            cp_attention, (q, k, v, mask, is_causal, scale, gqa, method, zigzag, name, group, rank)
        )

    def comms(self, plan, node, axis: int, symbols) -> list[tuple]:
        lay = node.meta["autopar"]
        n = symbols.axes[axis]
        out = []
        for i in (1, 2):  # K, V
            val = node.args[i].meta["val"]
            kv = symbols.numel(val.shape, lay.input_targets[i]) * val.dtype.itemsize
            if attention_method(plan, axis) == "ring":
                grad = kv * 4 / val.dtype.itemsize  # fp32 gradient accumulators
                out.append(("ring_pass", axis, "forward", ring_bytes("ring_pass", kv, n)))
                out.append(("ring_pass", axis, "backward", ring_bytes("ring_pass", kv, n)))
                out.append(("ring_pass", axis, "backward", ring_bytes("ring_pass", grad, n)))
                out.append(("ring_shift", axis, "backward", ring_bytes("ring_shift", grad, n)))
            else:
                out.append(("all_gather", axis, "forward", ring_bytes("all_gather", kv, n)))
                out.append(("reduce_scatter", axis, "backward", ring_bytes("reduce_scatter", kv * n, n)))
        return out

    def reason(self, axis_name: str) -> str:
        return (
            f"context-parallel attention on {axis_name}: the sequence is split, each rank's queries "
            "meet every key (K/V all-gathered, or passed around a ring with the log-sum-exp merge)"
        )


CONTEXT_ATTENTION = register_lowering(ContextAttention())
