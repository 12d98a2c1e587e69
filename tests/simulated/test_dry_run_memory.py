"""The plan's memory figures held to what a dry run measures at every allocation: the optimizer's
state in its parameters' dtype, the peak's phase, and the three figures for one plan
(``ap.predict``, ``plan.memory_per_rank``, ``plan.cost()``) agreeing with each other."""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from tests.harness.hf_models import meta_llama
from autopar.models.examples import gpt


def _bf16_gpt(**options):
    model, (idx, tgt) = gpt(n_layer=2, n_embd=32, n_head=4, vocab_size=64, batch=8, seq=16)
    return ap.plan(model.to(torch.bfloat16), ap.Mesh((2,), ("dp",)), args=(idx, tgt), **options)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_optimizer_state_is_counted_in_the_parameters_dtype(zero):
    """AdamW makes its moments with zeros_like(param): bf16 for a bf16 model (was counted fp32, 2x)."""
    plan = _bf16_gpt(data_parallel=ap.DataParallel("dp", zero=zero))
    run = plan.dry_run(rank=0, steps=2).runs[0]
    measured = run.held_by_kind["optimizer_state"]
    assert measured == run.predicted_by_kind["optimizer_state"], (measured, run.predicted_by_kind)
    model, (idx, tgt) = gpt(n_layer=2, n_embd=32, n_head=4, vocab_size=64, batch=8, seq=16)
    fp32 = ap.plan(model, ap.Mesh((2,), ("dp",)), args=(idx, tgt), data_parallel=ap.DataParallel("dp", zero=zero))
    assert fp32.memory_per_rank(0, 2)["optimizer_state"] == 2 * measured  # fp32 moments: twice the bytes


@pytest.mark.parametrize("ac", [None, "full"])
def test_flops_count_the_recompute_up_to_the_last_kept_tensor(ac):
    """plan.cost()'s FLOPs run checkpointed blocks' forward again, stopping where torch's
    checkpoint stops (the last tensor backward keeps): FlopCounterMode's count within 2%."""
    model, (idx, tgt) = gpt(n_layer=2, n_embd=128, n_head=4, vocab_size=64, batch=4, seq=128)
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), args=(idx, tgt), data_parallel="dp", activation_checkpoint=ac)
    run = plan.dry_run(rank=0, steps=1).runs[0]
    assert abs(run.flops_ratio - 1) < 0.02, (run.flops, run.predicted_flops)


def test_causal_attention_is_counted_at_half_forward_and_backward():
    from autopar.dryrun.flops import counting_flops

    q = torch.randn(1, 2, 64, 16, requires_grad=True, device="meta")
    counts = {}
    for causal in (False, True):
        flash = torch.ops.aten._scaled_dot_product_flash_attention.default
        with counting_flops() as counter:
            out = flash(q, q, q, 0.0, causal, False)[0]
            out.sum().backward()
        counts[causal] = counter.get_total_flops()
    assert counts[True] * 2 == counts[False] == 3.5 * 4 * 64 * 64 * 16 * 2  # forward 4LSD/head, backward 2.5x


def test_the_three_memory_figures_agree_and_the_phases_are_named():
    """ap.predict, plan.memory_per_rank and plan.cost() give one figure (the parts' sum, an upper
    bound); it fails if any of the three drifts. The phases (forward, backward, optimizer) are
    each at most that sum, and the dry run reports them beside its measured peak."""
    model, (idx, tgt) = gpt(n_layer=2, n_embd=64, n_head=4, vocab_size=512, batch=8, seq=64)
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), args=(idx, tgt), data_parallel=ap.DataParallel("dp", zero=3))
    mem = plan.memory_per_rank(0)
    assert set(mem.phases) == {"forward", "backward", "optimizer"}
    assert mem.phases[mem.phase] == max(mem.phases.values()) < mem.total == sum(mem.values())
    assert ap.predict(plan, "h100")["memory"] == mem.total
    assert sum(plan.cost(rank=0).at()["memory"].values()) == pytest.approx(mem.total, rel=1e-9)
    run = plan.dry_run(rank=0, steps=2).runs[0]
    assert run.predicted_bytes == mem.total and run.predicted_phases == pytest.approx(mem.phases)
    assert run.peak_bytes <= mem.total  # the sum bounds the measured peak from above


def test_full_checkpointing_lists_the_tp_collectives_its_recompute_sends_again():
    """Under full checkpointing backward runs a block's sequence-parallel gathers again (up to the
    last tensor it keeps); plan.collectives() lists them (phase "recompute") as the dry run sends
    them. Selective checkpointing keeps collective outputs: nothing is sent again."""
    from collections import Counter

    model, kw = meta_llama(layers=2, batch=4)
    counts = {}
    for mode in ("full", "selective"):
        ann = ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=True)
        plan = ap.plan(
            model, ap.Mesh((2, 2), ("dp", "tp")), kwargs=kw, annotations=ann, activation_checkpoint=mode, dynamic=False
        )
        run = plan.dry_run(rank=0, steps=1).runs[0]
        ran = Counter((k, a) for k, a, _ in run.collectives)
        assert ran == Counter((k, a) for k, a, _ in run.predicted_collectives), mode
        counts[mode] = [c.phase for c in plan.collectives()].count("recompute")
    assert counts["selective"] == 0 < counts["full"]
