"""The search with expert tensor parallelism in its space: experts expert-parallel on dp and each
expert split over tp (ap.expert_parallel(dp, tp=tp)), a third choice of an experts component
beside ``ep`` and ``local``, costed from a probe of its own."""

from __future__ import annotations

import re

import pytest

import autopar as ap
from tests.harness.moe import moe_model

AUTO = dict(
    device="h100",
    alpha=1e-9,
    beta=1e12,
    flops_per_s=1e6,
    zero=(0,),
    activation_checkpoint=(None,),
    pipeline=False,
    context_parallel=(),
)


def test_expert_tensor_parallel_when_only_it_fits():
    """Mixtral (4 experts) on (2, 2), dp on a: under the least memory any option needs, the experts
    are dispatched on a and split over b (a quarter of their weights per rank); the plan equals
    serial and ap.predict of it is the search's prediction."""
    model, kw = moe_model("mixtral")
    mesh = ap.Mesh((2, 2), ("a", "b"))
    with pytest.raises(ap.PlanError, match="least memory") as err:
        ap.plan(model, mesh, kwargs=kw, dynamic=False, data_parallel="a", auto=ap.Auto(memory_budget=1, **AUTO))
    least = float(re.search(r"needs is ([0-9.e+]+) B", str(err.value)).group(1))
    plan = ap.plan(
        model, mesh, kwargs=kw, dynamic=False, data_parallel="a", auto=ap.Auto(memory_budget=least * 1.001, **AUTO)
    )
    rec = plan.built["auto"]
    (experts,) = [c for c in rec["components"] if c["key"] == "model.layers.*.mlp.experts"]
    assert experts["choice"] == "ep+tp" and {"ep", "ep+tp"} <= set(experts["options"]), experts
    # half the expert weights, and what the partial sum changes after them (charged to the choice)
    assert experts["options"]["ep+tp"]["memory"] < 0.6 * experts["options"]["ep"]["memory"]
    local = dict(plan.module(3).named_parameters())
    for n, p in model.named_parameters():
        if ".mlp.experts." in n:
            assert local[n].numel() == p.numel() // 4, n
    pred = ap.predict(plan, ap.Auto(**AUTO))
    assert pred["time_s"] == pytest.approx(rec["time_s"], rel=1e-9) and pred["memory"] == pytest.approx(rec["memory"])
    plan.check(**kw, rtol=1e-4, atol=1e-5)
