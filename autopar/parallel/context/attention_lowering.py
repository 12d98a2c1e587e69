"""Attention with the sequence split on a mesh axis (context parallel): the rank's queries
against every key, by all-gathered K/V or by a ring of K/V blocks (context/block_attention.py),
or every position of 1/n of the heads after an all-to-all (Ulysses: context/ulysses.py).

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
               rows is all-gathered ((n-1) x its piece) once per program, by the first call
               that reads it (every layer reads the model's one mask).

Example:
    >>> CONTEXT_ATTENTION.comms(plan, node, axis, symbols)   # ring: ('ring_pass', axis, 'forward', ...)
"""

from __future__ import annotations


from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from autopar.mesh import SubAxis
from autopar.parallel.context.block_attention import cp_attention
from autopar.runtime.ring import ring_bytes
from autopar.parallel.context.ulysses import gather_mask_rows, kv_repeat, ulysses_attention
from autopar.sharding.lowerings.base import Lowering, register_lowering
from autopar.sharding.piece_order import zigzag_axes
from autopar.sharding.rules.attention import register_sequence_lowering

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


def _gathers_mask(node, axis: int) -> bool:
    """Whether this Ulysses call gathers its mask's rows: the mask arrives split on its rows, and
    this is the first call (in program order) that reads it; the later ones read the gathered
    rows the emitter keeps (ContextAttention.emit), so the traffic and the whole mask's storage
    are counted once per program."""
    mask = sdpa_arg(node.args, node.kwargs, 3, "attn_mask")
    if not isinstance(mask, fx.Node) or not _mask_rows_split(node, axis):
        return False
    readers = {u for u in mask.users if u.target == node.target}
    first = mask.next
    while first.op != "root" and first not in readers:
        first = first.next
    return first is node


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


def ulysses_repeat(plan, node, split: "Split") -> int:
    """Ulysses' K/V head repeat for this call on ``split`` (context/ulysses.kv_repeat); ValueError
    where the heads do not split over its ranks."""
    return kv_repeat(local_heads(plan, node, 0), local_heads(plan, node, 1), split.size(plan.mesh))


def _ulysses_comms(plan, node, split: "Split", symbols) -> list[tuple]:
    """Four all-to-alls each way ((n-1)/n of q, of K and V repeated for GQA, of the output; the
    same on their gradients) and, with a mask split on its rows, the rows' all-gather."""
    lay, n, axis = node.meta["autopar"], split.ranks(symbols), split.key
    t = ulysses_repeat(plan, node, split)
    sizes = []
    for i, times in ((0, 1), (1, t), (2, t)):
        val = node.args[i].meta["val"]
        sizes.append(times * symbols.numel(val.shape, lay.input_targets[i]) * val.dtype.itemsize)
    sizes.append(sizes[0])  # the output: q's shape
    out = [
        ("all_to_all", axis, phase, ring_bytes("all_to_all", b, n)) for phase in ("forward", "backward") for b in sizes
    ]
    mask = sdpa_arg(node.args, node.kwargs, 3, "attn_mask")
    if _gathers_mask(node, split.axis):  # once per program: the first call's
        i = lay.inputs.index(mask)
        m = symbols.numel(mask.meta["val"].shape, lay.input_targets[i]) * mask.meta["val"].dtype.itemsize
        out.append(("all_gather", axis, "forward", ring_bytes("all_gather", m, n)))
    return out


@dataclass(frozen=True)
class Split:
    """One split of an attention call's sequence: mesh axis ``axis`` or, on hybrid's merged axis,
    ``part`` of it (a SubAxis: the inner ranks, Ulysses; the outer ones, ring or all-gather), and
    the method that meets the keys across it."""

    axis: int
    method: str
    part: SubAxis | None = None

    @property
    def key(self):
        """What the cost model and Mesh.axis_label take: the axis, or its part."""
        return self.axis if self.part is None else self.part

    def size(self, mesh) -> int:
        return mesh.shape[self.axis] if self.part is None else self.part.size(mesh.shape[self.axis])

    def ranks(self, symbols):
        return symbols.axes[self.axis] if self.part is None else symbols.axis(self.part)

    def group_attr(self) -> str:
        """The rank constant (codegen/emit.rank_attrs) holding this rank's group on the split."""
        if self.part is None:
            return f"autopar_group_{self.axis}"
        return f"autopar_group_{self.axis}_{'in' if self.part.part == 'inner' else 'out'}{self.part.within}"


