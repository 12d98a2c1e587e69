"""Mesh: an N-D grid of ranks with named axes, row-major like torch's DeviceMesh.

Example:
    >>> mesh = Mesh((2, 4), ("dp", "tp"))
    >>> mesh.coords(5)            # rank 5 sits at dp=1, tp=1
    (1, 1)
    >>> mesh.group("tp", 5)       # the ranks sharing rank 5's dp coordinate
    (4, 5, 6, 7)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.errors import MeshError, close_matches


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    def __init__(self, shape, axis_names):
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

    def axis_size(self, axis: str | int) -> int:
        return self.shape[self.axis_index(axis)]

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

    def group(self, axis: str | int, rank: int) -> tuple[int, ...]:
        """The ranks that share ``rank``'s coordinates except on ``axis``, in axis order."""
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
        return Mesh(shape, names)

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
