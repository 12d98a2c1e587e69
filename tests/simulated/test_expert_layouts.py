"""Expert parallelism's other layouts (docs/experts.md): dynamic shapes, zero=3, a (2, 2, 2)
pp x dp x tp pipeline, plain data parallelism without a gather, expert tensor parallelism, the
experts split on an axis that does not split the batch with zero=3 over dp, GraniteMoe (the
issue's case), and what explain shows; each against serial."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from tests.harness import moe as M
from tests.harness.serial import assert_params_close

DP4 = ap.Mesh((4,), ("dp",))
DP2TP2 = ap.Mesh((2, 2), ("dp", "tp"))


@pytest.mark.parametrize("zero", [0, 3])
def test_dynamic_shapes_and_zero3(zero):
    """Traced with dynamic batch and sequence (the default) and with zero=3 on dp: the experts
    stay 1/dp per rank (zero=3 shards the dense parameters only), equal to serial."""
    model, kw = M.moe_model("qwen3_moe")
    dp = ap.DataParallel("dp", zero=zero)
    plan = ap.plan(model, DP4, kwargs=kw, annotations=M.EP, data_parallel=dp, dynamic=zero == 0)
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    local = dict(plan.module(1).named_parameters())
    assert local["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == M.EXPERTS // 4


def test_pipeline_dp_tp_mesh_three_adamw_steps():
    """(2, 2, 2) pp x dp x tp: two Mixtral layers in two stages, experts dispatched on dp,
    Megatron on tp; every rank's loss equals serial for 3 AdamW steps and after them."""
    model, batch, kw = M.mixtral_lm()
    tp = ap.presets.megatron(model.m, "tp", kwargs=kw, expert_axis="dp", vocab=False)
    ann = {"m." + k: v for k, v in tp.items()} | {"m.model.layers.1": ap.split_before()}
    mesh = ap.Mesh((2, 2, 2), ("pp", "dp", "tp"))
    plan = ap.plan(model, mesh, args=batch, annotations=ann, data_parallel="dp", pipeline=ap.Pipeline("pp", 2))
    assert {c.kind for c in plan.collectives() if c.node.startswith("moe_experts")} == {"all_to_all"}
    M.assert_pipeline_steps_equal_serial(plan, model, batch)


def test_plain_data_parallel_keeps_tokens_split():
    """No annotation: the experts module (recognised by its grouped matmuls) runs every expert on
    each rank's own tokens; nothing on dp but the loss's counts and the gradient sync (the
    module's sort used to gather the tokens over dp)."""
    model, kw = M.moe_model("olmoe")
    plan = ap.plan(model, DP4, kwargs=kw, data_parallel="dp", dynamic=False)
    kinds = {(c.kind, c.phase) for c in plan.collectives()}
    assert kinds == {("all_reduce", "forward"), ("all_reduce", "grad sync")}, kinds
    plan.check(**kw, rtol=1e-4, atol=1e-5)


def test_explain_and_cost_show_dispatch_bytes():
    """tokens x top-k x hidden x 4 bytes per direction, (dp - 1)/dp of it leaving the rank."""
    model, kw = M.moe_model("mixtral")
    plan = ap.plan(model, DP4, kwargs=kw, annotations=M.EP, data_parallel="dp")
    text = plan.explain("moe_experts_default")  # the module as one node
    assert "256*B*S*(dp - 1)/dp**2" in text and "expert parallel on dp" in text, text
    rows = [c for c in plan.collectives() if c.node.startswith("moe") and c.bytes > 100]
    assert [c.bytes for c in rows] == [4 * 8 * M.TOP_K * M.HIDDEN * 4 / 4 * 3 / 4] * 4


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_expert_tensor_parallel(kind):
    """expert_parallel("dp", tp="tp") on (2, 2): experts dispatched on dp and each expert split
    over tp (gate|up column-parallel in 2 blocks, down row-parallel): 1/4 of the expert weights
    per rank, the block's output a partial sum over tp, equal to serial."""
    model, kw = M.moe_model(kind)
    ann = dict(ap.presets.megatron(model, "tp", kwargs=kw, vocab=False, experts=False))
    ann["model.layers.*.mlp.experts"] = ap.expert_parallel("dp", tp="tp")
    plan = ap.plan(model, DP2TP2, kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)
    local = dict(plan.module(3).named_parameters())
    for n, p in model.named_parameters():
        if ".mlp.experts." in n:
            assert local[n].numel() == p.numel() // 4, n
    moe = {(c.kind, c.axis) for c in plan.collectives() if c.node.startswith("moe_experts")}
    assert moe == {("all_to_all", "dp"), ("all_reduce", "tp")}, moe  # tp: "f" on the block's inputs
    plan.check(**kw, rtol=1e-4, atol=1e-5)


