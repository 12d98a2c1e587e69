"""Uneven pieces through equal-size collectives: pad before, trim after, in the program.

A dim of ``size`` rows split over ``n`` ranks has pieces as ``torch.tensor_split`` cuts it
(placement.piece_sizes: the first ``size % n`` one row longer). All-gather, reduce-scatter
and all-to-all move equal pieces (gloo and NCCL need them), so an uneven dim travels in its
*padded layout*: ``n * c`` rows (``c``, the largest piece), piece k at rows ``[k*c, k*c + L_k)``,
zeros after it. Every function here is plain torch code, so autograd derives the backward
(a trim's gradient is a pad and the other way round) and the collectives' own gradients stay
the even ones.

Example:
    >>> x = torch.arange(6.)                           # pieces 2, 2, 1, 1 on 4 ranks
    >>> to_padded(x, 0, 6, 4)                          # tensor([0, 1, 2, 3, 4, 0, 5, 0])
    >>> from_padded(to_padded(x, 0, 6, 4), 0, 6, 4)    # x again
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.runtime.eager import eager
from autopar.placement import piece_size


def pad_piece(x: torch.Tensor, dim: int, rows: int, value: float = 0.0) -> torch.Tensor:
    """``x`` with rows of ``value`` appended on ``dim`` up to ``rows`` (a short piece made the
    largest's size; ``x`` itself when it has as many already)."""
    extra = rows - x.shape[dim]
    if extra <= 0:
        return x
    return F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, extra], value=value)


def to_padded(x: torch.Tensor, dim: int, size: int, n: int) -> torch.Tensor:
    """A whole dim of ``size`` rows in its padded layout (``n * c`` rows)."""
    q, r = divmod(size, n)
    c = q + (r > 0)
    head = x.narrow(dim, 0, r * c)
    tail = x.narrow(dim, r * c, (n - r) * q).unflatten(dim, (n - r, q))
    tail = pad_piece(tail, dim + 1, c).flatten(dim, dim + 1)
    return torch.cat([head, tail], dim)


def from_padded(x: torch.Tensor, dim: int, size: int, n: int) -> torch.Tensor:
    """The whole dim of ``size`` rows back from its padded layout (what all-gather of padded pieces gives)."""
    q, r = divmod(size, n)
    c = q + (r > 0)
    head = x.narrow(dim, 0, r * c)
    tail = x.narrow(dim, r * c, (n - r) * c).unflatten(dim, (n - r, c)).narrow(dim + 1, 0, q)
    return torch.cat([head, tail.flatten(dim, dim + 1)], dim)


def trim_piece(x: torch.Tensor, dim: int, size: int, n: int, k: int) -> torch.Tensor:
    """Piece ``k``'s rows of a padded piece (``c`` rows, this rank's first)."""
    return x.narrow(dim, 0, piece_size(size, n, k))


# ------------------------------------------------ weights of uneven pieces in averages
def piece_share(size: int, n: int, k: int) -> float:
    """Piece ``k``'s share of a dim of ``size`` rows cut in ``n`` (its rows / all rows)."""
    return piece_size(size, n, k) / size if size else 0.0


@eager
def ragged_share(x: torch.Tensor, dim: int, axis: str, group: list[int], rank: int) -> float:
    """This rank's share of the rows of ``x``'s dim ``dim``, split over ``group`` in pieces of any
    size (a batch cut unevenly at run time): its rows over the sum of every rank's (one
    all-reduce of one number). Run eagerly under torch.compile (a graph break): the count is a
    Python number the compiled graph takes as an input, not a value to trace."""
    rows = torch.tensor([float(x.shape[dim])], device=x.device)
    total = torch.ops.autopar.all_reduce(rows, axis, list(group), rank, "sum")
    total = float(total.item())
    return x.shape[dim] / total if total else 0.0


@eager
def ragged_total(x: torch.Tensor, dim: int, axis: str, group: list[int], rank: int) -> int:
    """The whole size of ``x``'s dim ``dim``, cut in pieces of any size over ``group`` (a batch cut
    unevenly at run time): the sum of every rank's rows (one all-reduce of one number)."""
    rows = torch.tensor([float(x.shape[dim])], device=x.device)
    return int(torch.ops.autopar.all_reduce(rows, axis, list(group), rank, "sum").item())


@eager
def ragged_all_gather(gather, x: torch.Tensor, dim: int, axis: str, group: list[int], rank: int) -> torch.Tensor:
    """``gather`` (an all-gather op: S(dim) -> R) of pieces whose sizes only their own ranks know
    (a batch cut unevenly at run time): the sizes exchanged first (one all-gather of one number
    per rank), then every piece padded to the largest, gathered, and each cut back to its size.
    Pads, narrows and the cat are plain torch ops, so autograd hands each rank the gradient of its
    own rows through the gather's own backward. Eager under torch.compile, as ``ragged_share``."""
    rows = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
    sizes = [int(v) for v in torch.ops.autopar.all_gather(rows, 0, axis, list(group), rank).tolist()]
    c = max(sizes)
    full = gather(pad_piece(x, dim, c), dim, axis, list(group), rank)
    return torch.cat([full.narrow(dim, k * c, n) for k, n in enumerate(sizes)], dim)


def weigh(x: torch.Tensor, weight: float) -> torch.Tensor:
    """``x * weight``; zeros where the weight is 0 (an empty piece's mean is nan, and counts nothing)."""
    return x * weight if weight else torch.zeros_like(x)
