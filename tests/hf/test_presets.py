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


@pytest.mark.parametrize("sp", [False, True])
def test_gqa_llama_at_8b_sizes_keeps_every_layer_head_split(sp):
    """HF LLaMA with GQA (8 K/V heads for 32 query heads) and an attention mask HF builds, at 8B
    widths on the meta device, on tp=8: every layer's q/k/v column-parallel and o_proj
    row-parallel, nothing moved inside the attention (each rank its head groups, no weight
    all-to-all'd or gathered, no attention replicated or split on the sequence).

    Before 0342b65 (ANNOTATED_MOVE) the cost model, one consumer at a time, found moving the small
    GQA k/v weights cheaper than the activation's redistribution: k_proj's weight was
    all-to-all'd and the k/v heads all-reduced on tp, while the preset had annotated them colwise.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=2048,
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(2, 2048, dtype=torch.long, device="meta")
    kw = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    ann = ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=sp)
    plan = ap.plan(model, ap.Mesh((8,), ("tp",)), kwargs=kw, annotations=ann, dynamic=False)
    for layer in range(4):
        attn = f"model.layers.{layer}.self_attn"
        for proj in "qkv":
            assert plan.param_specs[f"{attn}.{proj}_proj.weight"] == (ap.Shard(0),), (layer, proj)
        assert plan.param_specs[f"{attn}.o_proj.weight"] == (ap.Shard(1),), layer
    inside = [
        c
        for c in plan.collectives()
        if c.phase == "forward"
        and c.module
        and ".self_attn" in c.module
        and not c.module.endswith(("q_proj", "o_proj"))
    ]
    assert not inside, inside  # sp: q_proj's input all-gather and o_proj's reduce-scatter only


def test_gqa_llama_with_padding_mask_head_split_equals_serial():
    """The same at tiny sizes, run: GQA (2 K/V heads for 4), a padded attention mask HF turns into
    its causal mask, presets.megatron on tp=2: k/v split by head group and the plan equals serial."""
    import torch
    from tests.harness.hf_models import batch, llama

    model = llama(layers=2, kv_heads=2, attn="sdpa")
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: the mask is not all ones
    kw = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), kwargs=kw, annotations=ap.presets.megatron(model, "tp", kwargs=kw))
    for layer in range(2):
        for proj in "kv":
            assert plan.param_specs[f"model.layers.{layer}.self_attn.{proj}_proj.weight"] == (ap.Shard(0),)
    assert not [c for c in plan.collectives() if c.phase == "forward" and c.module and "self_attn." in c.module
                and not c.module.endswith("o_proj")]  # fmt: skip
    plan.check(**kw, rtol=1e-4, atol=1e-5)