def test_zero3_on_the_axis_the_experts_are_replicated_on():
    """(2, 2) dp x ep: the batch on dp, the experts split on ep (tokens replicated there: each
    rank runs its experts' rows, the output summed over ep) and zero=3-sharded over dp."""
    model, kw = M.moe_model("mixtral")
    mesh = ap.Mesh((2, 2), ("dp", "ep"))
    ann = {"model.layers.*.mlp.experts": ap.expert_parallel("ep")}
    plan = ap.plan(model, mesh, kwargs=kw, annotations=ann, data_parallel=ap.DataParallel("dp", zero=3))
    full = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    held = [sum(p.numel() for n, p in plan.module(r).named_parameters() if ".experts." in n) for r in range(4)]
    # each element held once over the 4 ranks: 1/ep, then zero=3 ranges over dp (whole buckets per range)
    assert sum(held) == full and max(held) <= full // 2, held
    plan.check(**kw, rtol=1e-4, atol=1e-5)


def test_granite_moe_issue_case():
    """The issue's case: GraniteMoe on (4,) with its experts on dp gathered the hidden states
    over dp and ran the rest replicated; now only the dispatch and the loss's counts run on dp."""
    from bench.survey_models import architectures, build

    model, kw = build(next(a for a in architectures() if a.name == "GraniteMoeForCausalLM"))
    ann = {"model.layers.*.block_sparse_moe.experts": ap.expert_parallel("dp")}
    plan = ap.plan(model, DP4, kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)
    assert {c.kind for c in plan.collectives() if c.phase != "grad sync"} <= {"all_to_all", "all_reduce"}
    assert not [c for c in plan.collectives() if c.kind == "all_reduce" and c.phase == "backward"]
    plan.check(**kw, rtol=1e-4, atol=1e-5)


def test_load_balancing_loss_counts_tokens_over_dp():
    """HF's router auxiliary loss (output_router_logits): the tokens per expert counted by histc
    over the batch-split routing are partial counts summed over dp (rules/histograms.py), no
    fallback; the loss and every gradient equal serial."""
    import transformers as T

    torch.manual_seed(0)
    cfg = M._config("mixtral")
    cfg.output_router_logits, cfg.router_aux_loss_coef = True, 0.1
    model = T.MixtralForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    _, kw = M.moe_model("mixtral")
    plan = ap.plan(model, DP4, kwargs=kw, annotations=M.EP, data_parallel="dp", dynamic=False)
    assert not [n for n in plan.graph.nodes if getattr(n.meta.get("autopar"), "fallback", False)]
    plan.check(**kw, rtol=1e-4, atol=1e-5)


class Counts(torch.nn.Module):
    def forward(self, x, ids):
        return torch.histc(x, bins=8, min=-2, max=2) + torch.bincount(ids, minlength=8)[:8].float()


def test_histogram_rule_partial_counts():
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(16, generator=g), torch.randint(0, 8, (16,), generator=g)
    plan = ap.plan(Counts(), DP4, args=(x, ids), data_parallel="dp", dynamic=False, strict=True)
    out = plan.simulate(lambda m, *a: m(*a), x, ids)
    for o in out:
        torch.testing.assert_close(o, Counts()(x, ids))


