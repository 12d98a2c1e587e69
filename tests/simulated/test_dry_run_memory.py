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
    """ap.predict, plan.memory_per_rank(rank).peak and plan.cost()'s peak_memory give one figure
    (the largest phase, the search's too); it fails if any of the three drifts. The phases
    (forward, backward, optimizer) are each at most the parts' sum, which bounds the measured peak
    from above, and the dry run reports them beside its measured peak."""
    model, (idx, tgt) = gpt(n_layer=2, n_embd=64, n_head=4, vocab_size=512, batch=8, seq=64)
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), args=(idx, tgt), data_parallel=ap.DataParallel("dp", zero=3))
    mem = plan.memory_per_rank(0)
    assert set(mem.phases) == {"forward", "backward", "optimizer"}
    assert mem.peak == mem.phases[mem.phase] == max(mem.phases.values()) < mem.total == sum(mem.values())
    assert ap.predict(plan, "h100")["memory"] == mem.peak
    assert ap.predict(plan, "h100")["memory_estimate"] == pytest.approx(mem.peak, rel=1e-9)  # the search's
    assert plan.cost(rank=0).at()["peak_memory"] == pytest.approx(mem.peak, rel=1e-9)
    assert sum(plan.cost(rank=0).at()["memory"].values()) == pytest.approx(mem.total, rel=1e-9)
    run = plan.dry_run(rank=0, steps=2).runs[0]
    assert run.predicted_bytes == mem.peak and run.predicted_phases == pytest.approx(mem.phases)
    assert run.predicted_sum == mem.total and run.peak_bytes <= mem.total  # the sum: an upper bound
    assert abs(run.memory_ratio - 1) < 0.1, (run.peak_bytes, mem.phases)  # measured / the peak


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


class _LossOnly(torch.nn.Module):
    """The program returns the loss alone (torchtitan's loop, bench/llama_shapes.LossOnly)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels).loss


def test_the_head_and_the_vocab_parallel_loss_keep_what_the_activation_model_counts():
    """Under Megatron tp + sequence parallel the head reads the final norm's output gathered over
    tp and keeps that (not the sequence piece), and the vocab-parallel cross-entropy keeps two
    tensors of the rank's logits piece (the shifted logits and their exp), where the op alone
    keeps one: the bytes autograd saves in the rank program (every saved storage once, the
    parameters left out) equal the model's ``activations`` within 5% (1.41x before both were
    counted; the 405B's last stage read 1.19x for them, docs/dry_run.md)."""
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,  # the loss's tensors and the gathered norm output dominate, as at scale
        max_position_embeddings=128,
        use_cache=False,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = _LossOnly(transformers.LlamaForCausalLM(cfg))
    ids = torch.zeros(4, 128, dtype=torch.long, device="meta")
    kw = {"input_ids": ids, "labels": ids}
    ann = ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=True)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), kwargs=kw, dynamic=False, annotations=ann)
    saved = {}

    def pack(t):  # every storage backward keeps, kept alive here so that none is counted twice
        base = t if t._base is None else t._base
        if not (base.is_leaf and base.requires_grad):  # a parameter: not an activation
            saved[id(t.untyped_storage())] = (t.untyped_storage(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plan.dry_run(rank=0, steps=1)
    measured = sum(n for _, n in saved.values())
    assert measured == pytest.approx(plan.memory_per_rank(0)["activations"], rel=0.05)


def test_counting_flops_keeps_no_tensor_alive():
    """The dry run's FlopCounterMode tracks no modules: torch's ModuleTracker hooks every module's
    inputs that need a gradient and holds them until the mode exits, which kept a pipeline stage's
    received inputs and their gradients for the whole step (the 405B's last stage: 1.75 GiB)."""
    import weakref

    from autopar.dryrun.flops import counting_flops

    layer = torch.nn.Linear(4, 4)
    with counting_flops() as counter:
        x = torch.randn(2, 4, requires_grad=True)
        layer(x).sum().backward()
        gone = weakref.ref(x)
        del x
        assert gone() is None  # freed while the counter still runs
    assert counter.get_total_flops() == 3 * 2 * 2 * 4 * 4  # forward, and backward's two products


def test_the_peak_listing_accounts_for_the_whole_peak():
    """dryrun/peak_listing.py lists what is alive at the measured peak (how the 405B's last stage
    was broken down): its groups add up to the run's peak, largest first, each named by its op."""
    from autopar.dryrun.peak_listing import listing_peak

    plan = _bf16_gpt(data_parallel=ap.DataParallel("dp", zero=3))
    with listing_peak() as found:
        run = plan.dry_run(rank=0, steps=2).runs[0]
    (counter,) = found
    rows = counter.listing()
    assert sum(nbytes for nbytes, _, _ in rows) == run.peak_bytes
    assert [r[0] for r in rows] == sorted((r[0] for r in rows), reverse=True)
    assert all(op.startswith("aten.") for _, _, (_, op, *_rest) in rows if op != "?")
