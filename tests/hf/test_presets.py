"""presets.megatron finds the Megatron plan from the traced graph of each HF model; with
sequence parallel every model still matches serial; a missing rule names op and module."""

from __future__ import annotations

import fnmatch

import pytest

import autopar as ap
from autopar.sharding.rules import registry
from tests.harness.comm import runtime_matches_static
from tests.harness.hf_models import MODELS, hf_plan, inputs

import transformers  # noqa: E402,F401  (pinned: a missing one is a failure, not a skip)


def _expand(ann, model):
    """{module path: annotation} for every module a pattern matches."""
    paths = [n for n, _ in model.named_modules() if n]
    return {p: a for pat, a in ann.items() for p in paths if fnmatch.fnmatchcase(p, pat)}


@pytest.mark.parametrize("name", list(MODELS))
def test_preset_finds_the_megatron_plan(name):
    build, hand, _ = MODELS[name]
    model = build(layers=2)
    preset = ap.presets.megatron(model, "tp", kwargs=inputs(name))
    assert _expand(preset, model) == _expand(hand, model)
    text = preset.explain()
    assert "rowwise" in text and "word embedding" in text


def test_preset_without_example_inputs_uses_dummy_inputs():
    build, hand, _ = MODELS["bert"]
    model = build()
    assert _expand(ap.presets.megatron(model), model) == _expand(hand, model)


@pytest.mark.parametrize("name", list(MODELS))
def test_sequence_parallel_matches_serial(name):
    build, _, _ = MODELS[name]
    model, kw = build(), inputs(name)
    ann = ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=True)
    assert any(isinstance(a, ap.sequence_parallel) for a in ann.values())
    plan = ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), kwargs=kw, annotations=ann, data_parallel="dp", dynamic=False)
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    if "labels" in kw:
        runtime_matches_static(plan, kw)  # on dp x tp: grad sync over both axes included
    norm = [p for p, a in ann.items() if isinstance(a, ap.sequence_parallel)][-1]
    assert 1 in plan.grad_sync_axes[f"{norm}.weight"]  # partial over tp: summed by the gradient sync
    emb = next(p for p, a in ann.items() if isinstance(a, ap.vocab_parallel))
    assert plan.param_specs[f"{emb}.weight"] == (ap.Replicate(), ap.Shard(0))
    assert not [c for c in plan.collectives() if c.module == emb and c.kind == "all_gather" and c.phase == "forward"]


def test_missing_rule_names_op_and_module(monkeypatch):
    import torch

    silu = torch.ops.aten.silu.default  # rules are registered per overload
    monkeypatch.delitem(registry._RULES, silu)
    with pytest.raises(ap.NoRuleError, match=r"aten\.silu.*model\.layers\.0\.mlp\.act_fn"):
        hf_plan("llama", "tp2", strict=True)
    with pytest.warns(UserWarning, match=r"no sharding rule for aten\.silu"):
        plan, kw = hf_plan("llama", "tp2")
    plan.check(**kw, rtol=1e-4, atol=1e-5)  # the gathered fallback is still correct


def test_preset_on_plain_pytorch_models():
    """Not only HuggingFace: the package's GPT (fused heads-major qkv, tied head) and an MLP
    stack whose residual stream has no norm between layers."""
    import torch
    from tests.harness.models import MEGATRON, MLP, MLP_TP, gpt_batch, small_gpt

    gpt = small_gpt()
    preset = ap.presets.megatron(gpt, "tp", args=gpt_batch())
    assert _expand(preset, gpt) == {
        **_expand(MEGATRON, gpt),
        "wte": ap.vocab_parallel("tp"),
        "lm_head": ap.vocab_parallel("tp"),
    }
    mlp = MLP()
    assert _expand(ap.presets.megatron(mlp, "tp", args=(torch.randn(4, 16),)), mlp) == _expand(MLP_TP, mlp)