def test_gpt_oss_expert_biases_dispatched():
    """gpt-oss's experts: biases gathered by each row's expert, interleaved gate|up, a clamped gate;
    the rows' experts travel with them (their local ids after the dispatch), equal to serial (the
    biases drawn at random: HF initialises them to zero)."""
    model, kw = M.moe_model("gpt_oss")
    ann = {"model.layers.*.mlp.experts": ap.expert_parallel("dp")}
    plan = ap.plan(model, DP2TP2, kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)
    assert {c.kind for c in plan.collectives() if c.node.startswith("moe")} == {"all_to_all"}
    biases = [n for n, p in model.named_parameters() if n.endswith("_bias") and ".experts." in n]
    local = dict(plan.module(0).named_parameters())
    assert biases and all(local[n].shape[0] == model.get_parameter(n).shape[0] // 2 for n in biases)
    plan.check(**kw, rtol=1e-4, atol=1e-5)


GPT_OSS_TP = {  # (experts, columns) of a rank's piece on (2, 2) dp x tp: 1/2 of the experts, 1/2 of a column split
    "gate_up_proj": (2, M.HIDDEN, M.FFN),
    "gate_up_proj_bias": (2, M.FFN),
    "down_proj": (2, M.FFN // 2, M.HIDDEN),
    "down_proj_bias": (2, M.HIDDEN),
}


def test_gpt_oss_expert_tensor_parallel_routed():
    """Expert tensor parallelism of gpt-oss's stacked experts with biases (fed a routing that never
    picks the last expert) on (2, 2) dp x tp: gate_up_proj and its bias split with the output
    columns (gate|up interleaved column by column: a rank's half holds whole pairs), down_proj on
    its rows, down_proj_bias whole on each tp rank and read as a partial sum (added once, by tp rank
    0), nothing of the experts summed over tp; forward, every gradient and 3 AdamW steps equal serial."""
    batches = [M.routing(16, seed=s) for s in range(3)]
    model = M.RoutedExperts("gpt_oss")
    ann = {"experts": ap.expert_parallel("dp", tp="tp")}
    plan = ap.plan(model, DP2TP2, args=batches[0], annotations=ann, data_parallel="dp", dynamic=False)
    for name, shape in GPT_OSS_TP.items():
        assert tuple(plan.module(3).get_parameter(f"experts.{name}").shape) == shape, name
    assert "down_proj_bias (S(0), R) used redistributed to (S(0), P) (local)" in plan.explain("moe_experts_default")
    tp_synced = {n for b in plan.grad_buckets(0) if 1 in b.axes for n in b.names}
    assert not any(n.startswith("experts.") for n in tp_synced), tp_synced
    plan.check(*batches[0], rtol=1e-4, atol=1e-5)
    serial = M.train_serial(M.RoutedExperts("gpt_oss"), batches, eps=1e-3)
    assert_params_close(M.train_ranks(plan, batches, eps=1e-3), serial)


def test_gpt_oss_expert_tensor_parallel_whole_model():
    """presets.megatron(..., expert_axis="dp", expert_tp=True) on a whole gpt-oss on (2, 2): forward,
    every gradient and 3 AdamW steps (eps 1e-3) equal serial."""
    model, kw = M.moe_model("gpt_oss")
    ann = dict(ap.presets.megatron(model, "tp", kwargs=kw, expert_axis="dp", expert_tp=True, vocab=False))
    plan = ap.plan(model, DP2TP2, kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)
    moe = {(c.kind, c.axis) for c in plan.collectives() if c.node.startswith("moe_experts")}
    assert ("all_to_all", "dp") in moe, moe
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    batches = [kw] + [M.moe_model("gpt_oss", seed=s)[1] for s in (5, 6)]
    merged = M.train_ranks(plan, batches, eps=1e-3)
    assert_params_close(merged, M.train_serial(M.moe_model("gpt_oss")[0], batches, eps=1e-3))


def test_gpt_oss_expert_tp_refuses_parting_gate_from_up():
    """gate|up interleaved over 2 x 6 columns: on 4 tp ranks a rank's 3 columns would part a gate
    from its up; refused, naming the module and the sizes that work."""
    import transformers as T

    cfg = M._config("gpt_oss")
    cfg.intermediate_size = 6
    model = T.GptOssForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    _, kw = M.moe_model("mixtral")
    ann = {"model.layers.*.mlp.experts": ap.expert_parallel("dp", tp="tp")}
    mesh = ap.Mesh((2, 4), ("dp", "tp"))
    with pytest.raises(ap.PlanError, match=r"model.layers.0.mlp.experts.*part a gate from its up.*divides 6"):
        ap.plan(model, mesh, kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)


@pytest.mark.parametrize("zero", [0, 3])
def test_bf16_policy_on_dispatched_experts(zero):
    """A bf16 precision policy (fp32 masters, bf16 compute) on experts dispatched over dp: refused
    at planning before (the expert chain, copied from the fp32 trace, kept its fp32 casts); the
    plan is now traced in bf16, so the chain computes in bf16. Two SGD steps within bf16 noise of
    the serial model computing from bf16 copies of its fp32 masters (tests/harness/precision.py;
    losses equal to 1e-4), logits in bf16, masters in fp32."""
    import copy

    from tests.harness.precision import BF16_REL, policy_train, rel_diff, serial_policy

    model, kw = M.moe_model("mixtral")
    ref, ref_losses = serial_policy(copy.deepcopy(model), kw, torch.bfloat16)
    dp = ap.DataParallel("dp", zero=zero, param_dtype=torch.bfloat16)
    plan = ap.plan(copy.deepcopy(model), DP4, kwargs=kw, annotations=M.EP, data_parallel=dp, dynamic=False)
    assert {c.kind for c in plan.collectives() if c.node.startswith("moe")} == {"all_to_all"}
    assert plan.simulate(lambda m, **k: m(**k).logits.dtype, **kw) == [torch.bfloat16] * 4
    got, losses = policy_train(plan, kw, zero)
    assert all(v.dtype == torch.float32 for v in got.values())
    assert rel_diff(got, ref, dict(model.named_parameters())) < BF16_REL
    assert losses == pytest.approx(ref_losses, rel=1e-3)


def test_clip_grad_norm_counts_expert_pieces_once():
    """ap.clip_grad_norm_ with the experts 1/dp and each split over tp: the serial norm on every rank."""
    model, kw = M.moe_model("mixtral")
    preset = ap.presets.megatron(model, "tp", kwargs=kw, expert_axis="dp", vocab=False, expert_tp=True)
    plan = ap.plan(model, DP2TP2, kwargs=kw, annotations=dict(preset), data_parallel="dp", dynamic=False)

    def step(m, **k):
        m(**k)["loss"].backward()
        return float(ap.clip_grad_norm_(m, 1e9))

    norms = plan.simulate(step, **kw)
    model(**kw).loss.backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    assert norms == pytest.approx([want] * 4, rel=1e-5)


def test_gpt_oss_sinks_stay_batch_split_on_dp():
    """Issue 40: gpt-oss's attention sinks (a replicated parameter, expanded to the global batch and
    read batch-split by the softmax's cat) were expanded whole, so the backward all-gathered their
    gradient over dp (B x H x S floats a layer). The expand now gives the batch split itself: the
    gradient reaches the sinks as a partial sum, reduced once in the gradient sync."""
    model, kw = M.moe_model("gpt_oss")
    ann = {"model.layers.*.mlp.experts": ap.expert_parallel("dp")}
    plan = ap.plan(model, ap.Mesh((4,), ("dp",)), kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)
    attn = [c for c in plan.collectives() if "self_attn" in c.module and c.phase != "grad sync"]
    assert sum(c.bytes for c in attn) == 0, attn  # was 384 B a layer here: the sinks' gradient gathered
    synced = {n for b in plan.grad_buckets(0) if 0 in b.axes for n in b.names}
    assert {n for n in synced if n.endswith("sinks")} == {n for n, _ in model.named_parameters() if n.endswith("sinks")}
    plan.check(**kw, rtol=1e-4, atol=1e-5)
