"""Per-expert ModuleList experts (HF's MoE blocks up to transformers 4.4x: tests/harness/
moe_lists.py) dispatched like stacked ones (docs/experts.md): against serial (forward, every
gradient, 3 AdamW steps) on (4,) and (2, 2) dp x tp, each rank holding E/n experts under their
own names; plain data parallelism without a gather; the errors."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from tests.harness import moe as M
from tests.harness import moe_lists as L
from tests.harness.serial import assert_params_close

DP4 = ap.Mesh((4,), ("dp",))
DP2TP2 = ap.Mesh((2, 2), ("dp", "tp"))


def _plan(model, kw, mesh):
    if "tp" in mesh.axis_names:
        ann = dict(ap.presets.megatron(model, "tp", kwargs=kw, expert_axis="dp", vocab=False))
        assert ann["model.layers.0.mlp.experts"] == ap.expert_parallel("dp")
        assert not any(".experts." in path for path in ann)  # the experts' own linears are left to the list
    else:
        ann = dict(L.EP)
    return ap.plan(model, mesh, kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)


def test_list_blocks_compute_what_the_fused_ones_do():
    """The harness's ModuleList blocks take the fused blocks' weights: the same losses."""
    for kind in ("mixtral", "olmoe"):
        fused, kw = M.moe_model(kind)
        listed, _ = L.list_model(kind)
        assert isinstance(listed.model.layers[0].mlp.experts, torch.nn.ModuleList)
        torch.testing.assert_close(listed(**kw).loss, fused(**kw).loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kind,mesh",
    [("mixtral", DP4), ("mixtral", DP2TP2), ("qwen2_moe", DP2TP2), ("olmoe", DP4)],
    ids=["mixtral-dp4", "mixtral-dp2xtp2", "qwen2-dp2xtp2", "olmoe-dp4"],
)
def test_list_experts_dispatch_matches_serial(kind, mesh):
    model, kw = L.list_model(kind)
    plan = _plan(model, kw, mesh)
    comms = plan.collectives()
    moe = [c for c in comms if c.node.startswith("moe_experts")]
    assert [c.kind for c in moe] == ["all_to_all"] * 5 and {c.axis for c in moe} == {"dp"}, moe
    on_dp = {(c.kind, c.node) for c in comms if c.axis == "dp" and c.phase != "grad sync" and c not in moe}
    assert on_dp == {("all_reduce", "cross_entropy_loss")}, on_dp  # no gather: the loss mean's one all-reduce
    experts = [n for n, _ in model.named_parameters() if ".mlp.experts." in n]
    synced = {n for b in plan.grad_buckets(0) for n in b.names if 0 in b.axes}
    assert experts and not synced & set(experts)
    dp = plan.mesh.shape[0]
    full = dict(model.named_parameters())
    for rank in (0, plan.mesh.size - 1):
        local = dict(plan.module(rank).named_parameters())
        whole = {n for n in experts if local[n].shape == full[n].shape}
        assert all(local[n].numel() == 0 for n in set(experts) - whole)
        owner = plan.mesh.coords(rank)[0]
        held = {int(n.split(".experts.")[1].split(".")[0]) for n in whole}
        assert held == set(range(owner * M.EXPERTS // dp, (owner + 1) * M.EXPERTS // dp)), (rank, held)
    plan.check(**kw, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind,mesh", [("mixtral", DP4), ("qwen2_moe", DP2TP2)], ids=["mixtral-dp4", "qwen2-dp2xtp2"])
def test_routed_list_experts_three_adamw_steps(kind, mesh):
    """HF's loop over a ModuleList fed a chosen routing (the last expert never chosen): 3 AdamW
    steps on every rank equal serial; the merged state dict has the serial names."""
    batches = [M.routing(16, seed=s) for s in range(3)]
    serial = M.train_serial(L.RoutedListExperts(kind), batches)
    model = L.RoutedListExperts(kind)
    plan = ap.plan(model, mesh, args=batches[0], annotations=L.EP_ROUTED, data_parallel="dp", dynamic=False)
    plan.check(*batches[0], rtol=1e-4, atol=1e-5)
    merged = M.train_ranks(plan, batches)
    assert list(merged) == list(serial)
    assert_params_close(merged, serial, rtol=1e-4, atol=1e-6)


def test_whole_list_model_three_adamw_steps():
    """A whole Mixtral of ModuleList experts, Megatron on tp and experts on dp, 3 AdamW steps
    (tolerance as test_expert_parallel's whole models: top-k on float noise)."""
    model, kw = L.list_model("mixtral")
    batches = [kw] + [L.list_model("mixtral", seed=s)[1] for s in (5, 6)]
    plan = _plan(model, kw, DP2TP2)
    merged = M.train_ranks(plan, batches)
    assert_params_close(merged, M.train_serial(model, batches), rtol=1e-3, atol=5e-5)


def test_list_experts_on_an_axis_that_does_not_split_the_batch():
    """Experts on tp, batch on dp: each tp rank runs the rows of its own experts (no dispatch),
    the outputs summed over tp; expert 0 held by tp rank 0 only."""
    model, kw = L.list_model("qwen2_moe")
    ann = {"model.layers.*.mlp.experts": ap.expert_parallel("tp")}
    plan = ap.plan(model, DP2TP2, kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)
    moe = {(c.kind, c.axis) for c in plan.collectives() if c.node.startswith("moe_experts")}
    assert moe == {("all_reduce", "tp")}, moe
    first = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert [tuple(plan.module(r).get_parameter(first).shape) for r in (0, 1)] == [(32, 16), (0, 16)]
    plan.check(**kw, rtol=1e-4, atol=1e-5)


def test_list_experts_with_zero3():
    """zero=3 on dp shards the dense parameters (1-D pieces); the experts stay whole on their ranks."""
    model, kw = L.list_model("mixtral")
    plan = ap.plan(model, DP4, kwargs=kw, annotations=dict(L.EP), data_parallel=ap.DataParallel("dp", zero=3))
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    local = dict(plan.module(1).named_parameters())
    assert local["model.embed_tokens.weight"].dim() == 1
    assert local["model.layers.0.mlp.experts.1.w1.weight"].shape == (M.FFN, M.HIDDEN)


def test_list_experts_dynamic_shapes():
    """Traced with dynamic batch and sequence (the default): the loop's data-dependent row counts
    beside the symbolic sizes; equal to serial, and at another batch and sequence length."""
    model, kw = L.list_model("mixtral")
    plan = ap.plan(model, DP4, kwargs=kw, annotations=dict(L.EP), data_parallel="dp")
    assert plan.traced.dynamic
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    _, other = L.list_model("mixtral", batch=8, seq=4)
    losses = plan.simulate(lambda module, *a, **k: module(*a, **k).loss.item(), **other)
    assert losses == pytest.approx([model(**other).loss.item()] * 4, rel=1e-5)


def test_plain_data_parallel_keeps_list_tokens_split():
    """No annotation: the list is still one op, each rank runs its tokens through every expert."""
    model, kw = L.list_model("olmoe")
    plan = ap.plan(model, DP4, kwargs=kw, data_parallel="dp", dynamic=False)
    on_dp = {(c.kind, c.node) for c in plan.collectives() if c.axis == "dp" and c.phase != "grad sync"}
    assert on_dp == {("all_reduce", "cross_entropy_loss")}, on_dp
    plan.check(**kw, rtol=1e-4, atol=1e-5)


class Chain(torch.nn.Module):
    """A ModuleList that is no MoE: its linears run one after the other on every row."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.relu()


def test_list_errors():
    batch = M.routing(16)
    with pytest.raises(ap.PlanError, match="more ranks than experts"):
        ap.plan(L.RoutedListExperts(), ap.Mesh((8,), ("dp",)), args=batch, annotations=L.EP_ROUTED, data_parallel="dp")
    chain = {"layers": ap.expert_parallel("dp")}
    with pytest.raises(ap.PlanError, match="not recognised as a per-expert ModuleList"):
        ap.plan(Chain(), ap.Mesh((2,), ("dp",)), args=(torch.randn(4, 8),), annotations=chain, data_parallel="dp")


@pytest.mark.parametrize("kind,bias", [("mixtral", False), ("qwen2_moe", False), ("mixtral", True)])
def test_list_expert_tensor_parallel_routed(kind, bias):
    """Expert tensor parallelism of a ModuleList: experts on dp, each expert's w1/w3 (gate/up)
    column-split and w2 (down) row-split on tp; expert 0 held by dp rank 0 only, half of it per
    tp rank; forward, every gradient and 3 AdamW steps equal serial. With biases: w1's and w3's
    split with their weights (half on each tp rank of expert 0's dp rank), w2's whole there and
    added once (the op reads it as a partial sum: tp rank 0 adds it), no gradient of an expert
    summed over tp."""
    batches = [M.routing(16, seed=s) for s in range(3)]
    model = L.RoutedListExperts(kind, bias=bias)
    ann = {"experts": ap.expert_parallel("dp", tp="tp")}
    plan = ap.plan(model, DP2TP2, args=batches[0], annotations=ann, data_parallel="dp", dynamic=False)
    up, down = ("w1", "w2") if kind == "mixtral" else ("gate_proj", "down_proj")
    shapes = lambda name: [tuple(plan.module(r).get_parameter(name).shape) for r in range(4)]  # noqa: E731
    assert shapes(f"experts.0.{up}.weight") == [(M.FFN // 2, M.HIDDEN)] * 2 + [(M.FFN // 2, 0)] * 2
    assert shapes(f"experts.0.{down}.weight") == [(M.HIDDEN, M.FFN // 2)] * 2 + [(0, M.FFN // 2)] * 2
    if bias:
        assert shapes(f"experts.0.{up}.bias") == [(M.FFN // 2,)] * 2 + [(0,)] * 2
        assert shapes(f"experts.3.{down}.bias") == [(0,)] * 2 + [(M.HIDDEN,)] * 2
        assert "(S(0,of=0/4), P) (local)" in plan.explain("moe_experts_default")
    tp_synced = {n for b in plan.grad_buckets(0) if 1 in b.axes for n in b.names}
    assert not any(n.startswith("experts.") for n in tp_synced), tp_synced
    moe = {(c.kind, c.axis) for c in plan.collectives() if c.node.startswith("moe_experts")}
    assert moe == {("all_to_all", "dp")}, moe
    plan.check(*batches[0], rtol=1e-4, atol=1e-5)
    serial = M.train_serial(L.RoutedListExperts(kind, bias=bias), batches, eps=1e-3)
    assert_params_close(M.train_ranks(plan, batches, eps=1e-3), serial)


def test_list_expert_tensor_parallel_whole_model():
    """presets.megatron(..., expert_axis="dp", expert_tp=True) on a Mixtral of ModuleList experts:
    forward, every gradient and 3 AdamW steps (eps 1e-3) equal serial."""
    model, kw = L.list_model("mixtral")
    ann = dict(ap.presets.megatron(model, "tp", kwargs=kw, expert_axis="dp", expert_tp=True, vocab=False))
    assert ann["model.layers.0.mlp.experts"] == ap.expert_parallel("dp", tp="tp")
    plan = ap.plan(model, DP2TP2, kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    batches = [kw] + [L.list_model("mixtral", seed=s)[1] for s in (5, 6)]
    merged = M.train_ranks(plan, batches, eps=1e-3)
    assert_params_close(merged, M.train_serial(L.list_model("mixtral")[0], batches, eps=1e-3), rtol=1e-5, atol=1e-6)
