"""Placements (R, S(d), P) and specs: how a global tensor is laid out on a mesh.

A spec holds one placement per mesh axis. ``Shard(d)`` splits tensor dim ``d`` evenly
over the axis (rank k of the axis holds chunk k), ``Replicate()`` keeps a full copy,
``Partial("sum")`` means the global value is the sum (or average) of the ranks' values.
A tensor dim is split by at most one axis: nested splits are refused by propagation.

Example:
    >>> mesh = Mesh((2, 2), ("dp", "tp"))
    >>> spec = (Shard(0), Replicate())
    >>> local = shard_tensor(torch.arange(8.).view(4, 2), spec, mesh, rank=2)   # rows 2..3
    >>> merge_tensors([shard_tensor(t, spec, mesh, r) for r in mesh.ranks()], spec, mesh)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from autopar.errors import ShardingError


class Placement:
    """Base of R, S(d), P. Each kind owns its text form both ways: ``repr`` writes it,
    ``_parse`` reads it back (None when the text is another kind's); ``parse_placement``
    tries every kind, so plan files, the CLI and printed plans share one definition.
    """

    __slots__ = ()
    KINDS: list = []  # the placement classes, filled as each is defined

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        Placement.KINDS.append(cls)

    @classmethod
    def _parse(cls, text: str) -> "Placement | None":
        raise NotImplementedError

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Replicate(Placement):
    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "R"

    @classmethod
    def _parse(cls, text: str) -> "Replicate | None":
        return cls() if text == "R" else None


@dataclass(frozen=True)
class Shard(Placement):
    """Tensor dim ``dim`` split evenly over a mesh axis.

    ``blocks > 1`` splits each of ``blocks`` equal consecutive blocks of the dim instead:
    rank k holds chunk k of every block, in block order. A fused projection (GPT-2's
    ``c_attn``: q | k | v along its output features) sharded so keeps whole heads of q, k
    and v on every rank, and splitting its output into the 3 blocks gives plain shards.
    """

    dim: int
    blocks: int = 1

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim},blocks={self.blocks})"

    @classmethod
    def _parse(cls, text: str) -> "Shard | None":
        m = re.fullmatch(r"S\((-?\d+)(?:,\s*blocks=(\d+))?\)", text)
        return cls(int(m.group(1)), int(m.group(2) or 1)) if m else None


@dataclass(frozen=True)
class Partial(Placement):
    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op not in ("sum", "avg"):
            raise ShardingError(f"Partial({self.reduce_op!r}): only 'sum' and 'avg' are supported.")

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "P" if self.reduce_op == "sum" else f"P({self.reduce_op})"

    @classmethod
    def _parse(cls, text: str) -> "Partial | None":
        if text == "P":
            return cls()
        m = re.fullmatch(r"P\((\w+)\)", text)
        return cls(m.group(1)) if m else None


@dataclass(frozen=True)
class Annotation:
    """Base of what a user attaches to a module pattern (ap.colwise, ap.opaque, ...): an
    annotation turns a matched module into placements, or marks it for a stage of planning."""

    def describe(self) -> str:
        return repr(self)


def parse_placement(text: str) -> Placement:
    """The placement whose text (``repr``) is ``text``: ``"S(0,blocks=3)"`` -> ``Shard(0, blocks=3)``.

    Example:
        >>> parse_placement(repr(Shard(1, blocks=3))) == Shard(1, blocks=3)
        True
    """
    text = text.strip()
    for kind in Placement.KINDS:
        found = kind._parse(text)
        if found is not None:
            return found
    raise ShardingError(f"unknown placement {text!r}: expected R, S(d), S(d,blocks=k), P or P(avg).")


R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def fmt_spec(placements) -> str:
    """'(S(0), R)' style text for a tuple of placements."""
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def shard_factor(placements, mesh, dim: int) -> int:
    """How many pieces tensor dim ``dim`` is cut into (1 when no axis shards it)."""
    f = 1
    for p, size in zip(placements, mesh.shape):
        if isinstance(p, Shard) and p.dim == dim:
            f *= size
    return f


def counts_piece(placements, coords, skip_axes=()) -> bool:
    """Whether the rank at mesh ``coords`` counts its piece of a tensor laid out ``placements`` in
    a whole-model sum (gradient norm, parameter count): coordinate 0 on every axis that does not
    split it (those ranks hold the same values), except ``skip_axes`` (pieces differ there anyway)."""
    return all(isinstance(p, Shard) or coords[a] == 0 or a in skip_axes for a, p in enumerate(placements))


def check_divisible(shape, placements, mesh, what: str) -> None:
    """Raise ShardingError naming ``what`` if a sharded dim does not divide evenly."""
    used = {}
    for axis, (p, size) in enumerate(zip(placements, mesh.shape)):
        if not isinstance(p, Shard):
            continue
        if p.dim >= len(shape):
            raise ShardingError(
                f"{what}: placement {fmt_spec(placements)} shards dim {p.dim} "
                f"but the tensor has only {len(shape)} dims (shape {tuple(shape)})."
            )
        if p.dim in used:
            raise ShardingError(
                f"{what}: dim {p.dim} is sharded on two mesh axes "
                f"({mesh.axis_names[used[p.dim]]!r} and {mesh.axis_names[axis]!r}); "
                "shard each dim on at most one axis."
            )
        used[p.dim] = axis
        n = shape[p.dim]
        if isinstance(n, int) and p.blocks > 1 and n % (size * p.blocks):
            raise ShardingError(
                f"{what}: dim {p.dim} of shape {tuple(shape)} has size {n}: its {p.blocks} blocks "
                f"do not divide by the size {size} of mesh axis {mesh.axis_names[axis]!r}."
            )
        if isinstance(n, int) and n % size:
            raise ShardingError(
                f"{what}: dim {p.dim} of shape {tuple(shape)} has size {n}, which does not divide "
                f"by the size {size} of mesh axis {mesh.axis_names[axis]!r}. Choose sizes divisible "
                f"by {size}, or leave this tensor replicated on {mesh.axis_names[axis]!r}."
            )


def local_shape(shape, placements, mesh) -> tuple:
    """The shape of each rank's piece (even sharding: every rank's is the same)."""
    return tuple(n // shard_factor(placements, mesh, d) for d, n in enumerate(shape))


def shard_tensor(full: torch.Tensor, placements, mesh, rank: int) -> torch.Tensor:
    """This rank's piece of ``full`` (a view where possible; Partial keeps it on the group's first rank)."""
    coords = mesh.coords(rank)
    out = full
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            size = mesh.shape[axis]
            parts = out.chunk(p.blocks, p.dim) if p.blocks > 1 else [out]
            n = parts[0].shape[p.dim] // size
            parts = [b.narrow(p.dim, coords[axis] * n, n) for b in parts]
            out = parts[0] if len(parts) == 1 else torch.cat(parts, p.dim)
        elif isinstance(p, Partial) and p.reduce_op == "sum" and coords[axis] != 0:
            out = torch.zeros_like(out)
    return out


def merge_tensors(pieces, placements, mesh) -> torch.Tensor:
    """The global tensor from every rank's piece (``pieces[rank]``): cat shards, sum partials."""

    def build(axis: int, coords: list[int]) -> torch.Tensor:
        if axis == mesh.ndim:
            return pieces[mesh.rank_of(coords)]
        parts = [build(axis + 1, coords[:axis] + [k] + coords[axis + 1 :]) for k in range(mesh.shape[axis])]
        p = placements[axis]
        if isinstance(p, Shard) and p.blocks > 1:  # rank k holds chunk k of every block
            per_rank = [t.chunk(p.blocks, p.dim) for t in parts]
            return torch.cat([r[b] for b in range(p.blocks) for r in per_rank], dim=p.dim)
        if isinstance(p, Shard):
            return torch.cat(parts, dim=p.dim)
        if isinstance(p, Partial):
            total = parts[0]
            for t in parts[1:]:
                total = total + t
            return total / len(parts) if p.reduce_op == "avg" else total
        return parts[0]

    return build(0, [0] * mesh.ndim)
