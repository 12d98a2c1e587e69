"""The standard test meshes, by name, and the named sets the tests parametrize over.

Every mesh a test runs on is listed here once: (2,), (4,), (2, 2) and the 3-axis (2, 2, 2),
with the axis names and data-parallel axis each feature uses.

    >>> MESHES["dp2xtp2"].mesh()
    Mesh(dp=2, tp=2)
    >>> [MESHES[n].shape for n in TP]
    [(2,), (4,), (2, 2)]
"""

from __future__ import annotations

from dataclasses import dataclass

import autopar as ap


@dataclass(frozen=True)
class MeshSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    dp: str | None = None  # the data-parallel axis, if the mesh has one

    def mesh(self) -> ap.Mesh:
        return ap.Mesh(self.shape, self.axes)


MESHES = {
    # tensor parallel, and data parallel x tensor parallel
    "tp2": MeshSpec((2,), ("tp",)),
    "tp4": MeshSpec((4,), ("tp",)),
    "tp8": MeshSpec((8,), ("tp",)),
    "dp2xtp2": MeshSpec((2, 2), ("dp", "tp"), "dp"),
    # data parallel only
    "dp2": MeshSpec((2,), ("dp",), "dp"),
    "dp4": MeshSpec((4,), ("dp",), "dp"),
    "dp8": MeshSpec((8,), ("dp",), "dp"),
    # pipeline, alone and with the others; the 3-axis mesh (2, 2, 2)
    "pp2": MeshSpec((2,), ("pp",)),
    "pp4": MeshSpec((4,), ("pp",)),
    "pp2xtp2": MeshSpec((2, 2), ("pp", "tp")),
    "dp2xpp2": MeshSpec((2, 2), ("dp", "pp"), "dp"),
    "dp2xpp2xtp2": MeshSpec((2, 2, 2), ("dp", "pp", "tp"), "dp"),
}

TP = ("tp2", "tp4", "dp2xtp2")  # every tensor-parallel feature runs on these
DP = ("dp2", "dp4", "dp2xtp2")  # data parallel (with tp on the 2-axis one)
PP = ("pp2", "pp4", "pp2xtp2", "dp2xpp2", "dp2xpp2xtp2")

# Rule tests force layouts by hand, on axes with generic names.
RULE_MESHES = (MeshSpec((2,), ("a",)), MeshSpec((4,), ("a",)), MeshSpec((2, 2), ("a", "b")))


def mesh(name: str) -> ap.Mesh:
    """The ap.Mesh of a named mesh: ``mesh("tp2") == ap.Mesh((2,), ("tp",))``."""
    return MESHES[name].mesh()
