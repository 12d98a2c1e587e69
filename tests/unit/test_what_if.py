"""What-if in one cell: one model planned again under other choices, kept, shown as a widget."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.explore.what_if import every, what_if
from tests.harness.models import MLP, MLP_TP


@pytest.fixture
def mlp_what_if():
    torch.manual_seed(0)
    model, built = MLP(), []

    def build(tp, batch):
        built.append((tp, batch))
        mesh = ap.Mesh((4 // tp, tp), ("dp", "tp"))
        return ap.plan(model, mesh, args=(torch.randn(batch, 16),), annotations=MLP_TP, data_parallel="dp")

    return what_if(build, tp=[2, 4], batch=[4, 8]), built


def test_plans_are_made_once_and_compared(mlp_what_if):
    w, built = mlp_what_if
    first = w.plan()
    assert first.mesh.shape == (2, 2) and w.plan(tp=2, batch=4) is first and built == [(2, 4)]
    for choice in every(w):
        w.plan(**choice)
    assert sorted(built) == [(2, 4), (2, 8), (4, 4), (4, 8)]
    lines = w.table().splitlines()
    assert len(lines) == 4 and lines[0].startswith("tp=2, batch=4, memory per rank ")
    # more tp: less memory per rank (the MLP's weights split 4 ways, not 2)
    mem = {k: w.figures(p)["memory per rank"] for k, (p, _) in w.plans.items()}
    assert mem[(4, 4)] < mem[(2, 4)]
    with pytest.raises(ValueError, match="at least one choice"):
        what_if(lambda: None)


def test_widget_replans_on_change(mlp_what_if):
    pytest.importorskip("ipywidgets")
    w, built = mlp_what_if
    box = w.widget()
    (tp, batch), panel = box.children[0].children, box.children[1]
    assert tp.options == (2, 4) and batch.options == (4, 8)
    assert "dp=2, tp=2 (4 ranks)" in panel.value
    tp.value = 4
    assert "dp=1, tp=4 (4 ranks)" in panel.value and "tp=4, batch=4" in panel.value and built == [(2, 4), (4, 4)]
    tp.value = 2  # back: the plan kept, not made again
    assert "dp=2, tp=2 (4 ranks)" in panel.value and built == [(2, 4), (4, 4)]
    bundle = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "autopar-plan" in bundle["text/html"]
