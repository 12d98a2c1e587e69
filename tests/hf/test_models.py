"""HuggingFace LLaMA, GPT-2 and BERT (tiny, random weights) under the Megatron plan: every
output and every parameter gradient equal to serial, on (2,), (4,) and (2, 2) = dp x tp."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar as ap
from autopar.sharding.propagate import layout_of
from tests.harness.hf_models import MODELS, hf_plan, inputs
from tests.harness.meshes import MESHES, TP

import transformers  # noqa: E402,F401  (pinned: a missing one is a failure, not a skip)


@pytest.mark.parametrize("mesh_name", TP)
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_serial(name, mesh_name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op may fall back to a gathered, replicated run
        plan, kw = hf_plan(name, mesh_name)
    report = plan.check(**kw, rtol=1e-4, atol=1e-5)
    assert report["grads"] == sum(1 for p in plan.model.parameters() if p.requires_grad)
    assert not any(layout_of(n).fallback for n in plan.graph.nodes if "autopar" in n.meta)


def test_gqa_rotary_rmsnorm_dynamic_sizes():
    """LLaMA with 4 query heads over 2 key/value heads, traced with dynamic batch and
    sequence: the rank modules then run at another sequence length too."""
    plan, kw = hf_plan("llama", "tp2", dynamic=True, kv_heads=2)
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    longer = inputs("llama", b=2, s=12, seed=3)
    plan.check(**longer, rtol=1e-4, atol=1e-5)


def test_gpt2_fused_qkv_keeps_heads_without_gathers():
    plan, _ = hf_plan("gpt2", "tp2")
    w = plan.param_specs["transformer.h.0.attn.c_attn.weight"]
    assert w == (ap.Shard(1, blocks=3),)
    fwd = [c for c in plan.collectives() if c.phase == "forward" and "attn" in c.module]
    assert [c.kind for c in fwd] == ["all_reduce"]  # only the row-parallel c_proj reduces


def test_gpt2_tied_embedding_one_shard_one_gradient():
    plan, kw = hf_plan("gpt2", "tp2")
    model = plan.model
    assert model.lm_head.weight is model.transformer.wte.weight
    assert plan.param_specs["lm_head.weight"] == plan.param_specs["transformer.wte.weight"] == (ap.Shard(0),)
    gm = plan.build_module(0)
    assert gm.lm_head.weight is gm.transformer.wte.weight  # one tensor on the rank: one gradient
    plan.check(**kw, rtol=1e-4, atol=1e-5)


def test_bert_padding_mask_and_token_types():
    """BERT with a padded attention mask and token types as inputs, split on dp."""
    ids, _ = inputs("bert")["input_ids"], None
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    kw = {"input_ids": ids, "attention_mask": mask, "token_type_ids": (torch.arange(8) >= 4).long().expand(4, 8)}
    spec = MESHES["dp2xtp2"]
    build, ann, _ = MODELS["bert"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = ap.plan(build(), spec.mesh(), kwargs=kw, annotations=ann, data_parallel=spec.dp, dynamic=False)
    plan.check(**kw, rtol=1e-4, atol=1e-5)


def test_llama_sdpa_attention():
    """transformers' default attention (scaled_dot_product_attention) splits by heads too."""
    plan, kw = hf_plan("llama", "dp2xtp2", attn="sdpa")
    assert any("scaled_dot_product" in str(n.target) for n in plan.graph.nodes)
    plan.check(**kw, rtol=1e-4, atol=1e-5)
    assert sum(c.kind == "all_reduce" and c.axis == "tp" and c.bytes >= 2048 for c in plan.collectives()) == 6
