"""Mesh, placements, redistribution plans and the simulator, without models."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.runtime.collectives import use_backend
from autopar.placement import Partial, Replicate, Shard, merge_tensors, shard_tensor
from autopar.sharding.redistribute import Step, plan_steps, step_bytes
from autopar.runtime.simulator import SimBackend, SimulationError, run_ranks

R, S, P = Replicate(), Shard, Partial()
ops = torch.ops.autopar


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


def test_placement_reprs():
    assert repr(R) == "R" and repr(S(0)) == "S(0)" and repr(P) == "P" and repr(Partial("avg")) == "P(avg)"


@pytest.mark.parametrize("shape,spec", [((2,), (S(0),)), ((4,), (S(1),)), ((2, 2), (S(1), S(0))),
                                        ((2, 2), (R, S(1))), ((8,), (S(0),)), ((2, 2), (P, S(0)))])
def test_shard_merge_round_trip(shape, spec):
    mesh = ap.Mesh(shape, tuple(f"x{i}" for i in range(len(shape))))
    full = torch.randn(8, 8)
    pieces = [shard_tensor(full, spec, mesh, r) for r in mesh.ranks()]
    torch.testing.assert_close(merge_tensors(pieces, spec, mesh), full)


def test_redistribution_steps():
    assert plan_steps((S(0),), (R,)) == [Step("all_gather", 0, 0)]
    assert plan_steps((P,), (R,)) == [Step("all_reduce", 0, op="sum")]
    assert plan_steps((P,), (S(1),)) == [Step("reduce_scatter", 0, 1, op="sum")]
    assert plan_steps((S(0),), (S(1),)) == [Step("all_to_all", 0, 0, 1)]
    assert plan_steps((R,), (S(1),)) == [Step("slice", 0, 1)]
    assert plan_steps((R,), (P,)) == [Step("to_partial", 0, op="sum")]
    # moving a split from one axis to another never splits a dim on two axes at once
    assert plan_steps((S(0), R), (R, S(0))) == [Step("all_gather", 0, 0), Step("slice", 1, 0)]
    assert step_bytes(Step("all_reduce", 0), 100.0, 4) == pytest.approx(150.0)


SPECS = [R, S(0), S(1), P]


@pytest.mark.parametrize("src", SPECS)
@pytest.mark.parametrize("dst", [R, S(0), S(1)])
@pytest.mark.parametrize("n", [2, 4])
def test_every_redistribution_forward_and_backward(src, dst, n):
    """Run the emitted steps in the simulator: values and gradients equal the global math."""
    mesh = ap.Mesh((n,), ("a",))
    full = torch.randn(8, 4, dtype=torch.float64)
    weight = torch.randn(8, 4, dtype=torch.float64)
    pieces = [shard_tensor(full, (src,), mesh, r).clone().requires_grad_() for r in range(n)]
    steps = plan_steps((src,), (dst,))

    def run(rank):
        x, group = pieces[rank], [*range(n)]
        for st in steps:
            if st.kind == "all_gather":
                x = ops.all_gather(x, st.dim, "a", group, rank)
            elif st.kind == "all_reduce":
                x = ops.all_reduce(x, "a", group, rank, st.op)
            elif st.kind == "reduce_scatter":
                x = ops.reduce_scatter(x, st.dim, "a", group, rank, st.op)
            elif st.kind == "all_to_all":
                x = ops.all_to_all(x, st.dim, st.dim2, "a", group, rank)
            elif st.kind == "slice":
                x = ops.shard(x, st.dim, "a", group, rank)
        local_w = shard_tensor(weight, (dst,), mesh, rank)
        (x * local_w).sum().backward()  # objective sum(full * weight), in parts on split dims
        return x.detach()
    outs = run_ranks(n, run)
    torch.testing.assert_close(merge_tensors(outs, (dst,), mesh), full)
    # Gradient of the one objective sum(full * weight) is weight, held as the source layout
    # holds gradients ("whole" convention): a shard its piece, R and P the whole of it.
    grads = [p.grad for p in pieces]
    expect = [shard_tensor(weight, (src,), mesh, r) if src.is_shard() else weight for r in range(n)]
    for g, e in zip(grads, expect):
        torch.testing.assert_close(g, e)


def test_simulator_rank_failure_does_not_hang():
    def step(rank):
        if rank == 1:
            raise ValueError("boom on purpose")
        return ops.all_reduce(torch.ones(2), "a", [0, 1, 2], rank, "sum")
    with pytest.raises(SimulationError, match="rank 1 failed: ValueError: boom on purpose"):
        run_ranks(3, step, timeout=20)


def test_simulator_timeout_names_missing_ranks():
    def step(rank):
        if rank == 0:
            return ops.all_reduce(torch.ones(2), "a", [0, 1], rank, "sum")
        return None  # rank 1 never joins
    with pytest.raises(SimulationError, match=r"waited 1 s for ranks \[1\]"):
        run_ranks(2, step, timeout=1)


def test_collective_without_backend_explains():
    with pytest.raises(RuntimeError, match="No autopar collective backend"):
        ops.all_reduce(torch.ones(2), "a", [0, 1], 0, "sum")


def test_sim_backend_all_to_all_matches_definition():
    backend = SimBackend(2)
    full = torch.arange(16.).view(4, 4)
    with use_backend(backend):
        outs = run_ranks(2, lambda r: ops.all_to_all(full.chunk(2, 0)[r], 0, 1, "a", [0, 1], r), backend=backend)
    torch.testing.assert_close(outs[0], full[:, :2])
    torch.testing.assert_close(outs[1], full[:, 2:])
