"""The price of float8's scales (parallel/float8/cost.py's scale_comms, scale_seconds): the amax all-reduces
(max) the search adds where it prices the Linears in float8 (ap.Auto(float8=True)), and zero=3's one
all-reduce of the fp8-gathered weights' amaxes, held against what the float8 plan runs on the same
layouts (ap.comm_stats): the same count of all-reduces on each group, the same bytes; and
ap.predict's step time carrying their seconds."""

from __future__ import annotations

import pytest

import autopar as ap
from autopar.parallel.float8.cost import scale_comms, scale_seconds
from tests.harness.models import MLP_TP
from tests.simulated.test_float8 import _batches, _loss, _model


def _plans(zero):
    """(the plan the search prices, without ap.Float8; the float8 plan it runs), dp2 x tp2."""
    dp = ap.DataParallel("dp", zero=zero)
    kw = dict(args=(_batches(1)[0],), annotations=MLP_TP, data_parallel=dp)
    mesh = ap.Mesh((2, 2), ("dp", "tp"))
    f8 = ap.Float8("tensorwise", fp8_all_gather=zero == 3)
    return ap.plan(_model(), mesh, **kw), ap.plan(_model(), mesh, float8=f8, **kw)


def _label(plan, axes) -> str:
    return plan.mesh.axis_label(axes if len(axes) > 1 else axes[0])


@pytest.mark.parametrize("zero", [0, 3])
def test_predicted_amax_all_reduces_are_what_the_float8_plan_runs(zero):
    probe, plan = _plans(zero)
    predicted: dict = {}
    for comms in scale_comms(probe).values():
        for axes, _, nbytes in comms:
            label = _label(plan, axes)
            count, total = predicted.get(label, (0, 0.0))
            predicted[label] = (count + 1, total + nbytes)
    groups = {plan.mesh.group((n,), r): n for n in plan.mesh.axis_names for r in plan.mesh.ranks()}
    groups[tuple(plan.mesh.ranks())] = "dp*tp"
    with ap.comm_stats() as stats:
        plan.simulate(lambda m, a: _loss(m(a)).backward(), _batches(1)[0])
    ran: dict = {}
    for r in stats.for_rank(0):
        if r.kind == "all_reduce" and r.numel <= 4:  # the amaxes: one per cast, or the 4 weights' at once
            count, total = ran.get(groups[r.group], (0, 0.0))
            ran[groups[r.group]] = (count + 1, total + r.bytes)
    assert predicted == ran
    if zero == 3:  # the weights' casts are the fp8 gather's: one all-reduce of 4 float32 over dp x tp
        assert ran["dp*tp"] == (1, 2 * 3 / 4 * 16)


def test_predict_prices_the_scales_seconds_in_the_search_and_for_the_fp8_gather(monkeypatch):
    """ap.predict under ap.Auto(float8=True) (the search's pricing) carries every scale's seconds in
    its compute; a plan with ap.Float8(fp8_all_gather=True), whose casts' all-reduces are its own
    activation collectives, carries the weights' all-reduce over dp x tp."""
    probe, plan = _plans(3)
    auto = ap.Auto(device="h100", float8=True)
    seconds = scale_seconds(probe, auto.profile())
    assert len(seconds) == 4 and all(f > 0 for f, _ in seconds.values())
    import autopar.parallel.float8.technique as technique  # its op_extras hook prices them for cost/execution.py

    with_scales, plan_with = ap.predict(probe, auto)["compute_s"], ap.predict(plan, "h100")["compute_s"]
    monkeypatch.setattr(technique, "scale_seconds", lambda plan, profile, fp8_gathered=None: {})
    without, plan_without = ap.predict(probe, auto)["compute_s"], ap.predict(plan, "h100")["compute_s"]
    assert with_scales - without == pytest.approx(sum(f + b for f, b in seconds.values()))
    gather = scale_seconds(plan, auto.profile())
    assert list(gather) == ["float8_mm_default"] and gather["float8_mm_default"][1] == 0.0
    assert plan_with - plan_without == pytest.approx(gather["float8_mm_default"][0])
