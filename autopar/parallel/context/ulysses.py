"""Ulysses attention: the sequence split swapped for a head split around attention (DeepSpeed
Ulysses, Megatron's and torchtitan's all-to-all context parallel).

Each rank holds (..., H, L/n, E) pieces of q, k and v: its own positions, every (local) head. One
all-to-all per tensor regroups them to (..., H/n, L, E): every position, 1/n of the heads. Attention
then runs whole on those heads (``BlockAttention`` with one block: the fused CPU kernel, the fp32
log-sum-exp, the same exact backward as the ring's), and one all-to-all turns the output back to
the rank's positions. Each all-to-all sends (n-1)/n of its tensor; backward runs the same four on
the gradients (the op's autograd: ``autopar::all_to_all`` backward is the reverse all-to-all).

- GQA with fewer K/V heads than the axis (or a count the axis does not divide): K and V heads are
  repeated ``kv_repeat`` times first, as Megatron does (their gradients fold back by autograd), so
  that every rank gets the K/V heads of its query heads. ``kv_repeat`` raises ValueError where no
  repeat fits (query heads the axis does not divide); the technique turns that into a PlanError
  naming the module while planning.
- Load balancing: the pieces arrive as the ranks' zig-zag chunks in rank order; they are put back
  in serial order after the all-to-all (``from_zigzag``) and in the ranks' order before the
  return trip, so the causal mask is the plain lower triangle.
- Hybrid (``outer``: Ulysses on the inner axis, ring or all-gather on the outer one): the
  all-to-all gathers the inner axis' pieces, which together are the outer axis' piece; attention
  then runs over the outer axis as context parallel does on one axis, on 1/n of the heads.
- A model's mask (..., L or 1, S) arrives split on its query rows (whole on the keys): its rows are
  all-gathered (and reordered likewise) by ``gather_mask_rows``, once per mask and program (the
  emitter shares it among the calls: every layer reads the model's one mask), and a per-head mask
  cut to the rank's heads. Attention
  then runs in key blocks of MASK_BLOCK (one block's additive mask at a time, not the whole
  (L x L) one; blocks the mask hides skipped).

Example:
    >>> out = ulysses_attention(q, k, v, None, True, None, False, False, "cp", [0, 1], 0)   # on rank 0
"""

from __future__ import annotations

import math

import torch

from autopar.runtime.collectives import ops
from autopar.parallel.context.block_attention import BlockAttention, cp_attention
from autopar.runtime.pieces import _pos
from autopar.placement import from_zigzag, to_zigzag


def kv_repeat(heads: int, kv_heads: int, n: int) -> int:
    """How many times each K/V head is repeated so that ``n`` ranks each get whole groups: the
    least t with kv_heads * t divisible by n (1 when it already is). kv_heads * t is then
    lcm(kv_heads, n), which divides the query heads (a multiple of both). ValueError where ``n``
    does not divide ``heads``."""
    if heads % n:
        raise ValueError(f"{heads} query heads do not split over {n} ranks")
    return n // math.gcd(kv_heads, n)


def _to_heads(x, zigzag: bool, axis: str, group: list, rank: int):
    """(..., h, L/n, E) on each rank -> (..., h/n, L, E) in serial order of positions."""
    d = x.dim()
    out = ops.all_to_all.default(x.contiguous(), d - 2, d - 3, axis, group, rank)
    return from_zigzag(out, d - 2, len(group)) if zigzag else out


def _to_positions(x, zigzag: bool, axis: str, group: list, rank: int):
    """The inverse of ``_to_heads``: (..., h/n, L, E) -> (..., h, L/n, E), the rank's positions."""
    d = x.dim()
    if zigzag:
        x = to_zigzag(x, d - 2, len(group))
    return ops.all_to_all.default(x.contiguous(), d - 3, d - 2, axis, group, rank)


