"""A tensor written in place through a view keeps its layout up to the write (sharding/written_views.py).

``h[:, :3].mul_(2)`` on a column-parallel layer's output (features split on tp): the slice of a
split dim reads ``h`` gathered, the in-place multiply lands in the gathered copy, and the next
layer read ``h`` without it (measured before the guard on tp=2: loss 0.351 against serial's 0.603).
The planner now propagates again with ``h`` replicated; where that cannot help it raises a
PlanError naming the write.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar as ap
from autopar.sharding.propagate import propagate
from autopar.sharding.written_views import keep_written_layouts, lost_writes


class SliceWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.proj = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc(x)
        h[:, :3].mul_(2)  # in place through a slice of the split feature dim
        return self.proj(h).square().mean()


class BufferRows(nn.Module):
    """ProphetNet's pattern: a buffer made with new_zeros, rows copied into it in place, read after."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.proj = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc(x)
        buf = h.new_zeros(2, *h.shape)
        buf[0].copy_(h)
        buf[1, :, :5].copy_(h[:, :5] * 3)
        return self.proj(buf.sum(0)).square().mean()


MESHES = {"tp2": ((2,), ("tp",)), "tp4": ((4,), ("tp",)), "dp2xtp2": ((2, 2), ("dp", "tp"))}


def _plan(model, mesh):
    shape, axes = MESHES[mesh]
    dp = "dp" if "dp" in axes else None
    return ap.plan(
        model, ap.Mesh(shape, axes), args=(torch.randn(4, 6),), annotations={"fc": ap.colwise("tp")}, data_parallel=dp
    )


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("cls", [SliceWrite, BufferRows])
def test_written_view_equals_serial(cls, mesh):
    """Forward and every gradient equal serial's; no write is left landing in a copy."""
    torch.manual_seed(0)
    plan = _plan(cls(), mesh)
    assert lost_writes(plan.graph) == []
    plan.check(torch.randn(4, 6, generator=torch.Generator().manual_seed(1)))


def test_lost_write_found_and_refused_without_rounds():
    """Without re-planning the write is found (the slice reads h gathered); with no rounds left the
    planner's guard raises a PlanError that names the write and says how to fix it."""
    torch.manual_seed(0)
    plan = _plan(SliceWrite(), "tp2")
    traced, seeds = plan.traced, plan.layouts.seeds
    ctx = propagate(traced, plan.mesh, seeds)  # the greedy layouts, before the guard
    lost = lost_writes(traced.gm.graph)
    assert [(w.target, b.target) for w, b, _ in lost] == [(torch.ops.aten.mul_.Tensor, torch.ops.aten.add.Tensor)]
    with pytest.raises(ap.PlanError, match=r"mul_.*writes in place into a view of .*Write out of place"):
        keep_written_layouts(traced, plan.mesh, seeds, False, ctx, rounds=0)
    keep_written_layouts(traced, plan.mesh, seeds, False, ctx)  # one round fixes it
    assert lost_writes(traced.gm.graph) == []
