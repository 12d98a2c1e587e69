"""The device mesh: coordinates, groups, errors, DeviceMesh interop (without processes)."""

from __future__ import annotations

import pytest
import torch

import autopar as ap


def test_mesh_coords_and_groups():
    mesh = ap.Mesh((2, 4), ("dp", "tp"))
    assert mesh.size == 8 and mesh.coords(5) == (1, 1) and mesh.rank_of((1, 1)) == 5
    assert mesh.group("tp", 5) == (4, 5, 6, 7)
    assert mesh.group("dp", 5) == (1, 5)
    assert mesh.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    for shape in [(2,), (4,), (2, 2), (8,), (2, 2, 2)]:
        m = ap.Mesh(shape, tuple(f"x{i}" for i in range(len(shape))))
        assert [m.rank_of(m.coords(r)) for r in m.ranks()] == list(m.ranks())


def test_mesh_errors():
    with pytest.raises(ap.MeshError, match="one name per axis"):
        ap.Mesh((2, 2), ("dp",))
    with pytest.raises(ap.MeshError, match="Unknown mesh axis 'pt'.*'tp'"):
        ap.Mesh((2, 2), ("dp", "tp")).axis_index("pt")
    with pytest.raises(ap.MeshError, match="outside the mesh"):
        ap.Mesh((2,), ("tp",)).coords(2)


def test_mesh_from_device_mesh_like():
    class FakeDeviceMesh:
        mesh = torch.arange(8).view(2, 4)
        mesh_dim_names = ("dp", "tp")
        ndim = 2

    m = ap.Mesh.from_device_mesh(FakeDeviceMesh())
    assert m.shape == (2, 4) and m.axis_names == ("dp", "tp")
