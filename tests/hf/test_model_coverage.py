"""Current transformer variants under the Megatron preset: Qwen3 (qk-norm), Falcon (x @ w.T
linears) shard attention and MLPs (a rank holds about 1/tp of them) and equal serial on
(2,) and (2, 2); T5's preset pairs its relative-bias self-attention and its cross-attention;
explain() lists the linears left replicated."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from tests.harness.hf_models import preset_plans
from bench.survey_models import architectures, build

import transformers  # noqa: F401  (pinned: a missing one is a failure, not a skip)


def _arch(name):
    return next(a for a in architectures() if a.name == name)


@pytest.mark.parametrize(
    "name,attn,mlp", [("Qwen3ForCausalLM", "self_attn", "mlp"), ("FalconForCausalLM", "self_attention", "mlp")]
)
def test_preset_shards_attention_and_mlp(name, attn, mlp):
    model, kw = build(_arch(name))
    preset = ap.presets.megatron(model, "tp", kwargs=kw)
    assert any(attn in p and isinstance(a, ap.rowwise) for p, a in preset.items()), preset.explain()
    assert any(mlp in p and isinstance(a, ap.rowwise) for p, a in preset.items()), preset.explain()
    for plan in preset_plans(model, kw, preset):
        plan.check(**kw, rtol=1e-3, atol=1e-4)
    total = sum(p.numel() for p in model.parameters())
    local = sum(p.numel() for p in plan.module(0).parameters())
    assert local / total < 0.56  # everything but norms (and qk-norms) split over tp = 2


def test_t5_preset_pairs_relative_bias_and_cross_attention():
    model, kw = build(_arch("T5ForConditionalGeneration"))
    preset = ap.presets.megatron(model, "tp", kwargs=kw)
    rows = {p for p, a in preset.items() if isinstance(a, ap.rowwise)}
    assert "encoder.block.0.layer.0.SelfAttention.o" in rows  # relative position bias inside
    assert "decoder.block.0.layer.1.EncDecAttention.o" in rows  # cross-attention
    assert "decoder.block.0.layer.2.DenseReluDense.wo" in rows


def test_explain_lists_linears_left_replicated():
    model, kw = build(_arch("GPT2LMHeadModel"))
    text = ap.presets.megatron(model, "tp", kwargs=kw, vocab=False).explain()
    assert "lm_head: left replicated" in text


@pytest.mark.parametrize(
    "name",
    [
        "BloomForCausalLM",  # baddbmm (ALiBi)
        "DeepseekV3ForCausalLM",  # MLA keys written into an empty tensor; MoE
        "Llama4ForCausalLM",  # complex rotary; MoE
        "MobileNetV2ForImageClassification",
    ],
)  # relu6, in-place dropout
def test_survey_rows(name):
    """A handful of `make survey`'s models: planned on (2,) and (2, 2), equal to serial, no fallback."""
    from bench.survey import run_one

    row = run_one(name)
    assert row["equal"] and not row["fallback"], row


def test_bart_with_labels_plans_without_fallback_and_equals_serial():
    """Issue 40: BART given labels shifts them right in place (``shifted[:, 0] = start``: a select
    and ``fill_.Tensor``), which had no rule and ran replicated (a warning, a gather). It keeps
    the batch split under the Megatron preset on (2, 2) and equals serial."""
    import warnings

    model, kw = build(_arch("BartForConditionalGeneration"))
    kw = {"input_ids": kw["input_ids"], "labels": kw["decoder_input_ids"]}
    preset = ap.presets.megatron(model, "tp", kwargs=kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the fallback's "no sharding rule" warning
        plan = ap.plan(
            model, ap.Mesh((2, 2), ("dp", "tp")), kwargs=kw, annotations=dict(preset), data_parallel="dp", dynamic=False
        )
    assert not [n for n in plan.graph.nodes if getattr(n.meta.get("autopar"), "fallback", False)]
    fill = next(n for n in plan.graph.nodes if n.target == torch.ops.aten.fill_.Tensor)
    assert repr(fill.meta["autopar"].spec[0]) == "S(0)"  # the batch stays split on dp
    plan.check(**kw, rtol=1e-3, atol=1e-4)


def test_prophetnet_loss_given_labels_on_data_parallel():
    """ProphetNet's loss fills ``labels.new_zeros(ngram, B, S)`` with -100 and copies labels into
    each ngram row in place: the new tensor was split on its ngram dim like labels' batch dim, the
    copies wrote into a redistributed copy, and the loss read the -100s (NaN, every gradient 0)."""
    arch = next(a for a in architectures() if a.name == "ProphetNetForCausalLM")
    model, kwargs = build(arch)
    kwargs = {**kwargs, "labels": kwargs["input_ids"]}
    model.train()
    serial = model(**kwargs).loss
    serial.backward()
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), kwargs=kwargs, data_parallel="dp")

    def step(module, *a, **k):
        loss = module(*a, **k)["loss"]
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in module.named_parameters() if p.grad is not None}

    out = plan.simulate(step, **kwargs)
    for loss, _ in out:  # loss_mean="global": every rank holds the global batch's mean
        torch.testing.assert_close(loss, serial.detach(), rtol=1e-5, atol=1e-6)
    grads = plan.merge_state_dicts([g for _, g in out])
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
