"""Collectives with a gradient other than their dual's default.

``all_gather_rs``: all-gather forward, reduce-scatter backward. Megatron's sequence-parallel
pair: a sequence-split activation gathered into a column-parallel layer gets, from each
rank, only its own part of the gradient of the gathered tensor (each rank's layer holds
only some output features); summing those parts and keeping this rank's chunk is one
reduce-scatter. The plain all_gather's backward (a slice) expects whole gradients and
would need an all-reduce first: twice the bytes.

Example:
    >>> y = torch.ops.autopar.all_gather_rs(x, 1, "tp", [0, 1], 0)   # S(1) -> R, grads summed back
"""
from __future__ import annotations

import torch

from autopar.runtime.collectives import _G, _KERNELS, _call, _define, _gather_fake, all_gather


def all_gather_rs(x: torch.Tensor, dim: int, axis: str, group: list[int], rank: int) -> torch.Tensor:
    """S(dim) -> R forward; the backward reduce-scatters a partial gradient back to S(dim)."""
    return all_gather(x, dim, axis, group, rank)


def _all_gather_rs_bwd(ctx, g):
    return _call("reduce_scatter", g.contiguous(), ctx.dim, ctx.axis, ctx.group, ctx.rank, "sum"), \
        None, None, None, None


_KERNELS["all_gather_rs"] = all_gather_rs
_define("all_gather_rs", f"(Tensor x, int dim, {_G}) -> Tensor", all_gather_rs, _gather_fake,
        _all_gather_rs_bwd, ("dim", "axis", "group", "rank"))
