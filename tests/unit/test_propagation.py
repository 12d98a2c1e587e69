"""Propagation and emission without processes: the layouts chosen, the collectives inserted,
local shapes, parameter names, readable code."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

import autopar as ap
from autopar.placement import Partial, Replicate, Shard
from tests.harness.models import MEGATRON, MLP, MLP_TP, gpt_batch, gpt_plan

R, S = Replicate(), Shard


def node_by_module(plan, module, op):
    hits = [
        n
        for n in plan.graph.nodes
        if n.op == "call_function"
        and "autopar" in n.meta
        and op in str(n.target)
        and any(p == module for p, _ in (n.meta.get("nn_module_stack") or {}).values())
    ]
    return hits[-1]


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_megatron_collectives_per_layer(layers):
    """Megatron's minimum on tp: 2 all-reduces forward and 2 backward per layer, nothing else."""
    plan = gpt_plan(layers=layers)
    kinds = Counter((c.kind, c.phase) for c in plan.collectives() if c.axis == "tp")
    assert kinds == {("all_reduce", "forward"): 2 * layers, ("all_reduce", "backward"): 2 * layers}
    b, t, h = 8, 8, 32
    for c in plan.collectives():
        assert c.bytes == pytest.approx(2 * (2 - 1) / 2 * b * t * h * 4)


def test_megatron_layouts():
    plan = gpt_plan()
    qkv = node_by_module(plan, "blocks.0.attn.qkv", "linear")
    assert qkv.meta["autopar"].spec == (S(2),)
    proj = node_by_module(plan, "blocks.0.attn.proj", "linear")
    assert proj.meta["autopar"].spec == (Partial(),)
    bias_add = node_by_module(plan, "blocks.0.attn.proj", "add")
    assert bias_add.meta["autopar"].spec == (R,)  # bias added once, after the reduction
    assert bias_add.meta["autopar"].input_targets[0] == (R,)
    heads = node_by_module(plan, "blocks.0.attn", "view")
    assert heads.meta["autopar"].spec == (S(2),)  # (B, T, H, 3, D): heads split


def test_data_parallel_syncs_every_parameter_once():
    plan = gpt_plan("dp4", annotations={})
    model = plan.model
    names = {n for n, p in model.named_parameters()}
    assert set(plan.grad_sync_axes) == names
    sync = [c for c in plan.collectives() if c.phase == "grad sync"]
    assert len(sync) == 1  # one bucket at the default 25 MB
    fwd = [c for c in plan.collectives() if c.phase != "grad sync"]
    assert {c.kind for c in fwd} == {"all_reduce"}  # only the loss and its token count


def test_emitted_module_names_shapes_and_code():
    plan = gpt_plan("dp2xtp2")
    model = plan.model
    gm = plan.module(3)
    assert set(gm.state_dict()) == set(model.state_dict())
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in model.named_parameters()]
    w = gm.get_parameter("blocks.0.attn.qkv.weight")
    assert tuple(w.shape) == (48, 32)  # 96 rows split over tp=2
    assert tuple(gm.get_parameter("blocks.0.mlp.proj.weight").shape) == (32, 64)
    assert tuple(gm.get_parameter("blocks.0.ln_1.weight").shape) == (32,)
    code = gm.code
    assert re.search(
        r"autopar\.all_reduce\.default\(\w+, 'tp', autopar_group_1, autopar_rank, 'sum'(, owned = \w+)?\)", code
    )
    assert (gm.autopar_group_1, gm.autopar_rank, gm.autopar_coord_1) == ([2, 3], 3, 1)  # the rank's own values
    assert gm.code == plan.module(0).code  # one program for every rank
    assert "grad_all_reduce" in code
    assert code.count("autopar.all_reduce.default") == 2 * 2 + 1  # layers x 2, the loss (its sum and count together)


def test_module_is_cached_and_build_is_fresh():
    plan = gpt_plan()
    assert plan.module(0) is plan.module(0)
    assert plan.build_module(0) is not plan.module(0)


def test_local_inputs_split_batch():
    plan = gpt_plan("dp2xtp2")
    idx, tg = gpt_batch()
    (a, b), kw = plan.local_inputs(2, idx, tg)
    assert torch.equal(a, idx[4:]) and torch.equal(b, tg[4:]) and kw == {}


def test_state_dict_round_trip():
    plan = gpt_plan("dp2xtp2")
    model = plan.model
    full = model.state_dict()
    pieces = [plan.shard_state_dict(full, r) for r in range(4)]
    merged = plan.merge_state_dicts(pieces)
    for k, v in full.items():
        assert torch.equal(merged[k], v), k
    assert pieces[1]["blocks.0.attn.qkv.weight"].shape == (48, 32)


