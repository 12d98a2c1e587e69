"""The default view (print(plan), the notebook's HTML): a module tree whose size follows the
model's distinct structure, repeated blocks folded, a block that differs shown apart."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

import autopar as ap
from autopar.explore.display import comm_label
from autopar.explore.module_tree import ModuleNode, index_text, module_tree
from autopar.explore.search_view import options
from tests.harness.models import MLP, gpt_plan, shared_gpt_plan


def _every_comm(node: ModuleNode, times: int = 1) -> Counter:
    """(label, bytes) of every collective the tree stands for, a fold's first block counted count times."""
    out: Counter = Counter()
    for item in node.items:
        if isinstance(item, ModuleNode):
            out += _every_comm(item, times * item.count)
        else:
            out.update({(comm_label(c), c.bytes): times for c in item.comms})
    return out


def _planned(plan) -> Counter:
    return Counter((comm_label(c), c.bytes) for c in plan.collectives())


@pytest.fixture(scope="module")
def uneven_mlp():
    """Six blocks, block 2 left unannotated: 0 | 1 | 2 | 3-5 (block 0 reads the input, which needs
    no gradient, so it has no Megatron 'f'; block 1 has one)."""
    torch.manual_seed(0)
    blocks = (0, 1, 3, 4, 5)
    ann = {f"layers.{i}.fc1": ap.colwise("tp") for i in blocks} | {f"layers.{i}.fc2": ap.rowwise("tp") for i in blocks}
    return ap.plan(MLP(layers=6), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 16),), annotations=ann)


def test_identical_blocks_fold_and_differing_blocks_stand_apart(uneven_mlp):
    tree = module_tree(uneven_mlp)
    layers = tree.find("layers")
    assert [c.name for c in layers.children()] == ["0", "1,3-5", "2"]  # shown where each first appears
    fold = tree.find("layers.4")
    assert (
        fold.paths == ("layers.1", "layers.3", "layers.4", "layers.5") and fold.title() == "1,3-5 x 4, identical plan"
    )
    assert fold.differs == "differs from 0 first at fc1: linear (S(1)) all_reduce(tp, bwd) 256 B, there linear (S(1))"
    assert tree.find("layers.2").differs == "differs from 0 first at fc1: weight (R), there weight (S(0))"
    assert not tree.find("layers.0").differs
    text = str(uneven_mlp)
    assert "    (differs from 0 first at fc1: weight (R), there weight (S(0)))" in text
    assert fold.bytes() == 4 * 512 and "2.0 KiB (512 B each)" in text


