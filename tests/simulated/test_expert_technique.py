"""Expert parallel as a registered technique (parallel/experts/, docs/experts.md): ap.ExpertParallel
is in the registry; a plan asked for with ``expert_parallel=ap.ExpertParallel(...)`` has the same
layouts, strategies and collectives as the one made with ``ap.expert_parallel`` annotations (with
expert tensor parallelism too), equals serial, saves and loads with the technique, and says what it
built; the errors."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.parallel import TECHNIQUES
from tests.harness import moe as M

DP4 = ap.Mesh((4,), ("dp",))
DP2TP2 = ap.Mesh((2, 2), ("dp", "tp"))


def _layouts(plan) -> dict:
    """Every node's strategies and every parameter's seed: what two ways of asking must agree on."""
    nodes = {n.name: n.meta["autopar"].strategies for n in plan.graph.nodes if "autopar" in n.meta}
    return {"nodes": nodes, "params": dict(plan.seeds.params), "experts": dict(plan.seeds.experts)}


def _comms(plan) -> list:
    return [(c.kind, c.axis, c.node, c.phase) for c in plan.collectives()]


def test_expert_parallel_is_a_registered_technique():
    assert TECHNIQUES["expert_parallel"] is ap.ExpertParallel
    assert ap.PlanOptions(expert_parallel="dp").expert_parallel == ap.ExpertParallel("dp")
    assert ap.PlanOptions(expert_parallel=("a", "b")).expert_parallel.axis == ("a", "b")
    assert ap.PlanOptions().expert_parallel is None


def test_technique_plans_as_the_annotation_does():
    model, kw = M.moe_model("mixtral")
    by_annotation = ap.plan(model, DP4, kwargs=kw, annotations=M.EP, data_parallel="dp", dynamic=False)
    by_technique = ap.plan(
        model, DP4, kwargs=kw, data_parallel="dp", expert_parallel=ap.ExpertParallel("dp"), dynamic=False
    )
    assert by_technique.options.expert_parallel == ap.ExpertParallel("dp")
    assert by_annotation.options.expert_parallel is None
    assert _layouts(by_technique) == _layouts(by_annotation)
    assert _comms(by_technique) == _comms(by_annotation)
    assert any(kind == "all_to_all" for kind, *_ in _comms(by_technique))
    by_technique.check(**kw, rtol=1e-4, atol=1e-5)
    layers = sum(name.endswith("mlp.experts") for name, _ in model.named_modules())
    said = (
        f"expert parallel on 'dp': {layers} experts module(s) of {M.EXPERTS} experts split by expert; tokens dispatched"
    )
    assert said in str(by_technique)
    assert "expert parallel on" not in str(by_annotation)
    explained = str(by_technique.explain("model.layers.0.mlp.experts"))
    assert f"expert parallel (ExpertParallel(axis='dp', tp=None, modules=None)): {M.EXPERTS} experts split" in explained
    assert "expert parallel (" not in str(by_annotation.explain("model.layers.0.mlp.experts"))
    with pytest.raises(ap.PlanError, match="plan again"):  # the layouts it stands for are the plan's
        by_annotation.with_options(by_annotation.options.replace(expert_parallel="dp"))


def test_technique_with_expert_tp_plans_as_the_preset_does():
    model, kw = M.moe_model("qwen3_moe")
    preset = dict(ap.presets.megatron(model, "tp", kwargs=kw, expert_axis="dp", expert_tp=True, vocab=False))
    dense = dict(ap.presets.megatron(model, "tp", kwargs=kw, experts=False, vocab=False))
    by_annotation = ap.plan(model, DP2TP2, kwargs=kw, annotations=preset, data_parallel="dp", dynamic=False)
    by_technique = ap.plan(
        model,
        DP2TP2,
        kwargs=kw,
        annotations=dense,
        data_parallel="dp",
        expert_parallel=ap.ExpertParallel("dp", tp="tp", modules=("model.layers.*.mlp.experts",)),
        dynamic=False,
    )
    assert _layouts(by_technique)["nodes"] == _layouts(by_annotation)["nodes"]
    assert _layouts(by_technique)["params"] == _layouts(by_annotation)["params"]
    assert dict(by_technique.seeds.expert_tp) == dict(by_annotation.seeds.expert_tp) != {}
    assert _comms(by_technique) == _comms(by_annotation)
    by_technique.check(**kw, rtol=1e-4, atol=1e-5)


def test_plan_with_the_technique_saves_and_loads(tmp_path):
    model, kw = M.moe_model("olmoe")
    plan = ap.plan(model, DP4, kwargs=kw, data_parallel="dp", expert_parallel="dp", dynamic=False)
    plan.save(tmp_path / "moe.json")
    again = ap.load_plan(tmp_path / "moe.json", model)
    assert again.options.expert_parallel == plan.options.expert_parallel == ap.ExpertParallel("dp")
    assert _layouts(again) == _layouts(plan)
    assert str(again) == str(plan)


def test_errors_name_the_fix():
    model, kw = M.moe_model("mixtral")
    with pytest.raises(ap.PlanError, match="tp is another mesh axis"):
        ap.ExpertParallel("dp", tp="dp")
    with pytest.raises(ap.PlanError, match="auto decides|search decides"):
        ap.plan(model, DP2TP2, kwargs=kw, data_parallel="dp", expert_parallel="dp", auto=True)
    with pytest.raises(ap.MeshError):
        ap.plan(model, DP4, kwargs=kw, data_parallel="dp", expert_parallel="ep")
    on_tp = dict(ap.presets.megatron(model, "tp", kwargs=kw, vocab=False))  # the experts on tp
    with pytest.raises(ap.PlanError, match="experts=False"):
        ap.plan(model, DP2TP2, kwargs=kw, annotations=on_tp, data_parallel="dp", expert_parallel="dp")
    with pytest.raises(ap.PlanError, match="4 experts do not divide over the 3 ranks"):  # stacked weights
        ap.plan(model, ap.Mesh((3,), ("ep",)), kwargs=kw, expert_parallel="ep")
    dense = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ap.PlanError, match="no mixture-of-experts experts module"):
        ap.plan(dense, DP4, args=(torch.randn(4, 8),), data_parallel="dp", expert_parallel="dp")


@pytest.mark.parametrize("axis", ["b", "a"])
def test_technique_on_a_part_of_two_merged_data_parallel_axes(axis):
    """The batch over (a, b) (HSDP's two axes, planned as one merged axis): the technique on one
    part plans as the annotation does (the dispatch inside that part's groups)."""
    mesh, dp = ap.Mesh((2, 2), ("a", "b")), ap.DataParallel("b", replicate_axis="a")
    model, batch = M.RoutedExperts("mixtral"), M.routing(16, seed=0)
    by_annotation = ap.plan(
        model, mesh, args=batch, annotations={"experts": ap.expert_parallel(axis)}, data_parallel=dp, dynamic=False
    )
    by_technique = ap.plan(
        model, mesh, args=batch, data_parallel=dp, expert_parallel=ap.ExpertParallel(axis), dynamic=False
    )
    assert _layouts(by_technique) == _layouts(by_annotation)
    assert _comms(by_technique) == _comms(by_annotation)
    assert {c.axis for c in by_technique.collectives() if c.kind == "all_to_all"} == {axis}
    by_technique.check(*batch, rtol=1e-4, atol=1e-5)


def test_technique_on_an_axis_that_does_not_split_the_batch():
    """Experts on tp (no dispatch: each rank runs its experts' rows, the outputs summed)."""
    model, kw = M.moe_model("mixtral")
    ann = {"model.layers.*.mlp.experts": ap.expert_parallel("tp")}
    by_annotation = ap.plan(model, DP2TP2, kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)
    by_technique = ap.plan(model, DP2TP2, kwargs=kw, data_parallel="dp", expert_parallel="tp", dynamic=False)
    assert _layouts(by_technique) == _layouts(by_annotation)
    assert _comms(by_technique) == _comms(by_annotation)
    assert not any(kind == "all_to_all" for kind, *_ in _comms(by_technique))
    assert "split by expert; each rank runs the rows routed to its experts" in str(by_technique)
    by_technique.check(**kw, rtol=1e-4, atol=1e-5)
