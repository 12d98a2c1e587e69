"""Where a rank's piece of a tensor sits in the global (serial) tensor, as boxes.

A box is (global offsets, sizes, view): a rectangular region of the global tensor and the
view of the rank's local storage that holds it. A plain shard is one box; a blocked shard
``Shard(d, blocks=k)`` is k boxes along dim d (rank c holds chunk c of every block); a
ZeRO piece (a contiguous range of the flattened local tensor) is a few boxes (a partial
row, whole rows, a partial row, recursively). Checkpoints describe every piece this way,
so any layout reshards against any other through DCP's chunk overlap.

Example:
    >>> boxes = local_boxes((8, 4), (Shard(0, blocks=2),), Mesh((2,), ("tp",)), 1, local)
    >>> [(off, size) for off, size, _ in boxes]     # rows 2-3 and 6-7
    [((2, 0), (2, 4)), ((6, 0), (2, 4))]
"""

from __future__ import annotations

import itertools

import torch

from autopar.placement import Shard, piece_size, piece_start


def dim_segments(shape, spec, mesh, rank) -> list[list[tuple[int, int, int]]]:
    """Per dim: (global offset, local offset, length) of each run the rank holds, in order."""
    coords = mesh.coords(rank)
    segs = [[(0, 0, n)] for n in shape]
    empty = set()  # dims of an item of a split list this rank does not hold
    for axis, p in enumerate(spec):
        if not isinstance(p, Shard):
            continue
        # split on a part of the axis (Shard.within / across): the piece of the rank's position on that part
        n, size, k, c = shape[p.dim], mesh.shape[axis], p.blocks, p.position(coords[axis])
        if p.of is not None:  # one item of a list split over the axis: whole on its owner, empty elsewhere
            if c != p.owner(size):  # (on its owner, a split of the same dim on another axis still cuts it)
                empty.add(p.dim)
            continue
        size = p.pieces(size)
        block = n // k  # uneven pieces: torch.tensor_split's (placement.piece_start / piece_size)
        start, piece = piece_start(block, size, c), piece_size(block, size, c)
        segs[p.dim] = [(b * block + start, b * piece, piece) for b in range(k)]
    for d in empty:
        segs[d] = [(0, 0, 0)]
    return segs


def region_boxes(segs, lo, sizes, view):
    """Split a local region (offsets ``lo``, ``sizes``, data ``view``) along the runs of every
    dim: one (global offsets, sizes, view) per product of the runs it crosses."""
    per_dim = []
    for d, runs in enumerate(segs):
        parts = []
        a, b = lo[d], lo[d] + sizes[d]
        for g, l0, length in runs:
            s, e = max(a, l0), min(b, l0 + length)
            if s < e:
                parts.append((g + s - l0, s - a, e - s))
        per_dim.append(parts)
    out = []
    for combo in itertools.product(*per_dim):
        v = view
        for d, (_g, off, length) in enumerate(combo):
            v = v.narrow(d, off, length)
        out.append((tuple(c[0] for c in combo), tuple(c[2] for c in combo), v))
    return out


def local_boxes(shape, spec, mesh, rank, local: torch.Tensor):
    """The boxes of ``rank``'s whole local tensor ``local`` (local shape) of a global ``shape``."""
    segs = dim_segments(shape, spec, mesh, rank)
    return region_boxes(segs, (0,) * len(shape), tuple(local.shape), local)


def flat_range_boxes(shape, spec, mesh, rank, start: int, flat: torch.Tensor):
    """The boxes of a contiguous 1-D range ``flat`` that starts at element ``start`` of the
    flattened local tensor (a ZeRO piece)."""
    segs = dim_segments(shape, spec, mesh, rank)
    lshape = tuple(sum(r[2] for r in runs) for runs in segs)
    out = []
    for lo, sizes, a in _range_regions(lshape, start, start + flat.numel()):
        region = flat[a - start : a - start + _prod(sizes)].view(sizes)
        out += region_boxes(segs, lo, sizes, region)
    return out


def _range_regions(shape, a: int, b: int):
    """Elements [a, b) of a row-major tensor of ``shape`` as contiguous boxes (lo, sizes, first)."""
    if a >= b:
        return []
    if len(shape) == 0:
        return [((), (), a)]
    inner = _prod(shape[1:])
    r0, r1 = a // inner, b // inner
    out = []
    if a % inner:  # a partial first row
        end = min(b, (r0 + 1) * inner)
        out += _shift(r0, _range_regions(shape[1:], a - r0 * inner, end - r0 * inner), r0 * inner)
        a, r0 = end, r0 + 1
    if r0 < r1:  # whole rows
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:]), r0 * inner))
        a = r1 * inner
    if a < b:  # a partial last row
        out += _shift(r1, _range_regions(shape[1:], a - r1 * inner, b - r1 * inner), r1 * inner)
    return out


def _shift(row: int, regions, base: int):
    return [((row,) + lo, (1,) + sizes, base + first) for lo, sizes, first in regions]


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out
