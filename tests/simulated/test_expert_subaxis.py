"""Expert parallelism over a sub-axis of the data-parallel ranks (docs/experts.md): the batch split
over two mesh axes (``DataParallel("b", replicate_axis="a")``: one merged axis ``a_b``), the experts
over ``b`` only (``Shard(0, within=|b|)``: each group of ranks sharing a's coordinate holds every
expert), over ``a`` only (``Shard(0, across=|b|)``: each group of ranks sharing b's coordinate
holds every expert) or over both. The count exchange and the all-to-alls run inside each group,
the expert weights are stored 1/|b| (1/|a|) and their gradients summed over ``a`` (``b``): their
replicas; the dense ones over the whole merged axis. Against serial: forward, every gradient, 3 AdamW steps (eps 1e-3),
Mixtral- and Qwen3-MoE-shaped, on (2, 2) and (2, 2, 2), with routing that leaves one expert
without a token."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.checkpoint.boxes import local_boxes
from autopar.mesh import SubAxis
from autopar.placement import Shard, counts_piece, merge_tensors, parse_placement, shard_tensor
from autopar.runtime.simulator import run_ranks
from tests.harness import moe as M
from tests.harness import moe_lists as L
from tests.harness.serial import assert_params_close

AB = ap.Mesh((2, 2), ("a", "b"))
ABT = ap.Mesh((2, 2, 2), ("a", "b", "tp"))
DP = ap.DataParallel("b", replicate_axis="a")


def _routed_plan(kind, mesh, axis="b", **dp):
    batches = [M.routing(16, seed=s) for s in range(3)]
    model = M.RoutedExperts(kind)
    ann = {"experts": ap.expert_parallel(axis)}
    dp = ap.DataParallel("b", replicate_axis="a", **dp)
    return model, batches, ap.plan(model, mesh, args=batches[0], annotations=ann, data_parallel=dp, dynamic=False)


def _train(plan, batches):
    """3 AdamW steps (eps 1e-3) on every rank: (each rank's parameters, the merged ones)."""
    per_rank = {}

    def steps(rank):
        module = plan.build_module(rank)
        opt = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1, eps=1e-3)
        for b in batches:
            args, kwargs = plan.local_inputs(rank, *b) if isinstance(b, tuple) else plan.local_inputs(rank, **b)
            M.loss_of(module(*args, **kwargs)).backward()
            opt.step()
            opt.zero_grad()
        per_rank[rank] = {n: p.detach().clone() for n, p in module.named_parameters()}
        return per_rank[rank]

    merged = plan.merge_state_dicts(run_ranks(plan.mesh.size, steps))
    return per_rank, merged


def _replicas_equal(plan, per_rank, names, replicas="outer"):
    """The ranks holding the same experts hold the same values: experts over b, the ranks at the
    same position in b, any a (``replicas="outer"``); over a, those of equal a (``"inner"``)."""
    for group in plan.mesh.groups(plan.mesh.part(0, 2, replicas)):
        for rank in group:
            for n in names:
                assert torch.equal(per_rank[rank][n], per_rank[group[0]][n]), (n, rank, group)


def _experts(model):
    return [n for n, _ in model.named_parameters() if "experts." in n]


