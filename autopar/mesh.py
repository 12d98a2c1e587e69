"""Mesh: an N-D grid of ranks with named axes, row-major like torch's DeviceMesh.

Example:
    >>> mesh = Mesh((2, 4), ("dp", "tp"))
    >>> mesh.coords(5)            # rank 5 sits at dp=1, tp=1
    (1, 1)
    >>> mesh.group("tp", 5)       # the ranks sharing rank 5's dp coordinate
    (4, 5, 6, 7)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from autopar.errors import MeshError, close_matches


@dataclass(frozen=True)
class SubAxis:
    """Part of mesh axis ``axis`` whose n positions form groups of ``within`` consecutive ones
    (two axes merged by ``Mesh.merge_axes``: the inner axis' groups). ``part="inner"``: the
    positions of one group (those sharing ``position // within``: the inner axis);
    ``"outer"``: the positions that agree modulo ``within`` (the outer axis, across groups).
    ``name``: what explain and the collectives call it (the merged axis' own name).

    Example:
        >>> mesh = Mesh((2, 2), ("a", "b")).merge_axes("a", "b")
        >>> mesh.group(SubAxis(0, 2, "inner", "b"), 3), mesh.group(SubAxis(0, 2, "outer", "a"), 3)
        ((2, 3), (1, 3))
    """

    axis: int
    within: int
    part: str = "inner"
    name: str = ""

    def size(self, n: int) -> int:
        """Its size on an axis of ``n`` positions."""
        return self.within if self.part == "inner" else n // self.within

    def position(self, coord: int) -> int:
        """A coordinate on the whole axis -> the position on this part."""
        return coord % self.within if self.part == "inner" else coord // self.within


@dataclass(frozen=True)
class Mesh:
    """An N-D grid of ranks with named axes; ranks are numbered row-major.

    Example:
        >>> mesh = Mesh((2, 2), ("dp", "tp"))
        >>> mesh.size, mesh.coords(3), mesh.group("tp", 3), mesh.groups("tp")
        (4, (1, 1), (2, 3), [(0, 1), (2, 3)])

    ``Mesh.from_device_mesh(dm)`` and ``mesh.to_device_mesh()`` convert to and from torch's DeviceMesh.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    # axes made of two by merge_axes: (merged name, outer name, inner name, inner size), for
    # annotations that name one of the two (experts split on a sub-axis of data parallelism)
    parts: tuple = field(default=(), compare=False, repr=False)

    def __init__(self, shape, axis_names, parts=()):
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        if len(shape) != len(names):
            raise MeshError(
                f"Mesh shape {shape} has {len(shape)} axes but {len(names)} names "
                f"{names} were given: give one name per axis, e.g. Mesh((2, 2), ('dp', 'tp'))."
            )
        if len(set(names)) != len(names):
            raise MeshError(f"Mesh axis names {names} repeat a name: each axis needs its own.")
        if not shape or any(s < 1 for s in shape):
            raise MeshError(f"Mesh shape {shape} must have at least one axis and only sizes >= 1.")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "parts", tuple(parts))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def axis_index(self, axis: str | int) -> int:
        """The position of ``axis`` (a name or an index) in the mesh."""
        if isinstance(axis, int) and 0 <= axis < self.ndim:
            return axis
        if axis in self.axis_names:
            return self.axis_names.index(axis)
        raise MeshError(
            f"Unknown mesh axis {axis!r}: this mesh has axes {self.axis_names}. "
            f"Did you mean {close_matches(str(axis), self.axis_names)}?"
        )

    def axis_size(self, axis) -> int:
        """The number of positions of ``axis`` (a name, an index or a SubAxis)."""
        if isinstance(axis, SubAxis):
            return axis.size(self.shape[axis.axis])
        return self.shape[self.axis_index(axis)]

    def axis_label(self, axis) -> str:
        """The name of ``axis`` (an index, a SubAxis, or a tuple of indices: one group over
        several axes, labelled by the product of their sizes, ``"dp*cp"``) as explain and the
        collectives show it."""
        if isinstance(axis, SubAxis):
            return axis.name or f"{self.axis_names[axis.axis]}/{axis.part}{axis.within}"
        if isinstance(axis, tuple):
            return "*".join(self.axis_names[self.axis_index(a)] for a in axis)
        return self.axis_names[axis]

    def part(self, axis: int, within: int, part: str = "inner") -> SubAxis:
        """The SubAxis of ``axis`` in groups of ``within``, named after the axis merged there if any."""
        name = next(
            (p[2] if part == "inner" else p[1] for p in self.parts if p[0] == self.axis_names[axis] and p[3] == within),
            "",
        )
        return SubAxis(axis, within, part, name)

    def sub_axis(self, name) -> tuple[int, SubAxis | None]:
        """(the mesh axis, the part of it or None for all of it) that ``name`` means: a mesh axis,
        one of the two axes merged into one (``merge_axes``), or the tuple of those two.

        Example:
            >>> Mesh((2, 2), ("a", "b")).merge_axes("a", "b").sub_axis("b")
            (0, SubAxis(axis=0, within=2, part='inner', name='b'))
        """
        for merged, outer, inner, size in self.parts:
            if merged not in self.axis_names:
                continue
            i = self.axis_names.index(merged)
            if name in (inner, outer):
                return i, SubAxis(i, size, "inner" if name == inner else "outer", name)
            if isinstance(name, (tuple, list)) and tuple(name) == (outer, inner):
                return i, None
        if isinstance(name, (tuple, list)):
            raise MeshError(
                f"Axes {tuple(name)} of {self} are not one data-parallel axis: name a mesh axis, or two axes "
                "merged by DataParallel(axis, replicate_axis=...) as (replicate_axis, axis)."
            )
        return self.axis_index(name), None

    def check_rank(self, rank: int) -> int:
        if not isinstance(rank, int) or not 0 <= rank < self.size:
            raise MeshError(f"Rank {rank!r} is outside the mesh {self}: ranks are 0..{self.size - 1}.")
        return rank

    def coords(self, rank: int) -> tuple[int, ...]:
        """The coordinates of ``rank`` on each axis (row-major: the last axis varies fastest)."""
        rank = self.check_rank(rank)
        out = []
        for s in reversed(self.shape):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def rank_of(self, coords) -> int:
        rank = 0
        for c, s in zip(coords, self.shape):
            rank = rank * s + c
        return rank

    def group(self, axis, rank: int) -> tuple[int, ...]:
        """The ranks that share ``rank``'s coordinates except on ``axis``, in axis order (a
        SubAxis: those of the whole axis' group on the same part; a tuple of axes: those that
        differ only on them, row-major over them, as ``merge_axes`` would order them).

        Example:
            >>> Mesh((2, 2, 2), ("dp", "cp", "tp")).group(("dp", "cp"), 1)
            (1, 3, 5, 7)
        """
        if isinstance(axis, tuple):
            idx, c, out = [self.axis_index(a) for a in axis], list(self.coords(rank)), []
            for pos in itertools.product(*(range(self.shape[i]) for i in idx)):  # the last fastest
                for i, k in zip(idx, pos):
                    c[i] = k
                out.append(self.rank_of(c))
            return tuple(out)
        if isinstance(axis, SubAxis):
            whole, c = self.group(axis.axis, rank), self.coords(rank)[axis.axis]
            other = SubAxis(axis.axis, axis.within, "outer" if axis.part == "inner" else "inner")
            return tuple(r for k, r in enumerate(whole) if other.position(k) == other.position(c))
        i = self.axis_index(axis)
        c = list(self.coords(rank))
        out = []
        for k in range(self.shape[i]):
            c[i] = k
            out.append(self.rank_of(c))
        return tuple(out)

    def groups(self, axis: str | int) -> list[tuple[int, ...]]:
        """Every group along ``axis``, each once, ordered by their first rank."""
        seen = {self.group(axis, r) for r in range(self.size)}
        return sorted(seen)

    def ranks(self):
        return range(self.size)

    def merge_axes(self, outer: str, inner: str) -> "Mesh":
        """The same ranks with two adjacent axes (``outer`` right before ``inner``) as one axis
        named ``outer_inner``: in row-major order its position is outer * |inner| + inner, so
        every rank keeps its number and groups of |inner| consecutive positions are ``inner``'s
        groups.

        Example:
            >>> Mesh((2, 2, 2), ("rep", "shard", "tp")).merge_axes("rep", "shard")
            Mesh(rep_shard=4, tp=2)
        """
        i, j = self.axis_index(outer), self.axis_index(inner)
        if j != i + 1:
            raise MeshError(
                f"Axes {outer!r} and {inner!r} of {self} must be adjacent with {outer!r} first to act as "
                f"one axis (e.g. Mesh((r, s, t), ({outer!r}, {inner!r}, 'tp')))."
            )
        shape = self.shape[:i] + (self.shape[i] * self.shape[j],) + self.shape[j + 1 :]
        names = self.axis_names[:i] + (f"{outer}_{inner}",) + self.axis_names[j + 1 :]
        parts = (*self.parts, (f"{outer}_{inner}", self.axis_names[i], self.axis_names[j], self.shape[j]))
        return Mesh(shape, names, parts)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"Mesh({inner})"

    # -- torch DeviceMesh interop -------------------------------------------------------
    @classmethod
    def from_device_mesh(cls, device_mesh) -> "Mesh":
        """The autopar mesh with the same shape and axis names as a torch DeviceMesh."""
        names = device_mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(device_mesh.ndim))
        ranks = device_mesh.mesh.flatten().tolist()
        if ranks != list(range(len(ranks))):
            raise MeshError(
                f"DeviceMesh {device_mesh} does not hold ranks 0..{len(ranks) - 1} in "
                "row-major order; autopar needs that layout."
            )
        return cls(tuple(device_mesh.mesh.shape), names)

    def to_device_mesh(self, device_type: str = "cpu"):
        """A torch DeviceMesh of this shape (needs an initialised process group of this size)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.axis_names)
