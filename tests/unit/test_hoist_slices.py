"""propagate.hoist_slices: a tensor no gradient flows through, built replicated, that every
consumer reads split on an axis, is built split there (its producers slice instead); never when
one consumer reads it whole, never on a tensor that needs a gradient."""

from __future__ import annotations

import torch
from torch import nn

import autopar as ap
from autopar.sharding import propagate as P
from tests.harness.hf_models import hf_plan
from tests.gloo.jobs_mask_split import split_masks


class Masked(nn.Module):
    """A mask built from ``arange`` at the global batch (as HF builds its causal mask)."""

    def __init__(self, whole_too: bool = False):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.whole_too = whole_too

    def forward(self, x):
        rows = torch.arange(x.shape[0]).unsqueeze(1).expand(-1, x.shape[1])
        mask = (rows % 3) == 0
        y = torch.where(mask, self.lin(x), -x)
        return y.sum() + (mask.sum() if self.whole_too else 0)


def _plan(model, x, **kw):
    mesh = ap.Mesh((2,), ("dp",))
    return ap.plan(model, mesh, args=(x,), data_parallel=ap.DataParallel("dp"), dynamic=False, **kw)


def _spec(plan, op):
    (node,) = [n for n in plan.graph.nodes if str(n.target).startswith(op)]
    return node.meta["autopar"].spec


def test_mask_read_split_is_built_split_and_equals_serial():
    x = torch.randn(4, 6)
    plan = _plan(Masked(), x)
    assert _spec(plan, "aten.eq")[0] == ap.Shard(0)
    assert _spec(plan, "aten.remainder")[0] == ap.Shard(0)
    plan.check(x, rtol=1e-5, atol=1e-6)


def test_mask_also_read_whole_stays_replicated():
    x = torch.randn(4, 6)
    plan = _plan(Masked(whole_too=True), x)
    assert _spec(plan, "aten.eq")[0] == ap.Replicate()
    plan.check(x, rtol=1e-5, atol=1e-6)


def test_needs_grad_is_left_alone():
    """An activation the consumers slice keeps its layout: a slice's backward gathers."""
    lay_before = []

    class Slices(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 6))

        def forward(self, x):
            return (self.w * 2 * x).sum()  # w * 2 is replicated and read as S(0) by the product

    x = torch.randn(4, 6)
    plan = _plan(Slices(), x)
    for n in plan.graph.nodes:
        if n.target is torch.ops.aten.mul.Tensor and n.args[1] == 2:
            lay_before.append(n.meta["autopar"].spec)
    assert lay_before == [(ap.Replicate(),)]
    plan.check(x, rtol=1e-5, atol=1e-6)


def test_llama_causal_mask_split(monkeypatch):
    """HF LLaMA (sdpa) on dp x tp: every 4-D bool mask split on dp (propagation without the pass
    leaves them replicated at the global batch); forward and gradients equal serial."""
    plan, kw = hf_plan("llama", "dp2xtp2", attn="sdpa", layers=2)
    masks, split = split_masks(plan)
    assert masks >= 4 and split == masks
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(P, "hoist_slices", lambda graph, ctx: 0)
    before, _ = hf_plan("llama", "dp2xtp2", attn="sdpa", layers=2)
    assert split_masks(before)[1] == 0
