"""Attention over a sequence split across the ranks of one mesh axis (context parallel).

Each rank holds the queries, keys and values of its piece of the sequence (dim -2; piece k of n
holds positions [k L, (k + 1) L)). ``cp_attention`` computes the rank's queries against every
key, as the serial ``scaled_dot_product_attention`` would, one key block (one rank's piece) at a
time (``BlockAttention``), merging the blocks' partial results with the log-sum-exp correction
(online softmax) and skipping the blocks the causal mask hides entirely:

- ``"allgather"``: K and V are all-gathered on the axis first (backward: their gradients
  reduce-scattered back, by ``all_gather_rs``'s autograd); the blocks are slices of the gathered
  K/V. Memory: the whole K/V per rank, kept for backward (no (queries x keys) mask: each block's
  causal mask is made, used and dropped in its step). Cheap when K/V are small (GQA, short
  sequences).
- ``"ring"``: the K/V blocks travel around the axis (``n - 1`` ring shifts of K and V forward);
  only the rank's own piece is kept for backward.

Backward is exact: per block dS = P * (dP - rowsum(dO * O)) with the forward's final log-sum-exp;
dK/dV accumulate on their block (ring: as it travels, shifted home at the end; allgather: into
the gathered gradient). On the CPU each block runs the fused flash kernel
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which take the final output
and log-sum-exp); elsewhere plain fp32 math (a CUDA kernel returning the log-sum-exp is not wired
in yet).

A mask given by the model (``attn_mask``: boolean, True = attend, or additive float) arrives
split with the queries and whole along the keys (rules/attention.py places it so).

What one call keeps for backward, and holds on top while it runs (cost/ reads
``kept_by``/``workspace_bytes`` through context/attention_lowering.py): q, K and V (allgather:
gathered), the output and the fp32 log-sum-exp rows (and the model's mask); while running, the
fp32 accumulators of the output (forward) or of dQ, dK, dV (backward), the block at hand and,
on the ring, the one arriving.

Example:
    >>> out = cp_attention(q, k, v, None, True, None, True, "ring", False, "cp", [0, 1], 0)   # on rank 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autopar.runtime.collectives import ops, ring_shift
from autopar.runtime.pieces import _pos
from autopar.placement import local_positions


def cp_attention(
    q, k, v, mask, is_causal: bool, scale, enable_gqa: bool, method: str, zigzag: bool, axis: str, group, rank
):
    """This rank's attention output (the shape of ``q``) for sequence pieces split on ``group``
    (``zigzag``: each piece is the head-tail pair of chunks of placement.py's orders). GQA (fewer
    K/V heads than query heads) is taken whether ``enable_gqa`` is set or not."""
    if method == "allgather":  # the pieces in rank order: block ``src`` is rank src's piece
        # one op for both (and for their gradients' reduce-scatters): compiled, the two keep
        # their order on every rank (runtime/collectives.all_gather_rs_pair says why)
        k, v = ops.all_gather_rs_pair.default(k.contiguous(), v.contiguous(), k.dim() - 2, axis, list(group), rank)
    return BlockAttention.apply(q, k, v, mask, is_causal, scale, zigzag, method, axis, list(group), rank)


@dataclass(frozen=True)
class Block:
    """How this rank's queries meet one key block: queries [q0, q0 + qn) against the block's keys
    [k0, k0 + kn), ``causal`` (a square block of the same positions: the lower triangle, as SDPA's
    ``is_causal``) or with ``mask`` (the model's, at these positions; None: every pair attends)."""

    q0: int
    qn: int
    k0: int
    kn: int
    causal: bool = False
    mask: torch.Tensor | None = None


def block_plan(mask, is_causal: bool, n: int, pos: int, src: int, L: int, S: int, zigzag: bool) -> Block | None:
    """The part of key block ``src`` (rank src's piece, ``S`` keys) this rank's (``pos``) ``L``
    queries attend; None when the causal mask hides all of it. Under the causal mask no mask
    tensor is needed: the diagonal block is a lower triangle (local order = position order) and
    every other block is attended whole or not at all by each chunk of queries. Contiguous
    pieces: blocks before the rank's whole, after it hidden. Zig-zag (chunks pos, 2n-1-pos
    against src, 2n-1-src): a block of an earlier rank meets every query with its head chunk
    only (its tail follows both query chunks); a later rank's block meets the tail query chunk
    only, whole (its chunks both precede chunk 2n-1-pos and follow chunk pos) -- half a block's
    work each, the same on every rank. A block the model's mask hides entirely (another document
    of a packed sequence) is skipped."""
    if is_causal:
        if src == pos:
            return Block(0, L, 0, S, causal=True)
        if not zigzag:
            return Block(0, L, 0, S) if src < pos else None
        if src < pos:
            return Block(0, L, 0, S // 2)
        return Block(L // 2, L - L // 2, 0, S)
    if mask is None:
        return Block(0, L, 0, S)
    if zigzag:
        part = mask.index_select(-1, local_positions(S, n, src, True, mask.device))
    else:
        part = mask.narrow(-1, src * S, S)
    return Block(0, L, 0, S, mask=part) if _attends(part) else None


def _attends(mask) -> bool:
    """Whether any query attends any key of a block's mask: a block of other documents (packed
    sequences' document mask) or one the model's causal mask hides is skipped, not computed (one
    host read per block)."""
    if mask.dtype == torch.bool:
        return bool(mask.any())
    return bool((mask > float("-inf")).any())


def _repeat_kv(x, groups: int):
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def _fold_kv(x, groups: int):
    """The gradient of ``_repeat_kv``: the query heads of each group summed onto their kv head."""
    if groups == 1:
        return x
    return x.unflatten(-3, (x.shape[-3] // groups, groups)).sum(-3)


def _scores(q, k, mask, scale):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is None:
        return s
    if mask.dtype == torch.bool:
        return s.masked_fill(~mask, float("-inf"))
    return s + mask


FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _fused(q) -> bool:
    """Blocks by the fused CPU kernel (it returns each row's log-sum-exp): 4-D CPU tensors."""
    return q.device.type == "cpu" and q.dim() == 4 and q.dtype in (torch.float32, torch.float64, torch.bfloat16)


def _additive(m, q):
    """A block mask as the fused kernel takes it (additive, in q's dtype), and the rows it hides."""
    if m is None:
        return None, None
    add = (
        torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill(~m, float("-inf"))
        if m.dtype == torch.bool
        else m.to(q.dtype)
    )
    hidden = torch.isinf(add).all(-1) if m.dtype != torch.bool else ~m.any(-1)
    return add, hidden


def _causal_mask(q, kr):
    """The lower triangle of a square block, for the plain-math path (the fused kernel takes ``is_causal``)."""
    return torch.ones(q.shape[-2], kr.shape[-2], dtype=torch.bool, device=q.device).tril()


def _acc(q) -> torch.dtype:
    """The accumulators' and log-sum-exp's dtype: float32, or float64 for a float64 model (whose
    result keeps its precision; the fused kernel takes a float64 log-sum-exp beside float64 q)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _block_forward(q, kr, vr, blk: Block, scale):
    """(out, lse) of q against one key block, in _acc(q) (rows the block hides: out 0, lse -inf)."""
    if _fused(q):
        add, hidden = _additive(blk.mask, q)
        o, lse = FLASH_CPU(q, kr, vr, 0.0, blk.causal, attn_mask=add, scale=scale)
        lse = lse.to(_acc(q))
        if hidden is not None:  # the kernel leaves lse 0 there: no key, no mass
            lse = lse.masked_fill(hidden.expand_as(lse), float("-inf"))
        return o.to(_acc(q)), lse
    s = _scores(q.to(_acc(q)), kr.to(_acc(q)), _causal_mask(q, kr) if blk.causal else blk.mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(torch.isinf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    return torch.matmul(p, vr.to(_acc(q))), lse


def _block_backward(d_out, q, kr, vr, out, lse, delta, blk: Block, scale):
    """(dq, dk, dv) of one key block given the final output and log-sum-exp, in _acc(q)."""
    if _fused(q):
        add, _ = _additive(blk.mask, q)
        safe = torch.where(torch.isinf(lse), float("inf"), lse)  # a row with no key: P = 0
        grads = FLASH_CPU_BACKWARD(
            d_out.to(q.dtype), q, kr, vr, out, safe.to(_acc(q)), 0.0, blk.causal, attn_mask=add, scale=scale
        )
        return tuple(g.to(_acc(q)) for g in grads)
    qf, kf, vf = q.to(_acc(q)), kr.to(_acc(q)), vr.to(_acc(q))
    s = _scores(qf, kf, _causal_mask(q, kr) if blk.causal else blk.mask, scale)
    p = torch.where(torch.isinf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    d_out = d_out.to(_acc(q))
    ds = p * (torch.matmul(d_out, vf.transpose(-2, -1)) - delta)
    return (
        torch.matmul(ds, kf) * scale,
        torch.matmul(ds.transpose(-2, -1), qf) * scale,
        torch.matmul(p.transpose(-2, -1), d_out),
    )


def _rows(x, blk: Block, dim: int = -2):
    return x if blk.qn == x.shape[dim] else x.narrow(dim, blk.q0, blk.qn)


def _keys(x, blk: Block):
    return x if blk.kn == x.shape[-2] else x.narrow(-2, blk.k0, blk.kn)


class BlockAttention(torch.autograd.Function):
    """Attention of the local queries against every key block, with an exact backward (see the
    module docstring). ``method`` "ring": ``k``/``v`` are the rank's piece, the other blocks
    arrive by ring shifts; "allgather": ``k``/``v`` are gathered (rank order), block ``src`` is
    their ``src``-th slice. Accumulators are updated in place: a block's temporaries are freed
    before the next block's."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, zigzag, method, axis, group, rank):
        n, pos = len(group), _pos(group, rank)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 and k.dim() >= 3 else 1
        gathered = method == "allgather"
        L, S = q.shape[-2], k.shape[-2] // n if gathered else k.shape[-2]
        out = torch.zeros_like(q, dtype=_acc(q))
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q), device=q.device)
        kb, vb = k, v
        for step in range(n):
            src = (pos - step) % n
            if gathered:
                kb, vb = k.narrow(-2, src * S, S), v.narrow(-2, src * S, S)
            elif step:
                kb, vb = ring_shift(kb, 1, axis, group, rank), ring_shift(vb, 1, axis, group, rank)
            blk = block_plan(mask, is_causal, n, pos, src, L, S, zigzag)
            if blk is None:
                continue  # hidden by the causal mask: nothing to add
            kr, vr = _repeat_kv(_keys(kb, blk), groups), _repeat_kv(_keys(vb, blk), groups)
            blk_out, blk_lse = _block_forward(_rows(q, blk), kr, vr, blk, scale)
            o, m = _rows(out, blk), _rows(lse, blk, -1)
            new = torch.logaddexp(m, blk_lse)
            # rows with no key yet (-inf - -inf) keep their zeros
            keep = torch.where(torch.isinf(new), 0.0, torch.exp(m - new))
            take = torch.where(torch.isinf(new), 0.0, torch.exp(blk_lse - new))
            # blk_out is not changed in place: a selective checkpoint may have cached the kernel's output
            o.mul_(keep[..., None]).add_(blk_out * take[..., None])
            m.copy_(new)
            del blk_out, blk_lse, kr, vr, new, keep, take
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.meta = (is_causal, scale, zigzag, gathered, axis, group, rank, groups)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, mask = ctx.saved_tensors
        is_causal, scale, zigzag, gathered, axis, group, rank, groups = ctx.meta
        n, pos = len(group), _pos(group, rank)
        L, S = q.shape[-2], k.shape[-2] // n if gathered else k.shape[-2]
        delta = (d_out.to(_acc(q)) * out.to(_acc(q))).sum(-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.zeros_like(q, dtype=_acc(q))
        kb, vb = k, v
        dk, dv = torch.zeros_like(k, dtype=_acc(q)), torch.zeros_like(v, dtype=_acc(q))
        dkb, dvb = dk, dv
        for step in range(n):
            src = (pos - step) % n
            if gathered:  # the block's slice of the gathered K/V and of their gradients
                kb, vb = k.narrow(-2, src * S, S), v.narrow(-2, src * S, S)
                dkb, dvb = dk.narrow(-2, src * S, S), dv.narrow(-2, src * S, S)
            elif step:
                kb, vb = ring_shift(kb, 1, axis, group, rank), ring_shift(vb, 1, axis, group, rank)
                dkb, dvb = ring_shift(dkb, 1, axis, group, rank), ring_shift(dvb, 1, axis, group, rank)
            blk = block_plan(mask, is_causal, n, pos, src, L, S, zigzag)
            if blk is None:
                continue
            kr, vr = _repeat_kv(_keys(kb, blk), groups), _repeat_kv(_keys(vb, blk), groups)
            g_q, g_k, g_v = _block_backward(
                _rows(d_out, blk), _rows(q, blk), kr, vr, _rows(out, blk), _rows(lse, blk, -1), _rows(delta, blk),
                blk, scale,
            )  # fmt: skip
            _rows(dq, blk).add_(g_q)
            _keys(dkb, blk).add_(_fold_kv(g_k, groups))
            _keys(dvb, blk).add_(_fold_kv(g_v, groups))
            del g_q, g_k, g_v, kr, vr
        if gathered:
            dkb, dvb = dk, dv
        elif n > 1:  # the block now here is the next rank's: one more shift brings each home
            dkb, dvb = ring_shift(dkb, 1, axis, group, rank), ring_shift(dvb, 1, axis, group, rank)
        grads = (dq.to(q.dtype), dkb.to(k.dtype), dvb.to(v.dtype))
        return grads + (None,) * 8
