"""Ulysses context parallel (``ap.ContextParallel(axis, method="ulysses")``) on tiny HF LLaMA and
Qwen2 (4 query heads, 2 K/V heads: GQA, RoPE, causal SDPA, HF's shifted labels): outputs, every
gradient and the parameters after 3 AdamW steps equal serial on (2,) and (4,) cp (cp=4 repeats
each K/V head twice, as Megatron does), load balanced or not, with the Megatron preset on tp x cp,
zero=3 folded over dp x cp, activation checkpointing; the all-to-all bytes that ran are the plan's;
heads the axis cannot split are a PlanError naming the module. Gloo: tests/gloo/test_context_parallel.py."""

from __future__ import annotations

import pytest

import autopar as ap
from autopar.parallel.context.ulysses import kv_repeat
from tests.harness.hf_models import adamw_matches_serial, batch, causal_lm, llama

import transformers  # noqa: F401  (pinned: a missing one is a failure, not a skip)

BUILD = {
    "llama": lambda: llama(layers=2, attn="sdpa"),
    "qwen2": lambda: causal_lm("qwen2", layers=2, attn="sdpa"),
}


def _kw(b=2, s=16, seed=1):
    ids, labels = batch(b=b, s=s, seed=seed)
    return {"input_ids": ids, "labels": labels}


def _loss(out):
    return out.loss


def _train_matches_serial(plan, name, b=2, steps=3):
    batches = [_kw(b=b, seed=s) for s in range(1, steps + 1)]
    adamw_matches_serial(plan, BUILD[name], batches, where=f"ulysses {plan.mesh}")


def test_kv_repeat_is_megatrons():
    assert kv_repeat(4, 2, 2) == 1 and kv_repeat(4, 2, 4) == 2 and kv_repeat(8, 1, 4) == 4
    assert kv_repeat(8, 8, 4) == 1 and kv_repeat(12, 4, 6) == 3
    with pytest.raises(ValueError, match="query heads"):
        kv_repeat(4, 2, 3)
    with pytest.raises(ValueError, match="query heads"):
        kv_repeat(4, 4, 8)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("n, balanced", [(2, False), (4, True)])
def test_hf_ulysses_matches_serial(name, n, balanced):
    cp = ap.ContextParallel("cp", method="ulysses", load_balance=balanced)
    kw = _kw()
    plan = ap.plan(BUILD[name](), ap.Mesh((n,), ("cp",)), kwargs=kw, context_parallel=cp)
    assert len(plan.built["context_parallel"]) == 2
    plan.check(**kw, loss=_loss)
    _train_matches_serial(plan, name)


def test_hf_ulysses_bytes_that_ran_are_the_plans():
    """Per attention call and rank: 4 all-to-alls forward (q, K, V, the output), 4 backward."""
    kw = _kw()
    plan = ap.plan(BUILD["llama"](), ap.Mesh((4,), ("cp",)), kwargs=kw, context_parallel=ap.ContextParallel(
        "cp", method="ulysses"))  # fmt: skip
    planned = [c for c in plan.collectives() if c.kind == "all_to_all" and "attn" in c.module]
    assert len(planned) == 2 * 8
    with ap.comm_stats() as stats:
        plan.simulate(lambda m, **local: m(**local).loss.backward(), **kw)
    ran = [r for r in stats.records if r.kind == "all_to_all" and r.numel > 2 * 16]  # not the labels' shift
    assert len(ran) == 2 * 8
    assert sum(r.bytes for r in ran) == pytest.approx(sum(c.bytes for c in planned))


def test_hf_ulysses_with_megatron_tp():
    """Heads split on tp first (2 per rank, 1 K/V head), then over cp by the all-to-all (the
    K/V head repeated twice)."""
    model, kw = BUILD["llama"](), _kw()
    ann = ap.presets.megatron(model, "tp", kwargs=kw)
    cp = ap.ContextParallel("cp", method="ulysses", load_balance=True)
    plan = ap.plan(model, ap.Mesh((2, 2), ("tp", "cp")), kwargs=kw, annotations=ann, context_parallel=cp)
    plan.check(**kw, loss=_loss, rtol=1e-4, atol=1e-5)
    _train_matches_serial(plan, "llama")


def test_hf_ulysses_with_zero3_folded_and_checkpointing():
    """Qwen2 on dp x cp, ZeRO-3 over the 4 ranks together, every layer checkpointed."""
    kw = _kw(b=4)
    cp = ap.ContextParallel("cp", method="ulysses", load_balance=True)
    dp = ap.DataParallel("dp", zero=3, shard_axes=("dp", "cp"))
    plan = ap.plan(
        BUILD["qwen2"](), ap.Mesh((2, 2), ("dp", "cp")), kwargs=kw, data_parallel=dp, context_parallel=cp,
        activation_checkpoint=ap.ActivationCheckpoint("full"),
    )  # fmt: skip
    plan.check(**kw, loss=_loss)
    _train_matches_serial(plan, "qwen2", b=4)


def test_heads_the_axis_cannot_split_are_a_plan_error():
    with pytest.raises(ap.PlanError, match=r"ulysses.*model\.layers\.0\.self_attn.*4 query heads"):
        ap.plan(BUILD["llama"](), ap.Mesh((3,), ("cp",)), kwargs=_kw(s=12),
                context_parallel=ap.ContextParallel("cp", method="ulysses"))  # fmt: skip