def test_alternating_blocks_fold_into_two():
    """Every other block split (dense and MoE layers, sliding and global attention alternate so)."""
    torch.manual_seed(0)
    split = (2, 4, 6)  # block 0 reads the input (no Megatron f): it stands apart from 2, 4, 6
    ann = {f"layers.{i}.fc1": ap.colwise("tp") for i in (0, *split)}
    ann |= {f"layers.{i}.fc2": ap.rowwise("tp") for i in (0, *split)}
    plan = ap.plan(MLP(layers=8), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 16),), annotations=ann)
    tree = module_tree(plan)
    assert [c.name for c in tree.find("layers").children()] == ["0", "1-7 step 2", "2,4,6"]
    assert tree.find("layers.5").count == 4 and _every_comm(tree) == _planned(plan)
    assert index_text([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and index_text([3]) == "3"


@pytest.mark.parametrize("which", ["gpt", "mlp"])
def test_the_tree_stands_for_every_collective_once(which, uneven_mlp):
    """Folding loses nothing: the tree's collectives, each fold counted count times, are the plan's."""
    plan = shared_gpt_plan("dp2xtp2") if which == "gpt" else uneven_mlp
    tree = module_tree(plan)
    assert _every_comm(tree) == _planned(plan)
    assert tree.bytes() == pytest.approx(sum(c.bytes for c in plan.collectives()))


def test_text_grows_with_distinct_structure_not_depth():
    shallow, deep = gpt_plan("dp2xtp2", layers=2), gpt_plan("dp2xtp2", layers=8)
    assert _every_comm(module_tree(deep)) == _planned(deep)
    a, b = str(shallow), str(deep)
    assert len(b) <= 1.1 * len(a) and len(b.splitlines()) == len(a.splitlines())
    assert "blocks.0-7 x 8, identical plan" in b
    flat_a, flat_b = deep.table(), shallow.table()
    assert len(flat_a.splitlines()) > 3 * len(flat_b.splitlines()) / 1.5  # the flat table grows with depth


def test_ops_true_lists_every_op_of_one_block(uneven_mlp):
    plan = shared_gpt_plan("dp2xtp2")
    all_ops = str(plan.tree(ops=True))
    only = str(plan)
    assert all_ops.count("· ") > 3 * only.count("· ")
    assert "· layer_norm_1 (layer_norm)" in all_ops and "· layer_norm_2 " not in all_ops  # block 1 is folded
    html = plan.tree(ops=True)._repr_html_()
    assert "ops without collectives" not in html and "layer_norm_1 (layer_norm)" in html


def test_param_on_mesh_shows_each_ranks_piece():
    plan = shared_gpt_plan("dp2xtp2")
    fc = plan.param_on_mesh("blocks.0.mlp.fc.weight")  # colwise: rows split on tp, whole on dp
    assert str(fc).splitlines()[2:] == ["dp=0  0:64, :    64:128, :", "dp=1  0:64, :    64:128, :"]
    for rank in range(4):  # the pieces are the ones the state dict gets
        full = torch.arange(128 * 32.0).reshape(128, 32)
        piece = plan.shard_state_dict({"blocks.0.mlp.fc.weight": full}, rank)["blocks.0.mlp.fc.weight"]
        (a, b), (c, d) = fc.pieces[rank][0][0], fc.pieces[rank][1][0]
        assert torch.equal(piece, full[a:b, c:d])
    proj = plan.param_on_mesh("blocks.0.attn.proj.weight")
    assert proj.cell_text(3) == ":, 16:32" and proj.cell_text(2) == ":, 0:16"
    svg = proj._repr_svg_()
    assert svg.startswith("<svg") and svg.count('fill="#3b82f6"') == 4 and "rank 3 (1, 1): [:, 16:32]" in svg
    with pytest.raises(ap.PlanError, match="Did you mean blocks.0.mlp.fc.weight"):
        plan.param_on_mesh("blocks.0.mlp.fc.weigth")


def test_param_on_mesh_uneven_pieces():
    """Rows that do not divide: tensor_split's pieces, as the ranks store them (17, 17, 16, 16)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 66), torch.nn.ReLU(), torch.nn.Linear(66, 16))
    ann = {"0": ap.colwise("tp"), "2": ap.rowwise("tp")}
    plan = ap.plan(model, ap.Mesh((4,), ("tp",)), args=(torch.randn(4, 16),), annotations=ann)
    view = plan.param_on_mesh("0.weight")
    assert [view.cell_text(r) for r in range(4)] == ["0:17, :", "17:34, :", "34:50, :", "50:66, :"]
    assert plan.param_on_mesh("2.weight").cell_text(1) == ":, 17:34"


def test_search_view_plots_the_options_weighed():
    from tests.harness.models import gpt_batch, small_gpt

    plan = ap.plan(
        small_gpt(layers=2),
        ap.Mesh((2, 2), ("a", "b")),
        args=gpt_batch(),
        auto=ap.Auto(device="h100", memory_budget=250e3),
    )
    rec = plan.built["auto"]
    view = plan.search_view()
    lines = str(view).splitlines()
    assert len(lines) == 1 + len(rec["runners_up"]) + bool(rec["binding"])
    assert lines[1].startswith(rec["chosen"]) and lines[1].endswith("<- chosen")
    if rec["binding"]:  # the fastest option, refused by the budget, drawn as a cross
        assert lines[-1].endswith("(over budget)") and rec["binding"]["faster"]["option"] in lines[-1]
    ax = plan.plot_search().axes[0]
    assert ax.get_xlabel() == "memory per rank (KiB)" and ax.lines[0].get_xdata()[0] == pytest.approx(250e3 / 1024)
    shown = sum(len(c.get_offsets()) for c in ax.collections)
    assert shown >= len(rec["runners_up"]) + bool(rec["binding"])  # every option, and the chosen starred
    html = view._repr_html_()
    assert html.count("<tr") == len(lines) and "data:image/png;base64," in html and "automatic plan:" in html
    with pytest.raises(ap.PlanError, match="auto=ap.Auto"):
        shared_gpt_plan("dp2xtp2").search_view()


def test_search_view_explains_any_option_it_weighed(tmp_path):
    """Choosing an option of the search view plans it (ap.Auto(option=...)) and explains it:
    the same record, that option chosen, its predicted time the search's figure for it."""
    from tests.harness.models import gpt_batch, small_gpt

    auto = ap.Auto(device="h100", memory_budget=250e3)
    plan = ap.plan(small_gpt(layers=2), ap.Mesh((2, 2), ("a", "b")), args=gpt_batch(), auto=auto)
    view = plan.search_view()
    rows = options(plan.built["auto"])
    runner = view.runner_up()
    assert runner == plan.built["auto"]["runner_up"]["option"] and runner != plan.built["auto"]["chosen_option"]
    text = view.explain()
    theirs = view.option_plan(runner).built["auto"]
    assert text.startswith(f"automatic plan: {runner} (asked for with ap.Auto(option=...); the search itself chooses")
    assert theirs["chosen_option"] == runner and theirs["options"] == plan.built["auto"]["options"]
    assert theirs["time_s"] == pytest.approx(next(r["time_s"] for r in rows if r["option"] == runner))
    refused = next(i for i, r in enumerate(rows) if not r["fits"])  # over the budget: planned all the same
    assert view.option_plan(refused).built["auto"]["memory"] > 250e3
    assert view.option_plan(next(i for i, r in enumerate(rows) if r["chosen"])) is plan
    widget = view.widget()  # choosing an option in the dropdown shows its explain
    widget.children[1].value = runner
    assert widget.children[2].value.startswith(f"<pre>automatic plan: {runner} (asked for")
    html = view._repr_html_()
    assert f"the runner-up: {runner}: explain" in html and html.count("automatic plan:") == 2
    with pytest.raises(ap.PlanError, match="weighed no such option.*options are"):
        ap.plan(small_gpt(layers=2), ap.Mesh((2, 2), ("a", "b")), args=gpt_batch(), auto=replace(auto, option="a=x"))
    plan.save(tmp_path / "plan.json")
    loaded = ap.load_plan(tmp_path / "plan.json", plan.model).search_view()
    assert str(loaded) == str(view) and "the runner-up:" not in loaded._repr_html_()
    with pytest.raises(ap.PlanError, match="loaded from a plan file"):
        loaded.explain()


def test_diff_text_folds_blocks_with_the_same_changes():
    a, b = shared_gpt_plan("dp2xtp2"), shared_gpt_plan("dp2xtp2", annotated=False)
    d = a.diff(b)
    text = str(d).splitlines()
    assert "  blocks.0-1 x 2, the same changes in each (block 0's nodes):" in text
    block = [line for line in text if line.startswith("    ")]
    assert len(block) * 2 == sum(1 for n in d.nodes if n.module.startswith("blocks."))  # one block of two
    assert "    linear_default_2 (mlp.fc): (S(0), S(2)) -> (S(0), R); all_reduce(tp, bwd) -> -" in text
    assert "  parameter blocks.{0-1}.mlp.fc.weight: (R, S(0)) -> (R, R)" in text
    assert len(d.params) == 12 and sum(line.startswith("  parameter ") for line in text) == 6


def test_blocks_on_different_pipeline_stages_fold_apart():
    """Four identical blocks on two stages: two folds, each saying its stage once (the pipeline's
    stage is part of a block's plan); every collective still counted once."""
    from tests.harness.models import gpt_batch, small_gpt

    plan = ap.plan(
        small_gpt(layers=4), ap.Mesh((2,), ("pp",)), args=gpt_batch(), pipeline=ap.Pipeline("pp", microbatches=2)
    )
    tree = module_tree(plan)
    blocks = tree.find("blocks")
    assert blocks.stages() == (0, 1) and blocks.stage_text == ""  # spans both: its parts say theirs
    assert [(f.name, f.count, f.stages()) for f in blocks.children()] == [("0-1", 2, (0,)), ("2-3", 2, (1,))]
    text = str(plan)
    assert "0-1 x 2, identical plan, stage 0" in text and "2-3 x 2, identical plan, stage 1" in text
    assert all(", stage" not in line for line in text.splitlines() if "· " in line)  # said on modules, not ops
    assert "runs on stage 1, 0-1 on stage 0" in text and "identical plan, stage 1" in plan._repr_html_()
    assert _every_comm(tree) == _planned(plan)
