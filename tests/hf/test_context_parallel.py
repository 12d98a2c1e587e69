"""Context parallel on tiny HF models (LLaMA and Qwen2: GQA, RoPE, causal SDPA with the mask HF
builds, HF's shifted labels): outputs and every gradient equal serial on (2,) and (4,) cp
meshes, ring and all-gather, load balanced; with the Megatron preset on tp and with zero=3 on
dp (and folded over dp x cp, or over cp alone), on (2, 2); HF's eager attention form too."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from tests.harness.hf_models import batch, causal_lm, llama

import transformers  # noqa: F401  (pinned: a missing one is a failure, not a skip)


BUILD = {
    "llama": lambda attn="sdpa": llama(layers=2, attn=attn),
    "qwen2": lambda attn="sdpa": causal_lm("qwen2", layers=2, attn=attn),
}


def _kw(b=2, s=16):
    ids, labels = batch(b=b, s=s)
    return {"input_ids": ids, "labels": labels}


def _loss(out):
    return out.loss


def _plan(name, mesh, cp, attn="sdpa", b=2, **kw):
    model, inputs = BUILD[name](attn=attn), _kw(b)
    return ap.plan(model, mesh, kwargs=inputs, context_parallel=cp, **kw), inputs


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "n, method, balanced", [(2, "allgather", False), (4, "ring", False), (2, "ring", True), (4, "allgather", True)]
)
def test_hf_sdpa_matches_serial(name, n, method, balanced):
    cp = ap.ContextParallel("cp", method=method, load_balance=balanced)
    plan, kw = _plan(name, ap.Mesh((n,), ("cp",)), cp)
    plan.check(**kw, loss=_loss)
    assert len(plan.built["context_parallel"]) == 2  # both layers' attention on the split sequence


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_hf_llama_with_megatron_tp(method):
    model, kw = llama(layers=2, attn="sdpa"), _kw()
    ann = ap.presets.megatron(model, "tp", kwargs=kw)
    cp = ap.ContextParallel("cp", method=method)
    plan = ap.plan(model, ap.Mesh((2, 2), ("tp", "cp")), kwargs=kw, annotations=ann, context_parallel=cp)
    plan.check(**kw, loss=_loss, rtol=1e-4, atol=1e-5)


def test_hf_qwen2_with_zero3():
    """zero=3 on dp, and folded over dp x cp (DataParallel(shard_axes=...): one reduce-scatter over
    the 4 ranks, each storing a quarter)."""
    cp = ap.ContextParallel("cp", method="ring", load_balance=True)
    dp = ap.DataParallel("dp", zero=3)
    plan, kw = _plan("qwen2", ap.Mesh((2, 2), ("dp", "cp")), cp, b=4, data_parallel=dp)
    plan.check(**kw, loss=_loss)
    folded = plan.with_data_parallel(ap.DataParallel("dp", zero=3, shard_axes=("dp", "cp")))
    assert folded.memory_per_rank(0)["shard_size"] == 4 and not folded.grad_buckets()
    folded.check(**kw, loss=_loss)


def test_hf_llama_zero3_over_cp_alone():
    """A cp-only mesh with zero=3 over the cp ranks (torchtitan's dp_shard = 1: 4-way FSDP)."""
    cp = ap.ContextParallel("cp", method="allgather", load_balance=True)
    dp = ap.DataParallel(zero=3, shard_axes=("cp",))
    plan, kw = _plan("llama", ap.Mesh((4,), ("cp",)), cp, data_parallel=dp)
    assert plan.memory_per_rank(0)["shard_size"] == 4
    plan.check(**kw, loss=_loss)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_hf_eager_attention_on_the_split_sequence(name):
    """HF's eager attention (matmul, scale, + mask, softmax, dropout p=0, matmul) becomes one SDPA
    node before planning (context/eager_attention.py), placed on the split sequence."""
    cp = ap.ContextParallel("cp", method="ring", load_balance=True)
    plan, kw = _plan(name, ap.Mesh((2,), ("cp",)), cp, attn="eager")
    plan.check(**kw, loss=_loss)
    assert len(plan.built["context_parallel"]) == 2


def test_hf_eval_no_grad():
    plan, kw = _plan("llama", ap.Mesh((2,), ("cp",)), ap.ContextParallel("cp", method="ring"))
    model = BUILD["llama"]()
    with torch.no_grad():
        want = model(**kw).logits
        got = plan.simulate(lambda m, **local: m(**local).logits, **kw)
    for out in got:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_hf_kv_cache_is_refused():
    """HF's cache object fails the trace (any plan); a model that traces with use_cache=True is
    refused by ContextParallel itself (simulated/test_context_parallel.py)."""
    model = llama(layers=1, attn="sdpa")
    model.config.use_cache = True
    with pytest.raises(ap.PlanError, match="KV cache|DynamicCache"):
        ap.plan(model, ap.Mesh((2,), ("cp",)), kwargs=_kw(), context_parallel="cp")