def test_print_plan_shows_layouts_and_collectives():
    plan = gpt_plan()
    text = str(plan)
    assert "blocks.0-1 x 2, identical plan" in text and "S(2)" in text and "all_reduce(tp)" in text
    assert "blocks.0.attn.qkv" in plan.table()
    assert "all_reduce(tp, bwd)" in text
    assert "parameters per rank" in plan.summary()


def test_mlp_on_eight_ranks_collectives_and_shapes():
    torch.manual_seed(0)
    model = MLP(layers=3)
    x = torch.randn(8, 16)
    plan = ap.plan(model, ap.Mesh((8,), ("tp",)), args=(x,), annotations=MLP_TP)
    kinds = Counter((c.kind, c.phase) for c in plan.collectives())
    # the first layer reads the user's input, which needs no gradient: no "f" there
    assert kinds == {("all_reduce", "forward"): 3, ("all_reduce", "backward"): 2}
    gm = plan.module(7)
    assert tuple(gm.get_parameter("layers.2.fc1.weight").shape) == (4, 16)
    assert tuple(gm.get_parameter("layers.2.fc2.weight").shape) == (16, 4)
    assert tuple(gm.get_parameter("layers.2.fc2.bias").shape) == (16,)
    plan.check(x)


def test_replanning_a_traced_graph_leaves_nothing_stale():
    """A traced graph planned again on another mesh gets fresh layouts, and the boundary nodes
    the first plan inserted (row-parallel outputs) are not duplicated."""
    from autopar.sharding.annotations import resolve
    from autopar.sharding.propagate import propagate

    plan = gpt_plan("dp2xtp2")
    model = plan.model
    count = sum(1 for _ in plan.graph.nodes)
    mesh = ap.Mesh((2,), ("tp",))
    seeds = resolve(MEGATRON, model, mesh, plan.traced.user_inputs)
    propagate(plan.traced, mesh, seeds)
    assert sum(1 for _ in plan.graph.nodes) == count
    assert all(len(spec) == 1 for n in plan.graph.nodes if "autopar" in n.meta for spec in n.meta["autopar"].outputs)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_plans_display_and_cost_their_sharded_memory(zero):
    torch.manual_seed(0)
    plan = ap.plan(
        MLP(), ap.Mesh((4,), ("dp",)), args=(torch.randn(8, 16),), data_parallel=ap.DataParallel("dp", zero=zero)
    )
    assert "optimizer" in plan.summary() and "after step" in str(plan) and plan._repr_html_()
    memory = plan.cost().memory
    predicted = plan.memory_per_rank(0)
    for key, mine in (("optimizer", "optimizer_state"), ("grads", "grads")):
        value = memory[key].subs({s: 4 for s in memory[key].free_symbols})  # the only symbol: dp
        assert float(value) == predicted[mine]


class _TwoProjections(torch.nn.Module):
    """A norm over sequence pieces feeding two column-parallel projections, each with its row-
    parallel partner: activations far larger than the weights (a LLaMA's q and k at scale)."""

    def __init__(self, d=16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.q, self.k = torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, d // 4, bias=False)
        self.o, self.o2 = torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d // 4, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.o(self.q(h)) + self.o2(self.k(h))


def test_annotated_parameters_compute_in_their_annotated_layout(monkeypatch):
    """Each projection runs column-parallel as annotated: the sequence pieces are gathered for it,
    its weight not moved; costed one consumer at a time, moving the (16x-weighted) small weights
    looked cheaper than gathering the activation, and q and k ran row-parallel on weights
    redistributed every step."""
    from autopar.sharding import propagate

    ann = {"norm": ap.sequence_parallel("tp"), "q": ap.colwise("tp"), "k": ap.colwise("tp"),
           "o": ap.rowwise("tp", output=Shard(1)), "o2": ap.rowwise("tp", output=Shard(1))}  # fmt: skip
    x = torch.randn(8, 256, 16)

    def weight_targets():
        plan = ap.plan(_TwoProjections(), ap.Mesh((2,), ("tp",)), args=(x,), annotations=ann)
        linears = [n for n in plan.graph.nodes if n.target is torch.ops.aten.linear.default]
        return [n.meta["autopar"].input_targets[1] for n in linears], plan

    targets, plan = weight_targets()
    assert targets == [(Shard(0),), (Shard(1),), (Shard(0),), (Shard(1),)]  # q, o, k, o2
    plan.check(x)
    monkeypatch.setattr(propagate, "ANNOTATED_MOVE", propagate.PARAM_COMM_WEIGHT)  # as before
    before = weight_targets()[0]
    assert (before[0], before[2]) != ((Shard(0),), (Shard(0),))
