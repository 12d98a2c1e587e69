"""Placements (R, S(d), P) and specs: how a global tensor is laid out on a mesh.

A spec holds one placement per mesh axis. ``Shard(d)`` splits tensor dim ``d`` over the
axis as ``torch.tensor_split`` does (rank k of the axis holds piece k; where the dim does not
divide, the first ``size % n`` ranks hold one row more, and a rank holds an empty piece when the
dim is smaller than the axis: see ``piece_sizes``), ``Replicate()`` keeps a full copy,
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
    """Every rank of the mesh axis holds the whole tensor (printed ``R``)."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "R"

    @classmethod
    def _parse(cls, text: str) -> "Replicate | None":
        return cls() if text == "R" else None


@dataclass(frozen=True)
class Shard(Placement):
    """Tensor dim ``dim`` split over a mesh axis (pieces as ``piece_sizes``: uneven where it
    does not divide).

    ``blocks > 1`` splits each of ``blocks`` equal consecutive blocks of the dim instead (each
    block must divide by the axis):
    rank k holds chunk k of every block, in block order. A fused projection (GPT-2's
    ``c_attn``: q | k | v along its output features) sharded so keeps whole heads of q, k
    and v on every rank, and splitting its output into the 3 blocks gives plain shards.

    ``of=(i, count)``: the tensor is item ``i`` of a list of ``count`` (one expert of a per-expert
    ``nn.ModuleList``) and the list is split over the axis: the rank whose share of the ``count``
    items (``count / n`` consecutive ones) holds item ``i`` keeps the whole tensor, every other
    rank an empty piece (dim ``dim`` of size 0). So a list of E experts' weights is stored E/n
    experts per rank under their own names, and merging the pieces gives the tensor back.

    ``within=k``: the axis' positions form groups of ``k`` consecutive ones (two axes merged into
    one, ``Mesh.merge_axes``: the inner axis' groups) and the dim is split within each group,
    every group holding the whole tensor: position c holds piece ``c % k`` of ``k`` (experts over
    the inner of two data-parallel axes, replicated over the outer). With ``of``, the item's
    owner is counted within the group the same way.

    ``across=k``: the other part of the same axis: the dim is split across the groups of ``k``
    consecutive positions, every position of a group holding the same piece: position c holds
    piece ``c // k`` of ``n / k`` (experts over the outer of two data-parallel axes, replicated
    over the inner; the ranks splitting it are ``k`` apart, a stride of ``k``).

    ``order="zigzag"``: the pieces are not contiguous ranges: the dim is cut into 2n chunks and
    rank k holds chunks k and 2n-1-k (``PIECE_ORDERS``; load-balanced context parallel). A
    redistribution between two orders is a step like any other (sharding/redistribute.py: the
    pieces gathered in one order, cut in the other); every collective joining or cutting ordered
    pieces permutes the dim around it (``PIECE_ORDERS``' pair). Printed ``S(1,zigzag)``.
    Propagation places the plain split; sharding/piece_order.py says which values hold which
    order, and the emitter redistributes between the ordered layouts.
    """

    dim: int
    blocks: int = 1
    of: tuple[int, int] | None = None
    within: int | None = None
    across: int | None = None
    order: str | None = None

    def __post_init__(self):
        if self.within and self.across:
            raise ShardingError(f"Shard({self.dim}): within= and across= name the two parts of an axis; give one.")
        if self.order is not None and self.order not in PIECE_ORDERS:
            raise ShardingError(
                f"Shard({self.dim}, order={self.order!r}): the orders of pieces are {sorted(PIECE_ORDERS)} "
                "(None: contiguous)."
            )
        if self.order is not None and (self.of is not None or self.grouped):
            raise ShardingError(f"Shard({self.dim}, order={self.order!r}): an order of pieces takes a plain split.")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    @property
    def grouped(self) -> int | None:
        """The size k of the groups of consecutive positions whose one part splits the dim
        (``within`` or ``across``), or None: the whole axis splits it."""
        return self.within or self.across

    @property
    def part(self) -> str | None:
        """The part of a merged axis that splits the dim: "inner" (``within``), "outer" (``across``)."""
        return "inner" if self.within else "outer" if self.across else None

    @property
    def replica_part(self) -> str | None:
        """The part of the axis the pieces are replicated over (the other one), or None."""
        return {"inner": "outer", "outer": "inner"}.get(self.part)

    def pieces(self, n: int) -> int:
        """How many pieces the dim is cut into on an axis of ``n`` positions."""
        return self.within or (n // self.across if self.across else n)

    def position(self, coord: int) -> int:
        """Which piece the rank at ``coord`` on the axis holds."""
        return coord % self.within if self.within else coord // self.across if self.across else coord

    def holder(self, piece: int) -> int:
        """The first position on the axis holding piece ``piece`` (the first group's, or its first rank)."""
        return piece * self.across if self.across else piece

    def counts(self, coord: int) -> bool:
        """Whether the rank at ``coord`` counts its piece in a whole-model sum (one of each piece's
        replicas: the first group's for ``within``, a group's first position for ``across``)."""
        return coord < self.within if self.within else coord % self.across == 0 if self.across else True

    def owner(self, n: int) -> int:
        """The piece (position, ``position``) holding the whole tensor of an ``of`` shard on an axis of ``n``."""
        i, count = self.of
        return i // (count // self.pieces(n))

    def __repr__(self) -> str:
        extra = f",within={self.within}" if self.within else f",across={self.across}" if self.across else ""
        if self.of is not None:
            return f"S({self.dim},of={self.of[0]}/{self.of[1]}{extra})"
        extra += f",{self.order}" if self.order else ""
        return (f"S({self.dim}" if self.blocks == 1 else f"S({self.dim},blocks={self.blocks}") + extra + ")"

    @classmethod
    def _parse(cls, text: str) -> "Shard | None":
        part = {}
        m = re.fullmatch(r"(.*),\s*(\w+)\)", text)
        if m and m.group(2) in PIECE_ORDERS:
            text, part = m.group(1) + ")", {"order": m.group(2)}
        m = re.fullmatch(r"(.*),\s*(within|across)=(\d+)\)", text)
        if m:
            text, part = m.group(1) + ")", {m.group(2): int(m.group(3))}
        m = re.fullmatch(r"S\((-?\d+),\s*of=(\d+)/(\d+)\)", text)
        if m:
            return cls(int(m.group(1)), of=(int(m.group(2)), int(m.group(3))), **part)
        m = re.fullmatch(r"S\((-?\d+)(?:,\s*blocks=(\d+))?\)", text)
        return cls(int(m.group(1)), int(m.group(2) or 1), **part) if m else None


@dataclass(frozen=True)
class Partial(Placement):
    """Each rank of the mesh axis holds a summand; the tensor is their sum (``reduce_op="avg"``: their
    mean). Printed ``P``: a row-parallel matmul's output before its all-reduce."""

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
    raise ShardingError(
        f"unknown placement {text!r}: expected R, S(d), S(d,blocks=k), S(d,of=i/n), S(d,within=k), S(d,across=k), P or P(avg)."
    )


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
            f *= p.pieces(size)
    return f


def counts_piece(placements, coords, skip_axes=()) -> bool:
    """Whether the rank at mesh ``coords`` counts its piece of a tensor laid out ``placements`` in
    a whole-model sum (gradient norm, parameter count): coordinate 0 on every axis that does not
    split it (those ranks hold the same values; split on a part of the axis: one replica of each
    piece, Shard.counts), except ``skip_axes`` (pieces differ there anyway)."""
    return all(
        (isinstance(p, Shard) and p.counts(coords[a])) or coords[a] == 0 or a in skip_axes
        for a, p in enumerate(placements)
    )


def piece_sizes(size: int, n: int) -> tuple[int, ...]:
    """The sizes of the ``n`` pieces of a dim of ``size`` rows, as ``torch.tensor_split`` cuts it:
    the first ``size % n`` pieces one row longer, empty pieces when ``size < n``.

    Example:
        >>> piece_sizes(6, 4), piece_sizes(66, 4), piece_sizes(2, 3)
        ((2, 2, 1, 1), (17, 17, 16, 16), (1, 1, 0))
    """
    q, r = divmod(int(size), n)
    return tuple(q + (k < r) for k in range(n))


def piece_size(size: int, n: int, k: int) -> int:
    """The size of piece ``k`` of ``n`` of a dim of ``size`` rows (an emitted program calls it
    with its coordinate on the axis: the same code on every rank, its own size)."""
    q, r = divmod(int(size), n)
    return q + (k < r)


def piece_start(size: int, n: int, k: int) -> int:
    """Where piece ``k`` of ``n`` starts in a dim of ``size`` rows (see piece_sizes)."""
    q, r = divmod(int(size), n)
    return k * q + min(k, r)


def is_uneven(size, n: int) -> bool:
    """A static dim of ``size`` rows split into ``n`` pieces that are not all the same size."""
    return isinstance(size, int) and n > 1 and size % n != 0


def uneven_dims(shape, placements, mesh) -> dict:
    """{dim: (size, axis)} of the dims ``placements`` split into pieces of different sizes."""
    out = {}
    for axis, p in enumerate(placements):
        owned = isinstance(p, Shard) and p.of is not None and mesh.shape[axis] > 1  # whole or empty
        if (
            isinstance(p, Shard)
            and p.dim < len(shape)
            and (owned or is_uneven(shape[p.dim], p.pieces(mesh.shape[axis])))
        ):
            out[p.dim] = (int(shape[p.dim]), axis)
    return out


def check_layout(shape, placements, mesh, what: str) -> None:
    """Raise ShardingError naming ``what`` if a layout cannot be cut: a dim that is not there, a
    dim split by two axes, or blocks (``Shard(d, blocks=k)``) that do not divide by the axis.
    A plain shard of any size is fine: its pieces are uneven where it does not divide."""
    used = {}
    for axis, (p, size) in enumerate(zip(placements, mesh.shape)):
        if not isinstance(p, Shard):
            continue
        if p.dim >= len(shape):
            raise ShardingError(
                f"{what}: placement {fmt_spec(placements)} shards dim {p.dim} "
                f"but the tensor has only {len(shape)} dims (shape {tuple(shape)})."
            )
        # an item of a split list (``of``) is whole or empty: it composes with one split of the same
        # dim on another axis (its owner holds that split's piece: a column bias of a tp-split expert)
        key = (p.dim, p.of is not None)
        if key in used:
            raise ShardingError(
                f"{what}: dim {p.dim} is sharded on two mesh axes "
                f"({mesh.axis_names[used[key]]!r} and {mesh.axis_names[axis]!r}); "
                "shard each dim on at most one axis."
            )
        used[key] = axis
        if p.grouped and (size % p.grouped or size == p.grouped):
            how = "within" if p.within else "across"
            raise ShardingError(
                f"{what}: placement {fmt_spec(placements)} splits {how} groups of {p.grouped} on mesh axis "
                f"{mesh.axis_names[axis]!r} of size {size}: the groups must divide the axis, and be smaller."
            )
        size = p.pieces(size)
        n = shape[p.dim]
        if isinstance(n, int) and p.blocks > 1 and n % (size * p.blocks):
            raise ShardingError(
                f"{what}: dim {p.dim} of shape {tuple(shape)} has size {n}: its {p.blocks} blocks "
                f"do not divide by the size {size} of mesh axis {mesh.axis_names[axis]!r}."
            )


def check_divisible(shape, placements, mesh, what: str) -> None:
    """check_layout, and every split dim must divide by its axis: for layouts whose pieces must be
    equal (expert weights: each rank runs E/n whole experts). Raises ShardingError naming ``what``."""
    check_layout(shape, placements, mesh, what)
    for axis, (p, size) in enumerate(zip(placements, mesh.shape)):
        n = shape[p.dim] if isinstance(p, Shard) else None
        size = p.pieces(size) if isinstance(p, Shard) else size
        if isinstance(n, int) and n % size:
            raise ShardingError(
                f"{what}: dim {p.dim} of shape {tuple(shape)} has size {n}, which does not divide "
                f"by the size {size} of mesh axis {mesh.axis_names[axis]!r}. Choose sizes divisible "
                f"by {size}, or leave this tensor replicated on {mesh.axis_names[axis]!r}."
            )


def local_shape(shape, placements, mesh, coords=None) -> tuple:
    """The shape of the piece at mesh ``coords`` (None: the largest piece, rank 0's)."""
    out = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim < len(out):
            k = 0 if coords is None else p.position(coords[axis])
            n = p.pieces(mesh.shape[axis])
            if p.of is not None:
                out[p.dim] = out[p.dim] if k == p.owner(n) else 0
            elif p.blocks > 1:
                out[p.dim] = p.blocks * piece_size(out[p.dim] // p.blocks, n, k)
            else:
                out[p.dim] = piece_size(out[p.dim], n, k)
    return tuple(out)


def narrow_piece(t: torch.Tensor, dim: int, n: int, k: int, blocks: int = 1) -> torch.Tensor:
    """Piece ``k`` of ``n`` of ``t``'s dim ``dim`` (a view; blocked: piece k of every block)."""
    parts = t.chunk(blocks, dim) if blocks > 1 else [t]
    size = parts[0].shape[dim]
    parts = [b.narrow(dim, piece_start(size, n, k), piece_size(size, n, k)) for b in parts]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def shard_tensor(full: torch.Tensor, placements, mesh, rank: int) -> torch.Tensor:
    """This rank's piece of ``full`` (a view where possible; Partial keeps it on the group's first rank;
    ``Shard.order``: the pieces of that order, a copy)."""
    coords = mesh.coords(rank)
    out = full
    for axis, p in enumerate(placements):
        if isinstance(p, Shard) and p.of is not None:
            mine = p.position(coords[axis]) == p.owner(mesh.shape[axis])
            out = out.narrow(p.dim, 0, out.shape[p.dim] if mine else 0)
        elif isinstance(p, Shard):
            if p.order is not None:  # the ranks' pieces one after the other, then cut plainly
                out = PIECE_ORDERS[p.order][0](out, p.dim, mesh.shape[axis], p.blocks)
            out = narrow_piece(out, p.dim, p.pieces(mesh.shape[axis]), p.position(coords[axis]), p.blocks)
        elif isinstance(p, Partial) and p.reduce_op == "sum" and coords[axis] != 0:
            out = torch.zeros_like(out)
    return out


def merge_tensors(pieces, placements, mesh) -> torch.Tensor:
    """The global tensor from every rank's piece (``pieces[rank]``): cat shards, sum partials."""

    def build(axis: int, coords: list[int]) -> torch.Tensor:
        if axis == mesh.ndim:
            return pieces[mesh.rank_of(coords)]
        p = placements[axis]
        if isinstance(p, Shard):  # split on a part of the axis: one holder of each piece
            at = [p.holder(k) for k in range(p.pieces(mesh.shape[axis]))]
        else:
            at = range(mesh.shape[axis])
        parts = [build(axis + 1, coords[:axis] + [k] + coords[axis + 1 :]) for k in at]
        if isinstance(p, Shard) and p.blocks > 1:  # rank k holds chunk k of every block
            per_rank = [t.chunk(p.blocks, p.dim) for t in parts]
            return torch.cat([r[b] for b in range(p.blocks) for r in per_rank], dim=p.dim)
        if isinstance(p, Shard) and p.order is not None:  # the ranks' pieces back in serial order
            return PIECE_ORDERS[p.order][1](torch.cat(parts, dim=p.dim), p.dim, len(parts))
        if isinstance(p, Shard):
            return torch.cat(parts, dim=p.dim)
        if isinstance(p, Partial):
            total = parts[0]
            for t in parts[1:]:
                total = total + t
            return total / len(parts) if p.reduce_op == "avg" else total
        return parts[0]

    return build(0, [0] * mesh.ndim)


# ------------------------------------------------------------------ orders of pieces
# A split dim's pieces are contiguous by default (rank k holds rows [k m, (k+1) m)). The zig-zag
# (head-tail) order cuts the dim into 2n equal chunks and gives rank r chunks r and 2n-1-r: under a
# causal mask every rank then gets the same work ((r + 1) + (2n - r) chunk-pairs), where contiguous
# pieces give rank r 2r + 1 (load-balanced context parallel asks for it on its axis). The functions
# below are that order's permutation: ``to_zigzag`` reorders a dim from the serial order to the
# ranks' pieces one after the other (so a plain contiguous cut gives every rank its two chunks),
# ``from_zigzag`` is its inverse; with ``blocks`` > 1 (a flattened (blocks, sequence) dim) each block
# is reordered on its own.
ZIGZAG = "zigzag"  # the name of the order (a technique's Technique.piece_order answers it)


def zigzag_index(size: int, n: int, blocks: int = 1, device=None) -> torch.Tensor:
    """Serial positions in zig-zag order (rank 0's rows, then rank 1's, ...).

    Example:
        >>> zigzag_index(8, 2)        # n=2: chunks 0, 3 | 1, 2 of size 2
        tensor([0, 1, 6, 7, 2, 3, 4, 5])
    """
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


# each order of pieces: (serial -> the ranks' pieces in rank order, its inverse), each taking
# (x, dim, n, blocks); a cut of the reordered dim gives every rank its pieces, and a concatenation
# of the ranks' pieces put back gives the serial order
PIECE_ORDERS = {ZIGZAG: (to_zigzag, from_zigzag)}
