"""Uneven pieces (issue 24): any size on any mesh, as torch.tensor_split cuts it, checked against
serial (forward and every gradient) on meshes (2,), (3,), (4,) and (2, 3): the redistribution
steps around equal-size collectives (pad, collective, trim), tensor-parallel layers on an
intermediate size of 66 on tp=4, vocab-parallel embedding and cross-entropy on odd vocabularies,
sequence parallel on an odd sequence length, and empty pieces (a dim smaller than its axis)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import autopar as ap
from autopar.placement import Replicate, Shard, merge_tensors, piece_sizes, shard_tensor
from autopar.runtime.uneven import from_padded, pad_piece, to_padded, trim_piece
from tests.harness.models import GPT_SEQUENCE_PARALLEL, GPT_VOCAB, MEGATRON, MLP, MLP_TP
from tests.harness.uneven import UNEVEN_MESHES, uneven_batch, uneven_gpt

R, S = Replicate(), Shard
MESH_IDS = ["x".join(map(str, s)) for s, _ in UNEVEN_MESHES]


def test_pieces_are_tensor_splits():
    assert piece_sizes(6, 4) == (2, 2, 1, 1) and piece_sizes(66, 4) == (17, 17, 16, 16)
    assert piece_sizes(2, 3) == (1, 1, 0)
    mesh = ap.Mesh((2, 3), ("dp", "tp"))
    full = torch.arange(5 * 7.0).view(5, 7)
    spec = (S(0), S(1))
    pieces = [shard_tensor(full, spec, mesh, r) for r in mesh.ranks()]
    assert [tuple(p.shape) for p in pieces] == [(3, 3), (3, 2), (3, 2), (2, 3), (2, 2), (2, 2)]
    assert torch.equal(merge_tensors(pieces, spec, mesh), full)


@pytest.mark.parametrize("size,n", [(6, 4), (66, 4), (2, 3), (5, 2), (1, 4), (7, 3)])
def test_padded_layout_round_trips(size, n):
    x = torch.randn(3, size)
    padded, c = to_padded(x, 1, size, n), -(-size // n)
    for k, piece in enumerate(x.tensor_split(n, 1)):
        mine = padded[:, k * c : (k + 1) * c]
        assert torch.equal(pad_piece(piece, 1, c), mine) and torch.equal(trim_piece(mine, 1, size, n, k), piece)
    assert torch.equal(from_padded(padded, 1, size, n), x)


class OpModule(nn.Module):
    def __init__(self, fn, shape, extra=()):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(shape[-1]) + 2.0)
        self.extra = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in extra)

    def forward(self, x):
        return self.fn(x * self.w, *self.extra)


# x placed on its uneven dim; the op makes the plan move it: all_to_all, all_gather, slice
STEPS = {
    "all_to_all_and_gather": (lambda x: torch.cumsum(x, 1), (4, 6), (S(1),), ()),
    "all_to_all_both_uneven": (lambda x: torch.cumsum(x, 0), (5, 6), (S(1),), ()),
    "gather_rows": (lambda x: torch.cumsum(x, 1), (5, 7), (S(0),), ()),
    "slice_of_replicated": (lambda x, b: x + b, (4, 6), (R,), [(6,)]),
    "contraction": (lambda x, w: x @ w, (4, 7), (S(1),), [(7, 5)]),
    "view_merging_split_dim": (lambda x: x.view(4, 3, 2).sum(-1), (4, 6), (S(1),), ()),
    "mean_over_split_dim": (lambda x: x.mean(1), (4, 6), (S(1),), ()),
    "softmax": (lambda x: x.softmax(1), (4, 6), (S(1),), ()),
    "empty_pieces": (lambda x: torch.tanh(x).cumsum(0), (5, 2), (S(1),), ()),
}


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("shape", [(3,), (4,)], ids=["3", "4"])
def test_redistribution_of_uneven_pieces_matches_serial(name, shape):
    fn, xshape, placements, extra = STEPS[name]
    torch.manual_seed(0)
    model, x = OpModule(fn, xshape, extra), torch.randn(xshape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every op keeps its rule: no gathered fallback
        plan = ap.plan(
            model,
            ap.Mesh(shape, ("a",)),
            args=(x,),
            annotations={"x": ap.place(*placements)},
            strict=True,
            dynamic=False,
        )
    assert plan.check(x)["grads"] == len(list(model.parameters()))


@pytest.mark.parametrize("mesh", UNEVEN_MESHES, ids=MESH_IDS)
def test_mlp_with_intermediate_66(mesh):
    torch.manual_seed(0)
    model, x = MLP(d=16, hidden=66), torch.randn(6, 16)
    plan = ap.plan(
        model, ap.Mesh(*mesh), args=(x,), annotations=MLP_TP, data_parallel="dp" if len(mesh[0]) > 1 else None
    )
    assert plan.check(x)["grads"] == 10
    tp = plan.mesh.axis_names.index("tp")
    sizes = {plan.module(r).get_parameter("layers.0.fc1.weight").shape[0] for r in plan.mesh.ranks()}
    assert sizes == set(piece_sizes(66, plan.mesh.shape[tp]))


@pytest.mark.parametrize("mesh", UNEVEN_MESHES, ids=MESH_IDS)
def test_gpt_with_odd_vocabulary(mesh):
    model, batch = uneven_gpt(67), uneven_batch(67)
    dp = "dp" if len(mesh[0]) > 1 else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = ap.plan(model, ap.Mesh(*mesh), args=batch, annotations=MEGATRON | GPT_VOCAB, data_parallel=dp)
    assert plan.check(*batch)["grads"] == len(list(model.parameters()))
    assert "cross_entropy_vocab_parallel" in plan.explain("wte") or plan.explain("wte")


@pytest.mark.parametrize("mesh", UNEVEN_MESHES[2:], ids=MESH_IDS[2:])
def test_sequence_parallel_on_an_odd_sequence(mesh):
    """Sequence 7 on tp=4 (2,2,2,1): reduce-scatter and all-gather of uneven pieces."""
    model, batch = uneven_gpt(67), uneven_batch(67, seq=7)
    dp = "dp" if len(mesh[0]) > 1 else None
    plan = ap.plan(
        model, ap.Mesh(*mesh), args=batch, annotations=GPT_SEQUENCE_PARALLEL, data_parallel=dp, dynamic=False
    )
    assert {"reduce_scatter", "all_gather"} <= {c.kind for c in plan.collectives()}
    assert plan.check(*batch)["grads"] == len(list(model.parameters()))


def test_vocabulary_smaller_than_the_axis_gives_empty_pieces():
    """3 classes on tp=4: rank 3 holds no row of the embedding and no class of the loss."""
    model, batch = uneven_gpt(3, layers=1), uneven_batch(3, seq=4)
    plan = ap.plan(model, ap.Mesh((4,), ("tp",)), args=batch, annotations=GPT_VOCAB, dynamic=False)
    assert plan.module(3).get_parameter("wte.weight").shape[0] == 0
    plan.check(*batch)
