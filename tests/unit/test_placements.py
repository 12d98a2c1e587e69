"""Placements without models: shard and merge, redistribution plans, and every redistribution
run in the simulator (values and gradients equal the global math)."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.placement import Partial, Replicate, Shard, merge_tensors, shard_tensor
from autopar.sharding.redistribute import Step, plan_steps, step_bytes
from autopar.runtime.simulator import run_ranks

R, S, P = Replicate(), Shard, Partial()
ops = torch.ops.autopar


def test_placement_reprs():
    assert repr(R) == "R" and repr(S(0)) == "S(0)" and repr(P) == "P" and repr(Partial("avg")) == "P(avg)"


@pytest.mark.parametrize(
    "shape,spec",
    [
        ((2,), (S(0),)),
        ((4,), (S(1),)),
        ((2, 2), (S(1), S(0))),
        ((2, 2), (R, S(1))),
        ((8,), (S(0),)),
        ((2, 2), (P, S(0))),
    ],
)
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


def test_blocked_shard_roundtrip():
    mesh = ap.Mesh((2, 2), ("dp", "tp"))
    full = torch.arange(4 * 12.0).view(4, 12)
    spec = (ap.Replicate(), ap.Shard(1, blocks=3))
    pieces = [shard_tensor(full, spec, mesh, r) for r in mesh.ranks()]
    assert pieces[1][0].tolist() == [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
    assert torch.equal(merge_tensors(pieces, spec, mesh), full)


def test_list_item_shard_is_whole_on_its_owner_and_empty_elsewhere():
    """Shard(0, of=(i, E)): expert i of E split over 4 ranks (E/4 each) is whole on rank i // (E/4)."""
    import torch

    from autopar.mesh import Mesh
    from autopar.placement import Shard, local_shape, merge_tensors, parse_placement, shard_tensor

    mesh, p, t = Mesh((4,), ("dp",)), Shard(0, of=(5, 8)), torch.randn(6, 3)
    assert repr(p) == "S(0,of=5/8)" and parse_placement(repr(p)) == p and p.owner(4) == 2
    pieces = [shard_tensor(t, (p,), mesh, r) for r in range(4)]
    assert [x.shape[0] for x in pieces] == [0, 0, 6, 0]
    assert [local_shape((6, 3), (p,), mesh, (r,)) for r in (1, 2)] == [(0, 3), (6, 3)]
    assert torch.equal(merge_tensors(pieces, (p,), mesh), t)


@pytest.mark.parametrize("dp_first", [True, False])
def test_list_item_composes_with_a_split_of_the_same_dim(dp_first):
    """A tp-split expert's column bias: Shard(0, of=(1, 4)) on dp and Shard(0) on tp, one dim: dp
    rank 0 (the owner of expert 1 of 4 over 2) holds its tp halves, dp rank 1 nothing; merged, and
    as DCP boxes (global offsets), the pieces give the tensor back, in either axis order."""
    from autopar.checkpoint.boxes import local_boxes
    from autopar.mesh import Mesh
    from autopar.placement import check_layout, local_shape

    names = ("dp", "tp") if dp_first else ("tp", "dp")
    mesh, t = Mesh((2, 2), names), torch.arange(6.0)
    item, half = Shard(0, of=(1, 4)), Shard(0)
    spec = (item, half) if dp_first else (half, item)
    check_layout((6,), spec, mesh, "bias")
    with pytest.raises(ap.PlanError, match="sharded on two mesh axes"):
        check_layout((6,), (half, half), mesh, "bias")
    pieces = [shard_tensor(t, spec, mesh, r) for r in range(4)]
    dp = names.index("dp")
    for r, piece in enumerate(pieces):
        c = mesh.coords(r)
        want = t[3 * c[1 - dp] : 3 * c[1 - dp] + 3] if c[dp] == 0 else t[:0]
        assert torch.equal(piece, want) and piece.shape == local_shape((6,), spec, mesh, c), (r, piece)
        boxes = local_boxes((6,), spec, mesh, r, piece)
        assert all(torch.equal(v, t[o[0] : o[0] + s[0]]) for o, s, v in boxes if s[0]), boxes
        assert sum(s[0] for _, s, _ in boxes) == piece.shape[0]
    assert torch.equal(merge_tensors(pieces, spec, mesh), t)
