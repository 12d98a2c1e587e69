"""Local tensor math shared by the backends: a rank's position in a group, its chunk of a
tensor, and what all-to-all hands it.

Example:
    >>> chunk_of(torch.arange(8), 0, 4, 1)          # tensor([2, 3])
"""

from __future__ import annotations

import torch


def _pos(group, rank) -> int:
    return list(group).index(rank)


def chunk_of(full: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    size = full.shape[dim] // n
    return full.narrow(dim, index * size, size)


def all_to_all_local(pieces: list[torch.Tensor], src_dim: int, dst_dim: int, index: int) -> torch.Tensor:
    """What rank ``index`` of a group gets from all_to_all, given every rank's piece."""
    n = len(pieces)
    return torch.cat([chunk_of(p, dst_dim, n, index) for p in pieces], dim=src_dim)