def call_splits(plan, node, axis: int) -> tuple:
    """(the Ulysses split, the ring or all-gather split) of a call on ``axis``: one of them None
    unless the axis is hybrid's two merged axes (Mesh.merge_axes) with a part of more than one rank each."""
    method = attention_method(plan, axis)
    if isinstance(method, str):
        return (Split(axis, method), None) if method == "ulysses" else (None, Split(axis, method))
    name, n = plan.mesh.axis_names[axis], plan.mesh.shape[axis]
    outer, inner, within = next((o, i, k) for merged, o, i, k in plan.mesh.parts if merged == name)
    if within == 1:
        return None, Split(axis, method[0])
    if within == n:
        return Split(axis, "ulysses"), None
    return (
        Split(axis, "ulysses", SubAxis(axis, within, "inner", inner)),
        Split(axis, method[0], SubAxis(axis, within, "outer", outer)),
    )


def _outer_comms(node, split: Split, symbols, t: int = 1) -> list[tuple]:
    """The ring's or all-gather's collectives for K and V (repeated ``t`` times: hybrid's heads)."""
    lay, n, axis = node.meta["autopar"], split.ranks(symbols), split.key
    out = []
    for i in (1, 2):  # K, V
        val = node.args[i].meta["val"]
        kv = t * symbols.numel(val.shape, lay.input_targets[i]) * val.dtype.itemsize
        if split.method == "ring":
            grad = kv * 4 / val.dtype.itemsize  # fp32 gradient accumulators
            out.append(("ring_pass", axis, "forward", ring_bytes("ring_pass", kv, n)))
            out.append(("ring_pass", axis, "backward", ring_bytes("ring_pass", kv, n)))
            out.append(("ring_pass", axis, "backward", ring_bytes("ring_pass", grad, n)))
            out.append(("ring_shift", axis, "backward", ring_bytes("ring_shift", grad, n)))
        else:
            out.append(("all_gather", axis, "forward", ring_bytes("all_gather", kv, n)))
            out.append(("reduce_scatter", axis, "backward", ring_bytes("reduce_scatter", kv * n, n)))
    return out


