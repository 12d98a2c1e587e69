"""Every rule on its own: a one-op module whose input is forced into a split layout, checked
against serial (forward and every gradient) on meshes (2,), (4,) and (2, 2)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.rules import OpInfo, TensorMeta, get_rule
from autopar.sharding.rules.views import view_dim_map

R, S = Replicate(), Shard
MESHES = [((2,), ("a",)), ((4,), ("a",)), ((2, 2), ("a", "b"))]


class OpModule(nn.Module):
    """y = fn(x * w, ...): the weight makes gradients flow back through the op under test."""

    def __init__(self, fn, shape, extra=()):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(shape[-1]) + 2.0)
        self.extra = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in extra)

    def forward(self, x):
        return self.fn(x * self.w, *self.extra)


def run_case(fn, shape, placements_per_mesh, extra=(), x=None):
    torch.manual_seed(0)
    model = OpModule(fn, shape, extra)
    x = torch.randn(shape) if x is None else x
    for (mshape, axes), placements in zip(MESHES, placements_per_mesh):
        mesh = ap.Mesh(mshape, axes)
        plan = ap.plan(model, mesh, args=(x,), annotations={"x": ap.place(*placements)}, strict=True)
        try:
            plan.check(x)
        except ap.PlanMismatch as e:
            raise ap.PlanMismatch(f"on {mesh} with x {placements}: {e}\n{plan}") from None


def three(p1, p4, p22):
    return [p1, p4, p22]


CASES = {
    # pointwise
    "gelu": (lambda x: F.gelu(x), (8, 4), three((S(0),), (S(0),), (S(0), S(1)))),
    "add_broadcast": (lambda x, b: x + b, (8, 4), three((S(0),), (S(0),), (S(0), S(1))), [(4,)]),
    "mul_tensor": (lambda x, b: x * b.tanh(), (8, 4), three((S(1),), (S(1),), (S(1), S(0))), [(8, 4)]),
    "masked_fill": (lambda x: x.masked_fill(torch.ones(8, 8, dtype=torch.bool).tril()[:, :4] == 0, -1.0),
                    (8, 4), three((S(0),), (S(0),), (S(0), S(1)))),
    "where": (lambda x: torch.where(x > 0, x, x * 0.1), (8, 4), three((S(1),), (S(0),), (S(1), S(0)))),
    # contractions
    "matmul_contract": (lambda x, w: x @ w, (4, 8), three((S(1),), (S(1),), (S(1), S(0))), [(8, 6)]),
    "matmul_batch": (lambda x, w: x @ w, (4, 4, 8), three((S(0),), (S(0),), (S(0), S(1))), [(8, 4)]),
    "bmm": (lambda x: torch.bmm(x, x.transpose(1, 2)), (4, 4, 8), three((S(2),), (S(0),), (S(0), S(2)))),
    "linear_col_input": (lambda x, w: F.linear(x, w), (4, 8), three((S(0),), (S(1),), (S(0), S(1))), [(6, 8)]),
    # views
    "view_heads": (lambda x: x.view(4, 2, 4, 2).permute(0, 2, 1, 3).reshape(4, 4, 4).sum(-1),
                   (4, 2, 8), three((S(2),), (S(2),), (S(0), S(2)))),
    "transpose_contig": (lambda x: x.transpose(0, 1).contiguous().view(-1), (4, 8), three((S(1),), (S(1),), (S(0), S(1)))),
    "unsqueeze_expand": (lambda x: x.unsqueeze(0).expand(3, 8, 4).sum(0), (8, 4), three((S(0),), (S(1),), (S(0), S(1)))),
    "squeeze": (lambda x: x.view(8, 1, 4).squeeze(1), (8, 4), three((S(0),), (S(1),), (S(0), S(1)))),
    "slice_select": (lambda x: x[:, 1:3] * x[:, 0:1] + x.select(1, 3).unsqueeze(1), (8, 4),
                     three((S(0),), (S(0),), (S(0), S(1)))),
    "unbind_split_cat": (lambda x: torch.cat([*x.split(2, dim=1)][::-1], dim=1) + torch.stack(x.unbind(1), 1),
                         (8, 4), three((S(0),), (S(0),), (S(0), S(1)))),
    # reductions and softmax
    "sum_split_dim": (lambda x: x.sum(0), (8, 4), three((S(0),), (S(0),), (S(0), S(1)))),
    "mean_split_dim": (lambda x: x.mean(-1, keepdim=True) * x, (8, 4), three((S(1),), (S(1),), (S(0), S(1)))),
    "amax_other_dim": (lambda x: x.amax(1), (8, 4), three((S(0),), (S(0),), (S(0), S(1)))),
    "softmax": (lambda x: x.softmax(-1) * x.log_softmax(0), (8, 4), three((S(1),), (S(0),), (S(0), S(1)))),
    "full_sum": (lambda x: x.sum() * x, (8, 4), three((S(0),), (S(0),), (S(0), S(1)))),
    # norms
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (4,), w, b), (8, 4), three((S(0),), (S(0),), (S(0), S(1))),
                   [(4,), (4,)]),
    "rms_norm": (lambda x, w: F.rms_norm(x, (4,), w), (2, 8, 4), three((S(1),), (S(1),), (S(0), S(1))), [(4,)]),
    # attention
    "sdpa_heads": (lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True), (2, 4, 6, 8),
                   three((S(1),), (S(1),), (S(0), S(1)))),
    # creation
    "arange_ones": (lambda x: x + torch.arange(4.0) + torch.ones(8, 4).tril(), (8, 4),
                    three((S(0),), (S(1),), (S(0), S(1)))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rule_matches_serial(name):
    fn, shape, placements, *extra = CASES[name]
    run_case(fn, shape, placements, extra[0] if extra else ())


class EmbedModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, ids):
        return self.emb(ids) * self.w


@pytest.mark.parametrize("ann", ["ids_split", "dim_split", "vocab_split"])
def test_embedding(ann):
    torch.manual_seed(0)
    model = EmbedModule()
    ids = torch.randint(0, 16, (4, 6))
    for mshape, axes in MESHES:
        mesh = ap.Mesh(mshape, axes)
        annotations = {
            "ids_split": {"ids": ap.place(*([S(0)] + [R] * (mesh.ndim - 1)))},
            "dim_split": {"emb": ap.colwise("a")},
            "vocab_split": {"emb": ap.rowwise("a")},
        }[ann]
        plan = ap.plan(model, mesh, args=(ids,), annotations=annotations, strict=True)
        plan.check(ids)
        if ann == "vocab_split":
            assert "lt" in plan.module(0).code  # masked local lookup


class LossModule(nn.Module):
    def __init__(self, reduction):
        super().__init__()
        self.proj = nn.Linear(8, 10)
        self.reduction = reduction

    def forward(self, x, target):
        return F.cross_entropy(self.proj(x), target, reduction=self.reduction, ignore_index=3)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_split_rows(reduction):
    torch.manual_seed(0)
    model = LossModule(reduction)
    x = torch.randn(8, 8)
    target = torch.tensor([3, 3, 3, 1, 2, 5, 3, 7])  # ignored targets unevenly spread over ranks
    for mshape, axes in MESHES:
        plan = ap.plan(model, ap.Mesh(mshape, axes), args=(x, target), data_parallel="a")
        plan.check(x, target)


def meta(*shape):
    return TensorMeta(tuple(shape), torch.float32, (False,) * len(shape))


def test_linear_rule_offers_megatron_strategies():
    x, w = meta(4, 8, 16), meta(32, 16)
    op = OpInfo(torch.ops.aten.linear.default, (x, w), {}, [x, w], [meta(4, 8, 32)], {id(x): 0, id(w): 1})
    strategies = {(s.inputs, s.outputs) for s in get_rule(op.op)(op)}
    assert ((R, S(0)), (S(2),)) in strategies            # column parallel
    assert ((S(2), S(1)), (Partial(),)) in strategies    # row parallel: partial sum
    assert ((S(0), R), (S(0),)) in strategies            # batch split


def test_view_dim_map_splits_heads():
    assert view_dim_map((2, 8, 32), (2, 8, 4, 8)) == {0: 0, 1: 1, 2: 2}
    assert view_dim_map((2, 8, 4, 8), (2, 8, 32)) == {0: 0, 1: 1, 2: 2}
    assert view_dim_map((6, 4), (24,)) == {0: 0}
