"""Each rule added for HuggingFace models, against serial (forward and every gradient) on
(2,), (4,) and (2, 2): pad, diff, index, logical and, blocked (fused) splits, and the
vocab-parallel cross-entropy with ignored targets and every reduction."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap

S, R = ap.Shard, ap.Replicate()
MESHES = [((2,), ("tp",)), ((4,), ("tp",)), ((2, 2), ("dp", "tp"))]


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
    "pad": lambda y: F.pad(y, (0, 0, 1, 2), value=0.5),      # pads the rows: features stay split
    "pad_last": lambda y: F.pad(y, (1, 1)),                  # pads the split dim: gathered first
    "diff": lambda y: torch.diff(y, dim=0),
    "and": lambda y: ((y > 0) & (y < 0.5)).float() * y,
    "index": _index,
    "index_rows": lambda y: y[torch.arange(y.shape[0]).flip(0)[:5]] * 2,   # features keep their split
}


def _plan(model, mesh_shape, axes, x, **kw):
    mesh = ap.Mesh(mesh_shape, axes)
    dp = "dp" if "dp" in axes else None
    return ap.plan(model, mesh, args=(x,), annotations={"fc": ap.colwise("tp")}, data_parallel=dp, **kw)


@pytest.mark.parametrize("shape,axes", MESHES)
@pytest.mark.parametrize("op", list(OPS))
def test_rule_matches_serial(op, shape, axes):
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every op has a rule: no gathered fallback
        plan = _plan(Op(OPS[op]), shape, axes, x)
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


@pytest.mark.parametrize("shape,axes", MESHES)
def test_blocked_split_matches_serial_without_gathers(shape, axes):
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16)
    mesh = ap.Mesh(shape, axes)
    ann = {"qkv": ap.colwise("tp", blocks=3), "out": ap.rowwise("tp")}
    plan = ap.plan(Fused(), mesh, args=(x,), annotations=ann, data_parallel="dp" if "dp" in axes else None)
    plan.check(x)
    assert not [c for c in plan.collectives() if c.kind == "all_gather"]


class Head(nn.Module):
    def __init__(self, d=16, vocab=32, reduction="mean"):
        super().__init__()
        self.head = nn.Linear(d, vocab, bias=False)
        self.reduction = reduction

    def forward(self, x, target):
        return F.cross_entropy(self.head(x), target, reduction=self.reduction)


@pytest.mark.parametrize("shape,axes", MESHES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy(reduction, shape, axes):
    torch.manual_seed(0)
    x, target = torch.randn(8, 16), torch.randint(0, 32, (8,))
    target[1] = target[6] = -100
    mesh = ap.Mesh(shape, axes)
    plan = ap.plan(Head(reduction=reduction), mesh, args=(x, target), annotations={"head": ap.vocab_parallel("tp")},
                   data_parallel="dp" if "dp" in axes else None)
    plan.check(x, target)
    loss_node = next(n for n in plan.graph.nodes if "cross_entropy" in str(n.target))
    assert loss_node.meta["autopar"].input_targets[0][-1] == S(1)  # logits never gathered on tp
    assert not [c for c in plan.collectives() if c.kind == "all_gather" and c.bytes > 8 * 4 * 4]
