"""Every rule on its own: a one-op module whose input is forced into a split layout, checked
against serial (forward and every gradient) on meshes (2,), (4,) and (2, 2); then the rules
added for HuggingFace models (pad, diff, index, logical and, blocked (fused) splits) behind a
column-parallel layer. The strategies rules offer, without numerics: unit/test_rule_strategies.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.placement import Replicate, Shard
from tests.harness.meshes import MESHES, RULE_MESHES, TP

R, S = Replicate(), Shard


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
    for spec, placements in zip(RULE_MESHES, placements_per_mesh):
        mesh = spec.mesh()
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
    "masked_fill": (
        lambda x: x.masked_fill(torch.ones(8, 8, dtype=torch.bool).tril()[:, :4] == 0, -1.0),
        (8, 4),
        three((S(0),), (S(0),), (S(0), S(1))),
    ),
    "where": (lambda x: torch.where(x > 0, x, x * 0.1), (8, 4), three((S(1),), (S(0),), (S(1), S(0)))),
    # contractions
    "matmul_contract": (lambda x, w: x @ w, (4, 8), three((S(1),), (S(1),), (S(1), S(0))), [(8, 6)]),
    "matmul_batch": (lambda x, w: x @ w, (4, 4, 8), three((S(0),), (S(0),), (S(0), S(1))), [(8, 4)]),
    "bmm": (lambda x: torch.bmm(x, x.transpose(1, 2)), (4, 4, 8), three((S(2),), (S(0),), (S(0), S(2)))),
    "linear_col_input": (lambda x, w: F.linear(x, w), (4, 8), three((S(0),), (S(1),), (S(0), S(1))), [(6, 8)]),
    # views
    "view_heads": (
        lambda x: x.view(4, 2, 4, 2).permute(0, 2, 1, 3).reshape(4, 4, 4).sum(-1),
        (4, 2, 8),
        three((S(2),), (S(2),), (S(0), S(2))),
    ),
    "transpose_contig": (
        lambda x: x.transpose(0, 1).contiguous().view(-1),
        (4, 8),
        three((S(1),), (S(1),), (S(0), S(1))),
    ),
    "unsqueeze_expand": (
        lambda x: x.unsqueeze(0).expand(3, 8, 4).sum(0),
        (8, 4),
        three((S(0),), (S(1),), (S(0), S(1))),
    ),
    "squeeze": (lambda x: x.view(8, 1, 4).squeeze(1), (8, 4), three((S(0),), (S(1),), (S(0), S(1)))),
    "slice_select": (
        lambda x: x[:, 1:3] * x[:, 0:1] + x.select(1, 3).unsqueeze(1),
        (8, 4),
        three((S(0),), (S(0),), (S(0), S(1))),
    ),
    "unbind_split_cat": (
        lambda x: torch.cat([*x.split(2, dim=1)][::-1], dim=1) + torch.stack(x.unbind(1), 1),
        (8, 4),
        three((S(0),), (S(0),), (S(0), S(1))),
    ),
    # reductions and softmax
    "sum_split_dim": (lambda x: x.sum(0), (8, 4), three((S(0),), (S(0),), (S(0), S(1)))),
    "mean_split_dim": (lambda x: x.mean(-1, keepdim=True) * x, (8, 4), three((S(1),), (S(1),), (S(0), S(1)))),
    "amax_other_dim": (lambda x: x.amax(1), (8, 4), three((S(0),), (S(0),), (S(0), S(1)))),
    "softmax": (lambda x: x.softmax(-1) * x.log_softmax(0), (8, 4), three((S(1),), (S(0),), (S(0), S(1)))),
    "full_sum": (lambda x: x.sum() * x, (8, 4), three((S(0),), (S(0),), (S(0), S(1)))),
    # norms
    "layer_norm": (
        lambda x, w, b: F.layer_norm(x, (4,), w, b),
        (8, 4),
        three((S(0),), (S(0),), (S(0), S(1))),
        [(4,), (4,)],
    ),
    "rms_norm": (lambda x, w: F.rms_norm(x, (4,), w), (2, 8, 4), three((S(1),), (S(1),), (S(0), S(1))), [(4,)]),
    # attention
    "sdpa_heads": (
        lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True),
        (2, 4, 6, 8),
        three((S(1),), (S(1),), (S(0), S(1))),
    ),
    # creation
    "arange_ones": (
        lambda x: x + torch.arange(4.0) + torch.ones(8, 4).tril(),
        (8, 4),
        three((S(0),), (S(1),), (S(0), S(1))),
    ),
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
    for spec in RULE_MESHES:
        mesh = spec.mesh()
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
    for spec in RULE_MESHES:
        plan = ap.plan(model, spec.mesh(), args=(x, target), data_parallel="a")
        plan.check(x, target)
        if reduction == "mean":  # a float32 loss: the (sum, count) pair is float32 already, no casts
            assert "_to_copy" not in plan.module(0).code


# ------------------------------------------- rules behind a column-parallel layer (features split on tp)
class Op(nn.Module):
    """x (8, 16) -> colwise fc (features split on tp) -> op -> mean-free output."""

    def __init__(self, fn, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.fc(x))


def _index(y):
    rows = torch.arange(y.shape[0]).unsqueeze(1)
    cols = torch.arange(y.shape[0]).remainder(3).unsqueeze(1)
    return y[rows, cols] + y[:, :4]


OPS = {
    "pad": lambda y: F.pad(y, (0, 0, 1, 2), value=0.5),  # pads the rows: features stay split
    "pad_last": lambda y: F.pad(y, (1, 1)),  # pads the split dim: gathered first
    "diff": lambda y: torch.diff(y, dim=0),
    "and": lambda y: ((y > 0) & (y < 0.5)).float() * y,
    "index": _index,
    "index_rows": lambda y: y[torch.arange(y.shape[0]).flip(0)[:5]] * 2,  # features keep their split
}


def _plan(model, mesh_name, x, **kw):
    spec = MESHES[mesh_name]
    return ap.plan(model, spec.mesh(), args=(x,), annotations={"fc": ap.colwise("tp")}, data_parallel=spec.dp, **kw)


@pytest.mark.parametrize("mesh_name", TP)
@pytest.mark.parametrize("op", list(OPS))
def test_rule_on_split_features_matches_serial(op, mesh_name):
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every op has a rule: no gathered fallback
        plan = _plan(Op(OPS[op]), mesh_name, x)
    plan.check(x)
    if op in ("pad", "diff", "and", "index_rows"):  # the split features pass through: no gather
        assert not [c for c in plan.collectives() if c.kind == "all_gather" and c.axis == "tp" and c.node != "output"]


class Fused(nn.Module):
    """A fused q|k|v projection split into its 3 blocks, as GPT-2's c_attn."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        heads = (q * k).view(*q.shape[:-1], 4, -1).softmax(-1).reshape(q.shape) * v
        return self.out(heads)


@pytest.mark.parametrize("mesh_name", TP)
def test_blocked_split_matches_serial_without_gathers(mesh_name):
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16)
    spec = MESHES[mesh_name]
    ann = {"qkv": ap.colwise("tp", blocks=3), "out": ap.rowwise("tp")}
    plan = ap.plan(Fused(), spec.mesh(), args=(x,), annotations=ann, data_parallel=spec.dp)
    plan.check(x)
    assert not [c for c in plan.collectives() if c.kind == "all_gather"]
