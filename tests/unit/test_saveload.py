"""plan.save / ap.load_plan: round trip, recorded choices enforced, refusals."""

from __future__ import annotations

import json

import pytest

import autopar as ap
from autopar.sharding.propagate import layout_of
from tests.harness.models import MLP, gpt_batch, shared_gpt_plan, small_gpt


def layouts(plan) -> dict:
    return {
        n.name: (layout_of(n).outputs, layout_of(n).input_targets, layout_of(n).strategies)
        for n in plan.graph.nodes
        if "autopar" in n.meta
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    plan = shared_gpt_plan("dp2xtp2")
    path = tmp_path_factory.mktemp("plans") / "gpt.json"
    plan.save(path)
    return plan, path


def test_round_trip_reproduces_layouts(saved):
    plan, path = saved
    rec = json.loads(path.read_text())
    assert rec["format"] == "autopar-plan" and rec["version"] == 1
    assert rec["mesh"] == {"shape": [2, 2], "axes": ["dp", "tp"]}
    from autopar.explore.plan_file import _options_in

    assert _options_in(rec["options"], path) == plan.options and rec["data_parallel"] == "dp"
    assert rec["options"]["data_parallel"]["__DataParallel__"]["axis"] == "dp"
    loaded = ap.load_plan(path, plan.model)
    assert layouts(loaded) == layouts(plan)
    assert loaded.param_specs == plan.param_specs and loaded.grad_sync_axes == plan.grad_sync_axes
    assert [str(c) for c in loaded.collectives()] == [str(c) for c in plan.collectives()]
    assert not plan.diff(loaded)


def test_load_enforces_recorded_choice_and_runs(saved, tmp_path):
    """A saved choice the cost model would not make today is restored, not re-chosen."""
    plan, path = saved
    rec = json.loads(path.read_text())
    gelu = next(r for r in rec["nodes"] if r["name"] == "gelu")
    assert gelu["strategies"][1] == "[S(2)] -> [S(2)]"
    gelu["strategies"][1], gelu["outputs"] = "[R] -> [R]", [["S(0)", "R"]]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(rec))
    loaded = ap.load_plan(edited, plan.model)
    assert loaded.layout("gelu").spec == (ap.Shard(0), ap.Replicate())
    assert "restored from the plan file" in loaded.layout("gelu").reason
    d = plan.diff(loaded)
    assert [n.node for n in d.nodes] == ["gelu", "linear_default_3"]
    assert d.nodes[0].comms[1] == "all_gather(tp)"  # gelu's input is now gathered
    assert d.nodes[1].comms[1] == "all_gather(tp, bwd)"  # and sliced again for the row-parallel proj
    loaded.check(*gpt_batch(batch=8, seq=8))  # and it still equals serial, forward and gradients


def test_refuses_other_model_mesh_or_file(saved, tmp_path):
    plan, path = saved
    with pytest.raises(ap.PlanFileError, match="parameter 'blocks.2.attn.proj.bias'"):
        ap.load_plan(path, small_gpt(layers=3))
    with pytest.raises(ap.PlanFileError, match=r"saved for mesh Mesh\(dp=2, tp=2\), not Mesh\(tp=4\)"):
        ap.load_plan(path, plan.model, mesh=ap.Mesh((4,), ("tp",)))
    with pytest.raises(ap.PlanFileError, match="saved for a GPT model, not Linear"):
        ap.load_plan(path, __import__("torch").nn.Linear(2, 2))
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**json.loads(path.read_text()), "version": 99}))
    with pytest.raises(ap.PlanFileError, match="version 99"):
        ap.load_plan(newer, plan.model)
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(ap.PlanFileError, match="not an autopar plan file"):
        ap.load_plan(other, plan.model)


def test_pipelined_plan_refused_with_the_way_out(tmp_path):
    import torch

    model = MLP(layers=2)
    plan = ap.plan(
        model, ap.Mesh((2,), ("pp",)), args=(torch.randn(8, 16),), pipeline=ap.Pipeline("pp", microbatches=2)
    )
    with pytest.raises(ap.PlanFileError, match="with_pipeline"):
        plan.save(tmp_path / "pp.json")