def _block_workspace(method: str, q, kv, groups: int, f, n, symbols) -> tuple:
    """(forward, backward) bytes BlockAttention holds beyond what it keeps (ContextAttention.workspace)."""
    repeated = 2 * groups * kv if groups > 1 else 0
    grads = 2 * f * groups * kv + f * kv  # one block's dK, dV (query heads) and a fold
    if method == "ring":
        forward = 2 * f * q + _most(symbols, 4 * kv, 2 * kv + repeated)
        backward = q + 2 * f * q + _most(symbols, 2 * (2 * kv + 2 * f * kv), 2 * kv + 2 * f * kv + repeated + grads)
    elif method == "allgather":  # every rank's piece received, then concatenated (DistBackend.all_gather)
        forward = _most(symbols, n * kv, 2 * f * q + repeated)
        backward = q + 2 * f * q + 2 * f * n * kv + repeated + grads
    else:  # one block of every position (Ulysses)
        forward = 2 * f * q + repeated
        backward = q + 2 * f * q + 2 * f * kv + repeated + grads
    return forward, backward


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
        rank = em.rank_value("autopar_rank")
        uly, outer = call_splits(em.plan, node, axis)
        # load balanced: each rank's positions are two chunks (hybrid: of the merged axis, which
        # the Ulysses all-to-all turns into the outer part's two chunks)
        zigzag = em.orders.zigzag_in(node, 0, axis)
        inner = None
        if outer is not None:
            name, group = em.mesh.axis_label(outer.key), em.rank_value(outer.group_attr())
            inner = (outer.method, zigzag, name, group)
        if uly is None:
            return em.graph.call_function(cp_attention, (q, k, v, mask, is_causal, scale, gqa, *inner, rank))
        name, group = em.mesh.axis_label(uly.key), em.rank_value(uly.group_attr())
        if isinstance(mask, fx.Node) and _mask_rows_split(node, axis):
            # every layer reads the model's one mask: its rows are gathered once per program (the
            # first call's), not once per call (em.edges holds the emitter's shared values)
            key = ("ulysses_mask_rows", mask, name, zigzag)
            if key not in em.edges:
                em.edges[key] = em.graph.call_function(gather_mask_rows, (mask, zigzag, name, group, rank))
            mask = em.edges[key]
        return em.graph.call_function(
            ulysses_attention, (q, k, v, mask, is_causal, scale, False, zigzag, name, group, rank, inner)
        )

    def comms(self, plan, node, axis: int, symbols) -> list[tuple]:
        uly, outer = call_splits(plan, node, axis)
        out = _ulysses_comms(plan, node, uly, symbols) if uly is not None else []
        t = ulysses_repeat(plan, node, uly) if uly is not None else 1
        return out + (_outer_comms(node, outer, symbols, t) if outer is not None else [])

    def kept(self, plan, node, axis: int) -> list[tuple]:
        """What a call keeps for backward (context/block_attention.BlockAttention): q, the rank's
        K and V (allgather: gathered on the axis, cp times the piece; Ulysses: the head-split
        q, K, V, repeated t times for GQA, in place of the pieces), the output, the fp32
        log-sum-exp rows and the model's mask (Ulysses: its rows gathered, counted at the first
        call that reads the mask: the later ones keep the same tensor); no (queries x keys) mask
        under causal attention."""
        tensors = list(dict.fromkeys(a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)))
        index = {a: i for i, a in enumerate(tensors)}
        q, k, v = node.args[0], node.args[1], node.args[2]
        out = node.meta["val"]
        lse = 4 / (_hint(out.shape[-1]) * out.dtype.itemsize)  # (..., L) fp32 against out's (..., L, D)
        uly, outer = call_splits(plan, node, axis)
        gathered = outer.size(plan.mesh) if outer is not None and outer.method == "allgather" else 1
        t = ulysses_repeat(plan, node, uly) if uly is not None else 1
        if gathered > 1 and outer.part is None:
            kv = [("gathered", index[k], axis), ("gathered", index[v], axis)]
        else:  # hybrid's all-gather over the outer part: its own storage of t x |outer| x the piece
            kv = [("in", index[k], 0.0), ("in", index[v], 0.0)]
            t, gathered = t * gathered, 1
        if t > 1:  # the repeated (and gathered) heads' extra storage
            kv.append(("own", 0, 2.0 * (t - 1) * gathered, ("in", index[k])))
        kept = [("in", index[q], 0.0), *kv, ("out", 0, 0.0), ("own", 0, lse, ("out", 0))]
        mask = sdpa_arg(node.args, node.kwargs, 3, "attn_mask")
        if isinstance(mask, fx.Node) and mask in index:
            if uly is not None and _mask_rows_split(node, axis):
                # every row of the Ulysses group kept, one storage for all calls: counted at the
                # first call, which gathers it (the later ones keep the same tensor)
                first, i = _gathers_mask(node, axis), index[mask]
                if first and uly.part is None:
                    kept.append(("gathered", i, axis))
                elif first:  # hybrid: the inner part's rows; the fraction nudged (own tensors are keyed by it)
                    kept += [("in", i, 0.0), ("own", 0, uly.size(plan.mesh) - 1 + 1e-9, ("in", i))]
            else:
                kept.append(("in", index[mask], 0.0))
        return kept

    def workspace(self, plan, node, axis: int, symbols):
        """The most a call holds beyond what it keeps (BlockAttention, with q, kv the bytes of the
        rank's q and K pieces, G query heads per K/V head, f = 4 / itemsize, n ranks):
        forward: the fp32 output accumulator and one block's fp32 output (2 f q), the block
        at hand (ring: 2 kv, 4 kv while the next arrives) and its heads repeated (2 G kv when
        G > 1); allgather: the pieces received while they are concatenated (n kv); backward:
        the arriving dO (q), the fp32 dQ and the block's dQ (2 f q), the block's fp32 dK/dV
        before the GQA fold (2 f G kv, + f kv folded), the dK/dV accumulators (ring: 2 f kv, and
        the block at hand 2 kv, both twice while shifting; allgather: 2 f n kv, the gathered
        gradients), the repeated heads (2 G kv). Ulysses: K/V repeated t times (kv -> t kv, G ->
        G / t), one block of every position (or hybrid's ring or all-gather over the outer axis)
        beside the output's (forward) or dO's (backward) head-split copy (q); the K/V repeat and
        the all-to-all's result at once (4 kv)."""
        lay = node.meta["autopar"]
        qv, kv_val = node.args[0].meta["val"], node.args[1].meta["val"]
        size = qv.dtype.itemsize
        q = symbols.numel(qv.shape, lay.input_targets[0]) * size
        kv = symbols.numel(kv_val.shape, lay.input_targets[1]) * size
        groups = _hint(qv.shape[-3]) // _hint(kv_val.shape[-3]) if qv.dim() >= 3 and kv_val.dim() >= 3 else 1
        uly, outer = call_splits(plan, node, axis)
        method = outer.method if outer is not None else "ulysses"
        n = outer.ranks(symbols) if outer is not None else 1
        if uly is None:
            return _most(symbols, *_block_workspace(method, q, kv, groups, 4 / size, n, symbols))
        t = ulysses_repeat(plan, node, uly)
        forward, backward = _block_workspace(method, q, t * kv, groups // t, 4 / size, n, symbols)
        return _most(symbols, 4 * t * kv if t > 1 else 2 * kv, forward + q, backward + q)

    def steps(self, plan, node, axis: int, symbols) -> dict | None:
        """One of the n steps of a call (one key block), forward + backward: FLOPs 3 x 4 q_rows x
        block_keys x head_dim per head (backward twice the forward), halved under the causal
        mask with load balancing (every block but the diagonal one is half attended:
        context/block_attention.block_plan; the diagonal one is a triangle); and on the ring
        what a step shifts: K and V forward, K, V and their fp32 gradients backward (4
        messages). The runtime does not overlap a block's shift with its compute: Cost.time()
        adds both, and shows them side by side. Ulysses runs one block (None); hybrid's blocks
        are the outer axis' (every position of the Ulysses group, t x the K/V heads)."""
        uly, outer = call_splits(plan, node, axis)
        if outer is None:
            return None  # Ulysses: one block, every position: the op's own FLOPs split over the heads
        lay = node.meta["autopar"]
        qv, kv_val = node.args[0].meta["val"], node.args[1].meta["val"]
        q_numel = symbols.numel(qv.shape, lay.input_targets[0])
        block = symbols.shape(kv_val.shape, lay.input_targets[1])[-2] * (uly.ranks(symbols) if uly is not None else 1)
        flops = 3 * 4 * q_numel * block
        causal = bool(sdpa_arg(node.args, node.kwargs, 5, "is_causal", False))
        if causal and axis in zigzag_axes(plan):
            flops = flops / 2
        t = ulysses_repeat(plan, node, uly) if uly is not None else 1
        kv = t * symbols.numel(kv_val.shape, lay.input_targets[1]) * kv_val.dtype.itemsize
        ring = outer.method == "ring"
        nbytes = 2 * kv + 2 * kv + 2 * kv * 4 / kv_val.dtype.itemsize if ring else 0
        return {"steps": outer.ranks(symbols), "flops": flops, "bytes": nbytes, "messages": 6 if ring else 0}

    def reason(self, axis_name: str) -> str:
        return (
            f"context-parallel attention on {axis_name}: the sequence is split, each rank's queries "
            "meet every key (K/V all-gathered, passed around a ring with the log-sum-exp merge, or "
            "an all-to-all to a head split: Ulysses)"
        )


CONTEXT_ATTENTION = register_sequence_lowering(register_lowering(ContextAttention()))
