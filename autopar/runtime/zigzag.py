"""The head-tail (zig-zag) order of a dim split on a context-parallel axis (load balancing).

Cut a dim into 2n equal chunks; rank r of the n ranks holds chunks r and 2n-1-r. Under a causal
mask, chunk i's queries see i+1 chunks of keys, so every rank gets (r + 1) + (2n - r) = 2n + 1
chunk-pairs of work: the same on every rank, where contiguous pieces give rank r 2r + 1 (x 4).
``to_zigzag`` reorders a dim from the serial order to the ranks' pieces one after the other (so a
plain contiguous cut gives every rank its two chunks); ``from_zigzag`` is its inverse. With
``blocks`` > 1 (a flattened (blocks, sequence) dim) each block is reordered on its own.

Example:
    >>> zigzag_index(8, 2)        # n=2: chunks 0, 3 | 1, 2 of size 2
    tensor([0, 1, 6, 7, 2, 3, 4, 5])
"""

from __future__ import annotations

import torch


def zigzag_index(size: int, n: int, blocks: int = 1, device=None) -> torch.Tensor:
    """Serial positions in zig-zag order (rank 0's rows, then rank 1's, ...)."""
    size = int(size)
    m = size // blocks
    if m % (2 * n):
        raise ValueError(
            f"load-balanced context parallel: a dim of {m} rows (per block) does not cut into 2 x {n} = {2 * n} "
            f"equal chunks; use sizes (sequence, and batch where labels are regrouped) that divide by {2 * n}."
        )
    order = [c for r in range(n) for c in (r, 2 * n - 1 - r)]
    idx = torch.arange(m, device=device).view(2 * n, m // (2 * n))[order].flatten()
    if blocks > 1:
        idx = (torch.arange(blocks, device=device)[:, None] * m + idx[None, :]).flatten()
    return idx


def to_zigzag(x: torch.Tensor, dim: int, n: int, blocks: int = 1) -> torch.Tensor:
    """``x`` with dim ``dim`` in zig-zag order (serial -> the ranks' pieces in rank order)."""
    return x.index_select(dim, zigzag_index(x.shape[dim], n, blocks, x.device))


def from_zigzag(x: torch.Tensor, dim: int, n: int, blocks: int = 1) -> torch.Tensor:
    """The inverse of ``to_zigzag``: the ranks' pieces, concatenated in rank order, in serial order."""
    return x.index_select(dim, torch.argsort(zigzag_index(x.shape[dim], n, blocks, x.device)))


def local_positions(n_local: int, n: int, coord: int, zigzag: bool, device=None) -> torch.Tensor:
    """Serial positions of the ``n_local`` rows rank ``coord`` of ``n`` holds of a split dim."""
    if not zigzag:
        return torch.arange(coord * n_local, (coord + 1) * n_local, device=device)
    c = n_local // 2
    return torch.cat(
        (
            torch.arange(coord * c, (coord + 1) * c, device=device),
            torch.arange((2 * n - 1 - coord) * c, (2 * n - coord) * c, device=device),
        )
    )


def triangular_zigzag(x: torch.Tensor, dim: int, diagonal: int, n: int, coord: int, upper: bool) -> torch.Tensor:
    """tril (or triu) of the rank's zig-zag piece of ``x``, split on ``dim`` (one of the last two):
    element (i, j) is kept iff j - i <= diagonal (triu: >=) at the rows' and columns' serial positions."""
    nd = x.dim()
    rows, cols = x.shape[-2], x.shape[-1]
    rp = local_positions(rows, n, coord, True, x.device) if dim == nd - 2 else torch.arange(rows, device=x.device)
    cp = local_positions(cols, n, coord, True, x.device) if dim == nd - 1 else torch.arange(cols, device=x.device)
    d = cp[None, :] - rp[:, None]
    keep = d >= diagonal if upper else d <= diagonal
    return torch.where(keep, x, torch.zeros_like(x))
