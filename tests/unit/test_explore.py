"""Plan display: text table and summary, HTML, explain, diff, draw, plots."""

from __future__ import annotations

import shutil

import pytest

import autopar as ap
from autopar.explore.display import plan_rows
from tests.harness.models import shared_gpt_plan

ACT = 4 * 8 * 32 * 4  # one (B/dp, S, H) float32 activation on a rank: 4 KiB; a ring all-reduce over 2 moves it once


@pytest.fixture(scope="module")
def plan():
    return shared_gpt_plan("dp2xtp2")


def test_rows_name_collectives_and_bytes(plan):
    rows = {r.node: r for r in plan_rows(plan)}
    proj = rows["add_tensor_1"]
    assert (proj.module, proj.op, proj.layout) == ("blocks.0.attn.proj", "add", "(S(0), R)")
    assert [(c.kind, c.axis, c.phase) for c in proj.comms] == [("all_reduce", "tp", "forward")]
    assert proj.bytes == ACT
    qkv = rows["linear_default"]
    assert [(c.kind, c.axis, c.phase) for c in qkv.comms] == [("all_reduce", "tp", "backward")]
    bucket = [r for r in rows.values() if r.module == "(grad sync)"]
    params_local = plan.cost().at()["memory"]["params"]
    assert len(bucket) == 1 and bucket[0].bytes == params_local  # 2(n-1)/n = 1 for dp=2
    assert sum(len(r.comms) for r in rows.values()) == len(plan.collectives()) == 10  # the loss: one on dp


def test_text_table_and_summary(plan):
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == "autopar plan for GPT on Mesh(dp=2, tp=2) (4 ranks)"
    assert (
        "communication on tp: 8 collectives, 32.0 KiB per step and rank (forward 16.0 KiB, backward 16.0 KiB)" in text
    )
    local = plan.cost().at()["memory"]["params"] / 1024
    serial = sum(p.numel() * 4 for p in plan.model.parameters()) / 1024
    assert f"parameters per rank: {local:.1f} KiB (serial {serial:.1f} KiB)" in text
    fold = next(line for line in lines if line.startswith("blocks.0-1 x 2, identical plan"))
    assert "all_reduce(tp, bwd) x4, all_reduce(tp) x4" in fold and fold.endswith("32.0 KiB (16.0 KiB each)")
    op = next(line for line in lines if "· add_tensor_1 (add)" in line)  # under blocks.0-1 > attn > proj
    assert op.startswith("      · ") and "(S(0), R)" in op and "all_reduce(tp)" in op and op.endswith("4.0 KiB")
    assert "· layer_norm" not in text  # ops without a collective stay inside their module
    assert "· layer_norm" in str(plan.tree(ops=True))
    row = next(line for line in plan.table().splitlines() if " add_tensor_1 " in line)  # the flat table
    for cell in ("blocks.0.attn.proj", "add", "(S(0), R)", "all_reduce(tp)", "4.0 KiB"):
        assert cell in row
    assert plan.summary() == "\n".join(lines[:6]) and repr(plan.summary()) == plan.summary()
    peak = ap.predict(plan, "h100")["memory"] / 1024  # the headline: the step's largest phase
    assert lines[1].startswith(f"  memory per rank at the step's peak: {peak:.1f} KiB (")


def test_html_is_the_folded_tree_with_collectives_coloured(plan):
    html = plan._repr_html_()
    assert html.count("<details") == html.count("</details>") and html.count("<summary") == html.count("</summary>")
    assert '<summary class="g fold">' in html and 'blocks.0-1 <span class="x">x 2</span> identical plan' in html
    assert html.count('<div class="g op comm">') == 6  # qkv, proj, fc, proj of one block; the loss; the bucket
    # block 0's ops stand for both blocks: block 1's (add_tensor_5, add_tensor_7) are folded into them
    assert "add_tensor_1 (add)" in html and "add_tensor_3 (add)" in html and "add_tensor_5" not in html
    assert "ops without collectives</span></summary>" in html  # hidden, one click away
    assert html.count("background:#f4a3a3") == 6 + 12  # all-reduces: 6 op rows, 12 module lines (fold, attn, mlp: 2)
    assert "all_reduce(tp) x4" in html and "communication on <b>tp</b>: 8 collectives, 32.0 KiB" in html
    assert "memory per rank: params" in html and "on mesh dp=2, tp=2 (4 ranks)" in html
    assert '<details><summary class="g fold">' in html  # a folded block is one line until clicked


