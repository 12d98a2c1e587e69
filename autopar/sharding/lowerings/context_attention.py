"""Attention with the sequence split on a mesh axis (context parallel): the rank's queries
against every key, by all-gathered K/V or by a ring of K/V blocks (runtime/context_attention.py),
or every position of 1/n of the heads after an all-to-all (Ulysses: runtime/ulysses.py).

The rule (rules/attention.py) offers it when q, k and v arrive split on their sequence dim
(dim -2): the technique that split the sequence (``ap.ContextParallel``) answers
``attention_method(axis)`` with "allgather", "ring" or "ulysses"; without one the lowering all-gathers.

What a call keeps for backward (``kept``) and holds while it runs (``workspace``) are stated
here for the cost model (cost/activation_memory.py): allgather keeps the gathered K/V.

Collectives per attention call, K and V of ``kv`` bytes per rank each, ``n`` ranks on the axis:
    allgather: forward 2 all-gathers ((n-1) kv each), backward 2 reduce-scatters of the gathered
               gradients ((n-1) kv each)
    ring:      forward a ring pass (n-1 shifts, n-1 steps) of K and of V; backward a pass of K and
               V again and of their fp32 gradients (they travel with the blocks), plus one shift
               of each gradient home. ap.comm_stats() records every shift as ring_shift.
    ulysses:   forward 4 all-to-alls ((n-1)/n of q, of K and V repeated t times for GQA, of the
               output back), backward the same on their gradients; a mask split on its query
               rows is all-gathered ((n-1) x its piece).

Example:
    >>> CONTEXT_ATTENTION.comms(plan, node, axis, symbols)   # ring: ('ring_pass', axis, 'forward', ...)
"""

from __future__ import annotations


import sympy
import torch
import torch.fx as fx

from autopar.runtime.context_attention import cp_attention
from autopar.runtime.ring import ring_bytes
from autopar.runtime.ulysses import kv_repeat, ulysses_attention
from autopar.sharding.lowerings.base import Lowering, register_lowering
from autopar.sharding.piece_order import zigzag_axes

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def sdpa_arg(node_or_args, kwargs, i: int, name: str, default=None):
    """Argument ``i`` (or keyword ``name``) of a scaled_dot_product_attention call."""
    return node_or_args[i] if i < len(node_or_args) else kwargs.get(name, default)


def _hint(size) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _most(symbols, *values):
    """The largest of ``values``: a number where ``symbols`` gives numbers (cost.formulas.Numbers:
    its axes are ints), else a sympy Max."""
    numbers = all(isinstance(a, int) for a in symbols.axes)
    return max(float(v) for v in values) if numbers else sympy.Max(*values)


def attention_method(plan, axis: int) -> str:
    """ "allgather", "ring" or "ulysses": what a technique splitting the sequence on ``axis`` asks for."""
    name = plan.mesh.axis_names[axis]
    for technique in plan.options.techniques:
        method = technique.attention_method(name)
        if method is not None:
            return method
    return "allgather"


def _mask_rows_split(node, axis: int) -> bool:
    """Whether the call's mask arrives split on its query rows on ``axis`` (rules/attention.py
    splits it so unless it broadcasts along them)."""
    mask = sdpa_arg(node.args, node.kwargs, 3, "attn_mask")
    lay = node.meta["autopar"]
    i = lay.inputs.index(mask)
    return lay.input_targets[i][axis].is_shard()


def local_heads(plan, node, i: int) -> int:
    """Heads (dim -3) of input ``i`` of an attention call on one rank: the global count over the
    mesh axes that split it (tp's head split)."""
    val = node.args[i].meta["val"]
    spec = node.meta["autopar"].input_targets[i]
    heads = _hint(val.shape[-3]) if val.dim() >= 3 else 1
    for a, p in enumerate(spec):
        if p.is_shard() and p.dim % val.dim() == val.dim() - 3:
            heads //= plan.mesh.shape[a]
    return heads


def ulysses_repeat(plan, node, axis: int) -> int:
    """Ulysses' K/V head repeat for this call on ``axis`` (runtime/ulysses.kv_repeat); ValueError
    where the heads do not split over the axis."""
    return kv_repeat(local_heads(plan, node, 0), local_heads(plan, node, 1), plan.mesh.shape[axis])


