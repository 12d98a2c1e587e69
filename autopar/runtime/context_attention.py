"""Attention over a sequence split across the ranks of one mesh axis (context parallel).

Each rank holds the queries, keys and values of its piece of the sequence (dim -2; piece k of n
holds positions [k L, (k + 1) L)). ``cp_attention`` computes the rank's queries against every
key, as the serial ``scaled_dot_product_attention`` would:

- ``"allgather"``: K and V are all-gathered on the axis (backward: their gradients
  reduce-scattered back) and one SDPA runs with the causal mask shifted to the rank's query
  positions. Memory: the whole K/V per rank; cheap when K/V are small (GQA, short sequences).
- ``"ring"``: K/V blocks travel around the axis (``n - 1`` ring shifts of K and V forward);
  each block's partial result is merged with the log-sum-exp correction (online softmax), and
  blocks that the causal mask hides entirely are skipped. Backward (``RingAttention``) is exact:
  the flash-attention identity dS = P * (dP - rowsum(dO * O)) per block with the forward's
  final log-sum-exp, dK/dV accumulated on the block as it travels and shifted home at the end.
  On the CPU each block runs the fused flash kernel (``_scaled_dot_product_flash_attention_for_cpu``
  and its backward, which take the final output and log-sum-exp); elsewhere plain fp32 math
  (a CUDA kernel returning the log-sum-exp is not wired in yet).

A mask given by the model (``attn_mask``: boolean, True = attend, or additive float) arrives
split with the queries and whole along the keys (rules/attention.py places it so).

Example:
    >>> out = cp_attention(q, k, v, None, True, None, True, "ring", False, "cp", [0, 1], 0)   # on rank 0
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from autopar.runtime.collectives import ops, ring_shift
from autopar.runtime.pieces import _pos
from autopar.runtime.zigzag import from_zigzag, local_positions


def cp_attention(
    q, k, v, mask, is_causal: bool, scale, enable_gqa: bool, method: str, zigzag: bool, axis: str, group, rank: int
):
    """This rank's attention output (the shape of ``q``) for sequence pieces split on ``group``
    (``zigzag``: each piece is the head-tail pair of chunks of runtime/zigzag.py)."""
    n, pos = len(group), _pos(group, rank)
    if method == "ring":
        return RingAttention.apply(q, k, v, mask, is_causal, scale, zigzag, axis, list(group), rank)
    k_all = ops.all_gather_rs.default(k.contiguous(), k.dim() - 2, axis, list(group), rank)
    v_all = ops.all_gather_rs.default(v.contiguous(), v.dim() - 2, axis, list(group), rank)
    if zigzag:  # the pieces arrive in rank order: back to the serial order of the keys
        k_all, v_all = from_zigzag(k_all, k.dim() - 2, n), from_zigzag(v_all, v.dim() - 2, n)
    if is_causal:
        qpos = local_positions(q.shape[-2], n, pos, zigzag, q.device)
        mask = torch.arange(k_all.shape[-2], device=q.device)[None, :] <= qpos[:, None]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def _bounds(n_local: int, n: int, coord: int, zigzag: bool) -> tuple[int, int]:
    """(first, last) serial position of the rows rank ``coord`` holds (local_positions' range)."""
    if zigzag:
        c = n_local // 2
        return coord * c, (2 * n - coord) * c - 1
    return coord * n_local, (coord + 1) * n_local - 1


def _block_mask(mask, is_causal, n, pos, src, L, S, zigzag, device):
    """The mask of the key block rank ``src`` holds against this rank's (``pos``) queries: the
    model's mask at the block's key positions, or the causal one; None when every pair attends;
    ``"skip"`` when the causal mask hides the whole block."""
    if is_causal:
        q_first, q_last = _bounds(L, n, pos, zigzag)
        k_first, k_last = _bounds(S, n, src, zigzag)
        if k_first > q_last:
            return "skip"
        qpos = local_positions(L, n, pos, zigzag, device)
        kpos = local_positions(S, n, src, zigzag, device)
        if k_last <= q_first:
            return None  # every key precedes every query
        return kpos[None, :] <= qpos[:, None]
    if mask is None:
        return None
    if zigzag:
        return mask.index_select(-1, local_positions(S, n, src, True, mask.device))
    return mask.narrow(-1, src * S, S)


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


def _block_forward(q, kr, vr, m, scale):
    """(out, lse) of q against one key block, fp32 (rows the block hides: out 0, lse -inf)."""
    if _fused(q):
        add, hidden = _additive(m, q)
        o, lse = FLASH_CPU(q, kr, vr, 0.0, False, attn_mask=add, scale=scale)
        lse = lse.float()
        if hidden is not None:  # the kernel leaves lse 0 there: no key, no mass
            lse = lse.masked_fill(hidden.expand_as(lse), float("-inf"))
        return o.float(), lse
    s = _scores(q.float(), kr.float(), m, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(torch.isinf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    return torch.matmul(p, vr.float()), lse


def _block_backward(d_out, q, kr, vr, out, lse, delta, m, scale):
    """(dq, dk, dv) of one key block given the final output and log-sum-exp, fp32."""
    if _fused(q):
        add, _ = _additive(m, q)
        safe = torch.where(torch.isinf(lse), float("inf"), lse)  # a row with no key: P = 0
        grads = FLASH_CPU_BACKWARD(
            d_out.to(q.dtype), q, kr, vr, out, safe.to(torch.float32), 0.0, False, attn_mask=add, scale=scale
        )
        return tuple(g.float() for g in grads)
    qf, kf, vf = q.float(), kr.float(), vr.float()
    s = _scores(qf, kf, m, scale)
    p = torch.where(torch.isinf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    d_out = d_out.float()
    ds = p * (torch.matmul(d_out, vf.transpose(-2, -1)) - delta)
    return (
        torch.matmul(ds, kf) * scale,
        torch.matmul(ds.transpose(-2, -1), qf) * scale,
        torch.matmul(p.transpose(-2, -1), d_out),
    )


class RingAttention(torch.autograd.Function):
    """Ring attention with an exact backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, zigzag, axis, group, rank):
        n, pos = len(group), _pos(group, rank)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 and k.dim() >= 3 else 1
        L, S = q.shape[-2], k.shape[-2]
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kb, vb = k, v
        for step in range(n):
            if step:
                kb, vb = ring_shift(kb, 1, axis, group, rank), ring_shift(vb, 1, axis, group, rank)
            src = (pos - step) % n
            m = _block_mask(mask, is_causal, n, pos, src, L, S, zigzag, q.device)
            if isinstance(m, str):
                continue  # hidden by the causal mask: nothing to add
            blk_out, blk_lse = _block_forward(q, _repeat_kv(kb, groups), _repeat_kv(vb, groups), m, scale)
            new = torch.logaddexp(lse, blk_lse)
            # rows with no key yet (-inf - -inf) keep their zeros
            keep = torch.where(torch.isinf(new), 0.0, torch.exp(lse - new))
            take = torch.where(torch.isinf(new), 0.0, torch.exp(blk_lse - new))
            out = out * keep[..., None] + blk_out * take[..., None]
            lse = new
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.meta = (is_causal, scale, zigzag, axis, group, rank, groups)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, mask = ctx.saved_tensors
        is_causal, scale, zigzag, axis, group, rank, groups = ctx.meta
        n, pos = len(group), _pos(group, rank)
        L, S = q.shape[-2], k.shape[-2]
        delta = (d_out.float() * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.zeros_like(q, dtype=torch.float32)
        kb, vb = k, v
        dkb, dvb = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for step in range(n):
            if step:
                kb, vb = ring_shift(kb, 1, axis, group, rank), ring_shift(vb, 1, axis, group, rank)
                dkb, dvb = ring_shift(dkb, 1, axis, group, rank), ring_shift(dvb, 1, axis, group, rank)
            src = (pos - step) % n
            m = _block_mask(mask, is_causal, n, pos, src, L, S, zigzag, q.device)
            if isinstance(m, str):
                continue
            kr, vr = _repeat_kv(kb, groups), _repeat_kv(vb, groups)
            g_q, g_k, g_v = _block_backward(d_out, q, kr, vr, out, lse, delta, m, scale)
            dq = dq + g_q
            dkb = dkb + _fold_kv(g_k, groups)
            dvb = dvb + _fold_kv(g_v, groups)
        if n > 1:  # the block now here is the next rank's: one more shift brings each home
            dkb, dvb = ring_shift(dkb, 1, axis, group, rank), ring_shift(dvb, 1, axis, group, rank)
        return dq.to(q.dtype), dkb.to(k.dtype), dvb.to(v.dtype), None, None, None, None, None, None, None