def test_progress_line_only_for_slow_steps():
    import io
    import time

    from autopar.explore.progress import progress

    fast, slow = io.StringIO(), io.StringIO()
    with progress("quick", after=5.0, stream=fast):
        pass
    with progress("tracing", after=0.01, stream=slow):
        time.sleep(0.5)
    assert fast.getvalue() == ""
    assert slow.getvalue().startswith("autopar: tracing... done in ")


def test_explain_node_param_module(plan):
    text = plan.explain("linear_default_2")
    assert "rule linear_rule" in text and "<- chosen" in text
    assert "Megatron's f: layer_norm_1 (S(0), R)" in text
    assert (
        "tp: S(2) comes from linear_default_2 <- p_blocks_0_mlp_fc_weight: colwise('tp') from "
        "pattern 'blocks.*.mlp.fc'" in text
    )
    assert "idx: batch dim split on data-parallel axis 'dp'" in text
    assert "used by add_tensor_1 (add) as (S(0), R): all_reduce(tp) 4.0 KiB" in plan.explain("linear_default_1")
    param = plan.explain("blocks.0.mlp.fc.weight")
    assert "-> (R, S(0)), local shape (64, 32)" in param and "gradient summed over dp" in param
    module = plan.explain("blocks.0.mlp")
    assert "collectives: 2, 8.0 KiB per step and rank" in module
    assert "linear_default_3 is (S(0), P) but add_tensor_3 needs (S(0), R)" in module
    assert "tied with lm_head.weight" in plan.explain("wte.weight")
    with pytest.raises(ap.PlanError, match="blocks.0.mlp.fc"):
        plan.explain("blocks.0.mlp.fcc")


def test_diff(plan):
    same = plan.diff(plan)
    assert not same and str(same) == "plans agree: same layouts and collectives"
    d = plan.diff(shared_gpt_plan("dp2xtp2", annotated=False))
    assert len(d.params) == 12  # qkv, proj, fc weights and column biases of 2 blocks
    assert d.params["blocks.0.mlp.fc.weight"] == ("(R, S(0))", "(R, R)")
    node = next(n for n in d.nodes if n.node == "linear_default_2")
    assert node.layout == ("(S(0), S(2))", "(S(0), R)") and node.comms == ("all_reduce(tp, bwd)", "")
    assert "bytes per step on tp: 32.0 KiB -> 0 B" in str(d)


def test_draw_colours_collectives(plan, tmp_path):
    d = plan.draw(0)
    assert d.dot.count('label="all_reduce\\ntp"') == 4
    assert d.dot.count('label="grad_all_reduce\\ntp"') == 4
    assert d.dot.count('label="all_reduce\\ndp"') == 1  # the loss's sum and count, together
    assert "subgraph cluster_" in d.dot and 'label="blocks.1"' in d.dot
    assert "sym_size" not in d.dot  # size arithmetic is left out
    path = d.save(tmp_path / "rank0.dot")
    assert open(path).read() == d.dot
    if shutil.which("dot"):  # Graphviz present: rendered to SVG
        assert "<svg" in d.svg and d._repr_svg_() == d.svg


def test_plots(plan):
    fig = plan.plot_memory()
    ax = fig.axes[0]
    assert len(ax.patches) == 4 * 4  # 4 ranks x (params, grads, optimizer, activations)
    mem = plan.cost().at()["memory"]
    assert ax.patches[0].get_height() * 1024 == pytest.approx(mem["params"])
    fig = plan.plot_comm()
    heights = sorted(p.get_height() for p in fig.axes[0].patches if p.get_height())
    assert heights.count(16.0) == 2  # KiB per block on tp (the loss count on dp is 8 B)