def gather_mask_rows(mask, zigzag: bool, axis: str, group: list, rank: int):
    """The model's mask (..., L/n, S), split on its query rows, with every rank's rows in serial
    order (..., L, S). Emitted once per mask and program (parallel/context/attention_lowering.py):
    every attention call of the model reads the same mask, so its rows travel once, not per layer.

    Example:
        >>> whole = gather_mask_rows(mask_piece, False, "cp", [0, 1], 0)   # (B, 1, L, L) from (B, 1, L/2, L)
    """
    d, dtype = mask.dim(), mask.dtype
    wire = mask.to(torch.uint8) if dtype == torch.bool else mask.contiguous()  # gloo sends no bool
    whole = ops.all_gather.default(wire, d - 2, axis, list(group), rank).to(dtype)
    return from_zigzag(whole, d - 2, len(group)) if zigzag else whole


def _whole_mask(mask, rows_split: bool, heads: int, zigzag: bool, axis: str, group: list, rank: int):
    """The model's mask for every query row and the rank's heads (None stays None)."""
    if mask is None:
        return None
    if rows_split:  # the rows of every rank, in rank order
        mask = gather_mask_rows(mask, zigzag, axis, group, rank)
    if mask.dim() >= 3 and mask.shape[-3] > 1:  # one mask per head: the rank's heads
        h = heads // len(group)
        mask = mask.narrow(-3, _pos(group, rank) * h, h)
    return mask


MASK_BLOCK = 1024  # keys per block under a model's mask: its additive form is (queries x MASK_BLOCK)


def _key_blocks(keys: int) -> list:
    """The blocks BlockAttention cuts the keys in under a model's mask (its "allgather" loop over
    slices of K; no collective runs there): the most blocks of at least MASK_BLOCK keys that divide
    ``keys``, so that a block's additive mask stays (queries x ~MASK_BLOCK) and a block the mask
    hides (the causal future, other documents) is skipped."""
    n = max(1, keys // MASK_BLOCK)
    while keys % n:
        n -= 1
    return list(range(n))


def ulysses_attention(
    q, k, v, mask, is_causal: bool, scale, rows_split: bool, zigzag: bool, axis: str, group, rank, outer=None
):
    """This rank's attention output (the shape of ``q``) for sequence pieces split on ``group``,
    by a head split: all-to-all, attention on every position of 1/n of the heads, all-to-all back.
    ``rows_split``: the mask arrives split on its query rows (else it broadcasts along them).
    ``outer``: hybrid context parallel, (method, zigzag, axis, group) of a second split of the
    sequence, outside this one: after the all-to-all the rank holds every position of the outer
    piece, and meets the other outer pieces' keys by the ring or the all-gather
    (context/block_attention.cp_attention)."""
    group = list(group)
    n = len(group)
    t = kv_repeat(q.shape[-3], k.shape[-3], n)
    if t > 1:  # Megatron's repeat: each rank gets the K/V heads of its query heads
        k, v = k.repeat_interleave(t, dim=-3), v.repeat_interleave(t, dim=-3)
    heads = q.shape[-3]
    qh, kh, vh = (_to_heads(x, zigzag, axis, group, rank) for x in (q, k, v))
    m = _whole_mask(mask, rows_split, heads, zigzag, axis, group, rank)
    if outer is None and m is None:  # every position here: one block (causal: the kernel's triangle)
        out = BlockAttention.apply(qh, kh, vh, m, is_causal, scale, False, "ring", axis, [rank], rank)
    elif outer is None:  # a model's mask: key blocks of MASK_BLOCK, the ones it hides skipped
        blocks = _key_blocks(kh.shape[-2])
        out = BlockAttention.apply(qh, kh, vh, m, is_causal, scale, False, "allgather", axis, blocks, 0)
    else:
        method, outer_zigzag, outer_axis, outer_group = outer
        out = cp_attention(qh, kh, vh, m, is_causal, scale, False, method, outer_zigzag, outer_axis, outer_group, rank)
    return _to_positions(out, zigzag, axis, group, rank)