def _ulysses_comms(plan, node, axis: int, symbols) -> list[tuple]:
    """Four all-to-alls each way ((n-1)/n of q, of K and V repeated for GQA, of the output; the
    same on their gradients) and, with a mask split on its rows, the rows' all-gather."""
    lay, n = node.meta["autopar"], symbols.axes[axis]
    t = ulysses_repeat(plan, node, axis)
    sizes = []
    for i, times in ((0, 1), (1, t), (2, t)):
        val = node.args[i].meta["val"]
        sizes.append(times * symbols.numel(val.shape, lay.input_targets[i]) * val.dtype.itemsize)
    sizes.append(sizes[0])  # the output: q's shape
    out = [
        ("all_to_all", axis, phase, ring_bytes("all_to_all", b, n)) for phase in ("forward", "backward") for b in sizes
    ]
    mask = sdpa_arg(node.args, node.kwargs, 3, "attn_mask")
    if isinstance(mask, fx.Node) and _mask_rows_split(node, axis):
        i = lay.inputs.index(mask)
        m = symbols.numel(mask.meta["val"].shape, lay.input_targets[i]) * mask.meta["val"].dtype.itemsize
        out.append(("all_gather", axis, "forward", ring_bytes("all_gather", m, n)))
    return out


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
        zigzag = em.orders.zigzag_in(node, 0, axis)  # load balanced: each rank's positions are two chunks
        if method == "ulysses":
            rows_split = isinstance(mask, fx.Node) and _mask_rows_split(node, axis)
            return em.graph.call_function(
                ulysses_attention, (q, k, v, mask, is_causal, scale, rows_split, zigzag, name, group, rank)
            )
        return em.graph.call_function(
            cp_attention, (q, k, v, mask, is_causal, scale, gqa, method, zigzag, name, group, rank)
        )

    def comms(self, plan, node, axis: int, symbols) -> list[tuple]:
        lay = node.meta["autopar"]
        n = symbols.axes[axis]
        if attention_method(plan, axis) == "ulysses":
            return _ulysses_comms(plan, node, axis, symbols)
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

    def kept(self, plan, node, axis: int) -> list[tuple]:
        """What a call keeps for backward (runtime/context_attention.BlockAttention): q, the rank's
        K and V (allgather: gathered on the axis, cp times the piece), the output, the fp32
        log-sum-exp rows and the model's mask; no (queries x keys) mask under causal attention."""
        tensors = list(dict.fromkeys(a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)))
        index = {a: i for i, a in enumerate(tensors)}
        q, k, v = node.args[0], node.args[1], node.args[2]
        out = node.meta["val"]
        lse = 4 / (_hint(out.shape[-1]) * out.dtype.itemsize)  # (..., L) fp32 against out's (..., L, D)
        method = attention_method(plan, axis)
        if method == "ulysses":  # the head-split q, K, V (K/V repeated t times for GQA) and output
            kv = [("in", index[k], 0.0), ("in", index[v], 0.0)]
            t = ulysses_repeat(plan, node, axis)
            kv += [("own", 0, 2.0 * (t - 1), ("in", index[k]))] if t > 1 else []
        elif method == "ring":
            kv = [("in", index[k], 0.0), ("in", index[v], 0.0)]
        else:
            kv = [("gathered", index[k], axis), ("gathered", index[v], axis)]
        kept = [("in", index[q], 0.0), *kv, ("out", 0, 0.0), ("own", 0, lse, ("out", 0))]
        mask = sdpa_arg(node.args, node.kwargs, 3, "attn_mask")
        if isinstance(mask, fx.Node) and mask in index:
            rows = method == "ulysses" and _mask_rows_split(node, axis)  # every row kept, gathered
            kept.append(("gathered", index[mask], axis) if rows else ("in", index[mask], 0.0))
        return kept

    def workspace(self, plan, node, axis: int, symbols):
        """The most a call holds beyond what it keeps (BlockAttention, with q, kv the bytes of the
        rank's q and K pieces, G query heads per K/V head, f = 4 / itemsize, n ranks):
        forward: the fp32 output accumulator and one block's fp32 output (2 f q), the block
        at hand (ring: 2 kv, 4 kv while the next arrives) and its heads repeated (2 G kv when
        G > 1); allgather: the pieces received while they are concatenated (n kv); backward: the arriving dO (q), the fp32 dQ and the block's dQ (2 f q), the
        block's fp32 dK/dV before the GQA fold (2 f G kv, + f kv folded), the dK/dV
        accumulators (ring: 2 f kv, and the block at hand 2 kv, both twice while shifting;
        allgather: 2 f n kv, the gathered gradients), the repeated heads (2 G kv)."""
        lay = node.meta["autopar"]
        qv, kv_val = node.args[0].meta["val"], node.args[1].meta["val"]
        size = qv.dtype.itemsize
        q = symbols.numel(qv.shape, lay.input_targets[0]) * size
        kv = symbols.numel(kv_val.shape, lay.input_targets[1]) * size
        f = 4 / size
        groups = _hint(qv.shape[-3]) // _hint(kv_val.shape[-3]) if qv.dim() >= 3 and kv_val.dim() >= 3 else 1
        repeated = 2 * groups * kv if groups > 1 else 0
        grads = 2 * f * groups * kv + f * kv  # one block's dK, dV (query heads) and a fold
        method = attention_method(plan, axis)
        if method == "ulysses":  # K/V repeated t times, then one block of every position
            t = ulysses_repeat(plan, node, axis)
            kv, groups = t * kv, groups // t
            repeated = 2 * groups * kv if groups > 1 else 0
            grads = 2 * f * groups * kv + f * kv
            forward = _most(symbols, 4 * kv if t > 1 else 2 * kv, 2 * f * q + repeated + q)
            backward = 2 * q + 2 * f * q + 2 * f * kv + repeated + grads
        elif method == "ring":
            forward = 2 * f * q + _most(symbols, 4 * kv, 2 * kv + repeated)
            backward = q + 2 * f * q + _most(symbols, 2 * (2 * kv + 2 * f * kv), 2 * kv + 2 * f * kv + repeated + grads)
        else:  # the gather: every rank's piece received, then concatenated (DistBackend.all_gather)
            forward = _most(symbols, symbols.axes[axis] * kv, 2 * f * q + repeated)
            backward = q + 2 * f * q + 2 * f * symbols.axes[axis] * kv + repeated + grads
        return _most(symbols, forward, backward)

    def steps(self, plan, node, axis: int, symbols) -> dict:
        """One of the n steps of a call (one key block), forward + backward: FLOPs 3 x 4 q_rows x
        block_keys x head_dim per head (backward twice the forward), halved under the causal
        mask with load balancing (every block but the diagonal one is half attended:
        runtime/context_attention.block_plan; the diagonal one is a triangle); and on the ring
        what a step shifts: K and V forward, K, V and their fp32 gradients backward (4
        messages). The runtime does not overlap a block's shift with its compute: Cost.time()
        adds both, and shows them side by side."""
        if attention_method(plan, axis) == "ulysses":
            return None  # one block, every position: the op's own FLOPs split over the heads
        lay = node.meta["autopar"]
        qv, kv_val = node.args[0].meta["val"], node.args[1].meta["val"]
        q_numel = symbols.numel(qv.shape, lay.input_targets[0])
        block = symbols.shape(kv_val.shape, lay.input_targets[1])[-2]
        flops = 3 * 4 * q_numel * block
        causal = bool(sdpa_arg(node.args, node.kwargs, 5, "is_causal", False))
        if causal and axis in zigzag_axes(plan):
            flops = flops / 2
        kv = symbols.numel(kv_val.shape, lay.input_targets[1]) * kv_val.dtype.itemsize
        ring = attention_method(plan, axis) == "ring"
        nbytes = 2 * kv + 2 * kv + 2 * kv * 4 / kv_val.dtype.itemsize if ring else 0
        return {"steps": symbols.axes[axis], "flops": flops, "bytes": nbytes, "messages": 6 if ring else 0}

    def reason(self, axis_name: str) -> str:
        return (
            f"context-parallel attention on {axis_name}: the sequence is split, each rank's queries "
            "meet every key (K/V all-gathered, or passed around a ring with the log-sum-exp merge)"
        )


CONTEXT_ATTENTION = register_lowering(ContextAttention())