def test_sub_axis_groups_and_placement():
    mesh = AB.merge_axes("a", "b")
    assert mesh.sub_axis("b") == (0, SubAxis(0, 2, "inner", "b"))
    assert mesh.sub_axis(("a", "b")) == (0, None)
    assert mesh.groups(mesh.part(0, 2, "inner")) == [(0, 1), (2, 3)]
    assert mesh.groups(mesh.part(0, 2, "outer")) == [(0, 2), (1, 3)]
    p = Shard(0, within=2)
    assert parse_placement(repr(p)) == p and parse_placement(repr(Shard(0, of=(3, 8), within=2))).within == 2
    w = torch.arange(8.0).view(4, 2)
    pieces = [shard_tensor(w, (p,), mesh, r) for r in range(4)]
    assert [x[:, 0].tolist() for x in pieces] == [[0, 2], [4, 6], [0, 2], [4, 6]]
    assert torch.equal(merge_tensors(pieces, (p,), mesh), w)
    assert mesh.sub_axis("a") == (0, SubAxis(0, 2, "outer", "a"))
    q = Shard(0, across=2)  # rank 2k, 2k+1 (a = k) hold piece k; only the first of the two counts it
    assert parse_placement(repr(q)) == q and parse_placement(repr(Shard(1, of=(3, 8), across=2))).across == 2
    pieces = [shard_tensor(w, (q,), mesh, r) for r in range(4)]
    assert [x[:, 0].tolist() for x in pieces] == [[0, 2], [0, 2], [4, 6], [4, 6]]
    assert torch.equal(merge_tensors(pieces, (q,), mesh), w)
    assert [counts_piece((q,), (c,)) for c in range(4)] == [True, False, True, False]
    for r, piece in enumerate(pieces):  # DCP's boxes: each piece at its global offset
        assert [(o, s) for o, s, _ in local_boxes((4, 2), (q,), mesh, r, piece)] == [((2 * (r // 2), 0), (2, 2))]
    assert [counts_piece((p,), (c,)) for c in range(4)] == [True, True, False, False]
    with pytest.raises(ap.PlanError, match="give one"):
        Shard(0, within=2, across=2)


@pytest.mark.parametrize(
    "kind,zero,axis",
    [("mixtral", 0, "b"), ("qwen3_moe", 0, "b"), ("mixtral", 3, "b"), ("mixtral", 0, "a"), ("mixtral", 3, "a")],
    ids=["mixtral", "qwen3", "hsdp", "outer", "outer-hsdp"],
)
def test_routed_experts_on_one_axis(kind, zero, axis):
    """HF's experts fed routing that never picks the last expert: 2 of the 4 experts per rank,
    the dispatch on ``axis`` (b: within the groups of a_b, a: across them), the experts' gradients
    summed over the other one, 3 AdamW steps equal serial. zero=3 (HSDP: the dense weights sharded
    over b, replicated over a; the experts over a are replicated over b, the axis zero=3 shards):
    the same for the experts."""
    model, batches, plan = _routed_plan(kind, AB, axis=axis, zero=zero)
    other = {"a": "b", "b": "a"}[axis]
    moe = [c for c in plan.collectives() if c.node.startswith("moe_experts")]
    # counts, rows, outputs back; backward: the outputs' gradients (the input x needs none)
    assert [c.kind for c in moe] == ["all_to_all"] * 4 and {c.axis for c in moe} == {axis}, moe
    buckets = plan.grad_buckets(0)
    experts = set(_experts(model))
    by_axes = {n: b.axes for b in buckets for n in b.names}
    replicas = "outer" if axis == "b" else "inner"
    assert all(by_axes[n] == (SubAxis(0, 2, replicas, other),) for n in experts), by_axes
    assert all(by_axes[n] == (0,) for n in by_axes if n not in experts), by_axes  # zero=3: none
    synced = {c.axis for c in plan.collectives() if c.phase == "grad sync"}
    assert synced == {other, "a_b"}, synced  # zero=3: the dense ones reduce-scattered over a_b
    for rank in range(4):
        local = dict(plan.module(rank).named_parameters())
        assert all(local[n].shape[0] == M.EXPERTS // 2 for n in experts if local[n].dim() == 3)
    assert f"all_to_all({axis})" in plan.explain("moe_experts_default")
    assert f"summed over {other} " in plan.explain("experts.down_proj")
    plan.check(*batches[0], rtol=1e-4, atol=1e-5)
    serial = M.train_serial(M.RoutedExperts(kind), batches, eps=1e-3)
    per_rank, merged = _train(plan, batches)
    assert_params_close(merged, serial)
    _replicas_equal(plan, per_rank, experts, replicas)


def test_routed_experts_over_both_axes():
    """Experts over (a, b): one expert per rank, the dispatch over the whole merged axis."""
    model, batches, plan = _routed_plan("mixtral", AB, axis=("a", "b"))
    moe = [c for c in plan.collectives() if c.node.startswith("moe_experts")]
    assert {c.axis for c in moe} == {"a_b"}, moe
    assert not any(n in b.names for b in plan.grad_buckets(0) for n in _experts(model))
    plan.check(*batches[0], rtol=1e-4, atol=1e-5)
    serial = M.train_serial(M.RoutedExperts("mixtral"), batches, eps=1e-3)
    assert_params_close(M.train_ranks(plan, batches, eps=1e-3), serial)


@pytest.mark.parametrize("kind", M.KINDS)
def test_whole_model_on_a_b_tp(kind):
    """(2, 2, 2): batch over (a, b), Megatron on tp, experts over b: forward, every gradient and
    3 AdamW steps (eps 1e-3) equal serial; no gather of tokens on the dp axes."""
    model, kw = M.moe_model(kind)
    ann = dict(ap.presets.megatron(model, "tp", kwargs=kw, expert_axis="b", vocab=False))
    plan = ap.plan(model, ABT, kwargs=kw, annotations=ann, data_parallel=DP, dynamic=False)
    comms = plan.collectives()
    moe = [c for c in comms if c.node.startswith("moe_experts")]
    assert {c.axis for c in moe} == {"b"} and len(moe) == 5, moe
    on_dp = [c for c in comms if c.axis in ("a_b", "b") and c.phase != "grad sync" and c not in moe]
    assert {(c.kind, c.node) for c in on_dp} == {("all_reduce", "cross_entropy_loss")}, on_dp
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    batches = [kw] + [M.moe_model(kind, seed=s)[1] for s in (5, 6)]
    per_rank, merged = _train(plan, batches)
    serial = M.train_serial(M.moe_model(kind)[0], batches, eps=1e-3)
    assert_params_close(merged, serial, rtol=1e-5, atol=1e-6)
    _replicas_equal(plan, per_rank, _experts(model))


def test_whole_mixtral_experts_over_a():
    """A whole Mixtral on (2, 2), the batch over (a, b), the experts over a (the outer axis): the
    dispatch's all-to-alls on a, the experts' gradients summed over b; forward, every gradient
    and 3 AdamW steps (eps 1e-3) equal serial, the ranks of equal a hold the same experts after
    them. presets.megatron(..., expert_axis="a") names the same annotation."""
    model, kw = M.moe_model("mixtral")
    preset = ap.presets.megatron(model, "tp", kwargs=kw, expert_axis="a", vocab=False)
    assert preset["model.layers.0.mlp.experts"] == ap.expert_parallel("a")
    ann = {"model.layers.*.mlp.experts": ap.expert_parallel("a")}
    plan = ap.plan(model, AB, kwargs=kw, annotations=ann, data_parallel=DP, dynamic=False)
    comms = plan.collectives()
    moe = [c for c in comms if c.node.startswith("moe_experts")]
    assert {c.axis for c in moe} == {"a"} and len(moe) == 5, moe
    on_dp = [c for c in comms if c.phase != "grad sync" and c not in moe]
    assert {(c.kind, c.axis, c.node) for c in on_dp} == {("all_reduce", "a_b", "cross_entropy_loss")}, on_dp
    assert {c.axis for c in comms if c.phase == "grad sync"} == {"a_b", "b"}
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    batches = [kw] + [M.moe_model("mixtral", seed=s)[1] for s in (5, 6)]
    per_rank, merged = _train(plan, batches)
    assert_params_close(merged, M.train_serial(M.moe_model("mixtral")[0], batches, eps=1e-3), rtol=1e-5, atol=1e-6)
    _replicas_equal(plan, per_rank, _experts(model), "inner")


def test_list_experts_over_a():
    """A per-expert ModuleList over a on (2, 2): rank 2 (a=1, b=0) holds experts 2-3 whole and
    0-1 empty, as rank 3 does; forward, every gradient and 3 AdamW steps equal serial."""
    batches = [M.routing(16, seed=s) for s in range(3)]
    ann = {"experts": ap.expert_parallel("a")}
    plan = ap.plan(
        L.RoutedListExperts("mixtral"), AB, args=batches[0], annotations=ann, data_parallel=DP, dynamic=False
    )
    assert plan.param_specs["experts.3.w1.weight"] == (Shard(0, of=(3, 4), across=2),)
    for rank in (2, 3):
        local = {n: tuple(p.shape) for n, p in plan.module(rank).named_parameters()}
        assert local["experts.3.w1.weight"] == (M.FFN, M.HIDDEN) and local["experts.0.w1.weight"] == (0, M.HIDDEN)
    assert {(c.kind, c.axis) for c in plan.collectives() if c.node.startswith("moe_experts")} == {("all_to_all", "a")}
    plan.check(*batches[0], rtol=1e-4, atol=1e-5)
    serial = M.train_serial(L.RoutedListExperts("mixtral"), batches, eps=1e-3)
    per_rank, merged = _train(plan, batches)
    assert_params_close(merged, serial)
    _replicas_equal(plan, per_rank, [n for n in serial if "experts." in n], "inner")


def test_saved_plan_keeps_the_groups(tmp_path):
    """plan.save / ap.load_plan: the merged axis' parts travel with the mesh, so the loaded plan
    names the dispatch's and the experts' sync's groups as the saved one does."""
    model, batches, plan = _routed_plan("mixtral", AB)
    plan.save(tmp_path / "p.json")
    loaded = ap.load_plan(tmp_path / "p.json", model, args=batches[0])
    assert [(c.kind, c.axis, c.phase) for c in loaded.collectives()] == [
        (c.kind, c.axis, c.phase) for c in plan.collectives()
    ]
    assert loaded.param_specs["experts.down_proj"] == (Shard(0, within=2),)


def test_list_experts_within_groups_with_expert_tp():
    """A per-expert ModuleList over b with each expert tp-split, on (2, 2, 2): rank 5 (a=1, b=0,
    tp=1) holds experts 0-1 (w1/w3 column halves, w2 row halves), 2-3 empty; forward, every
    gradient and 3 AdamW steps equal serial."""
    batches = [M.routing(16, seed=s) for s in range(3)]
    ann = {"experts": ap.expert_parallel("b", tp="tp")}
    plan = ap.plan(
        L.RoutedListExperts("mixtral"), ABT, args=batches[0], annotations=ann, data_parallel=DP, dynamic=False
    )
    local = {n: tuple(p.shape) for n, p in plan.module(5).named_parameters()}
    half = M.FFN // 2
    assert local["experts.0.w1.weight"] == (half, M.HIDDEN) and local["experts.0.w2.weight"] == (M.HIDDEN, half)
    assert local["experts.3.w1.weight"] == (half, 0) and local["experts.3.w2.weight"] == (0, half)
    plan.check(*batches[0], rtol=1e-4, atol=1e-5)
    serial = M.train_serial(L.RoutedListExperts("mixtral"), batches, eps=1e-3)
    per_rank, merged = _train(plan, batches)
    assert_params_close(merged, serial)
    _replicas_equal(plan, per_rank, [n for n in serial if "experts." in n])


def test_sub_axis_errors():
    """More ranks than experts over both axes, and two axes that are not the merged pair."""
    batch = M.routing(16)
    with pytest.raises(ap.PlanError, match="more ranks than experts"):
        ap.plan(
            M.RoutedExperts("mixtral"),
            ap.Mesh((2, 4), ("a", "b")),
            args=batch,
            annotations={"experts": ap.expert_parallel(("a", "b"))},
            data_parallel=DP,
        )
    with pytest.raises(ap.PlanError, match="are not one data-parallel axis"):
        ap.plan(
            M.RoutedExperts("mixtral"),
            AB,
            args=batch,
            annotations={"experts": ap.expert_parallel(("b", "a"))},
            data_parallel=DP,
        )


def test_pipeline_with_experts_over_b():
    """(2, 2, 2) pp x a x b: two Mixtral layers in two stages, the batch over (a, b), the experts
    over b: every rank's loss equals serial for 3 AdamW steps (eps 1e-3) and after them."""
    model, batch, _ = M.mixtral_lm()
    ann = {"m.model.layers.*.mlp.experts": ap.expert_parallel("b"), "m.model.layers.1": ap.split_before()}
    mesh = ap.Mesh((2, 2, 2), ("pp", "a", "b"))
    plan = ap.plan(model, mesh, args=batch, annotations=ann, data_parallel=DP, pipeline=ap.Pipeline("pp", 2))
    assert {(c.kind, c.axis) for c in plan.collectives() if c.node.startswith("moe_experts")} == {("all_to_all", "b")}
    M.assert_pipeline_steps_equal_serial(plan, model, batch, eps=1e-3)


def test_zero2_steps_the_experts_whole():
    """zero=2 shards the dense buckets' gradients and optimizer state over a_b; the experts'
    bucket (synced over a) is stepped whole by ap.ZeroOptimizer: 3 AdamW steps equal serial."""
    model, batches, plan = _routed_plan("mixtral", AB, zero=2)

    def steps(rank):
        module = plan.build_module(rank)
        opt = plan.zero_optimizer(module, torch.optim.AdamW, lr=0.01, weight_decay=0.1, eps=1e-3)
        for b in batches:
            args, _ = plan.local_inputs(rank, *b)
            M.loss_of(module(*args)).backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    merged = plan.merge_state_dicts(run_ranks(4, steps))
    assert_params_close(merged, M.train_serial(M.RoutedExperts("mixtral"), batches, eps=1e-3))
