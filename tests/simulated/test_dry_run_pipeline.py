"""plan.dry_run of pipelined plans: each pipeline position's runner driven through its schedule on
fake tensors, its point-to-point messages carried by the fake world, held against the plan's
figures for that rank (its stages' collectives per micro-batch, its buckets, its messages, its
stages' FLOPs, memory_per_rank)."""

from __future__ import annotations

from collections import Counter

import pytest

import autopar as ap
from tests.harness.hf_models import meta_llama
from autopar.cost.formulas import PlanSymbols
from autopar.cost.plan_cost import flops_formula
from autopar.dryrun.verify import verify_choice
from autopar.parallel.data_parallel.fsdp import buckets_cached
from autopar.parallel.param_names import held_params
from autopar.models.examples import gpt

MEGATRON = {"blocks.*.attn.qkv": ap.colwise("tp"), "blocks.*.attn.proj": ap.rowwise("tp")}


@pytest.fixture(scope="module")
def report():
    model, (idx, tgt) = gpt(n_layer=2, n_embd=32, n_head=4, vocab_size=64, batch=8, seq=16)
    plan = ap.plan(
        model,
        ap.Mesh((2, 2, 2), ("dp", "pp", "tp")),
        args=(idx, tgt),
        annotations=MEGATRON,
        data_parallel="dp",
        pipeline=ap.Pipeline("pp", microbatches=2, schedule="1f1b"),
    )
    return plan, plan.dry_run(steps=2)  # the second step holds the optimizer state from its start


def test_every_pipeline_position_runs_with_the_plans_collectives_messages_and_flops(report):
    plan, rep = report
    assert sorted(rep.runs) == [0, 2]  # one rank per pipeline position
    for run in rep.runs.values():
        assert run.collectives_match, (run.collectives, run.predicted_collectives)
        kinds = Counter((k, a) for k, a, _ in run.collectives)
        assert kinds[("all_reduce", "tp")] == 4  # its stage's block x 2 all-reduces x 2 micro-batches
        assert kinds[("all_reduce", "dp*pp")] == 1  # the step's loss
        assert kinds[("all_reduce", "pp")] == 1  # the tied embedding / head summed over the stages
        assert abs(run.flops_ratio - 1) < 0.05, run.flops_ratio  # its stages' ops only
        assert 0.8 < run.memory_ratio < 1.3, run.memory_ratio  # a tiny model: small tensors dominate
    # plan.cost(rank)'s FLOPs are its stages': the positions' add up to the whole model's
    sy = PlanSymbols.of(plan)
    whole = sy.value(flops_formula(plan, sy))
    assert sum(r.predicted_flops for r in rep.runs.values()) == pytest.approx(whole, rel=1e-9)


def test_a_stages_receives_are_what_its_neighbour_sends(report):
    """The receives are sized from the plan's layouts (nobody sends in a fake world of one rank);
    the sends are what the rank's program made: each position's receives equal the other's sends."""
    _, rep = report
    first, last = rep.runs[0], rep.runs[2]

    def of(run, kind):
        return sorted(b for k, _, b in run.collectives if k == kind)

    assert of(first, "send") == of(last, "recv") and of(first, "recv") == of(last, "send")
    assert max(of(first, "send")) == 2 * 16 * 32 * 4  # 8 rows / dp 2 / 2 micro-batches x 16 x 32 fp32


def test_auto_verify_dry_runs_a_pipelined_choice(report):
    plan, rep = report
    rank = plan.peak_memory_rank(2)
    record = verify_choice(plan, {"chosen": "pp", "budget": None, "memory": 0.0})
    assert record["dry_run_rank"] == rank and record["dry_run_peak"] == rep.runs[rank].peak_bytes


@pytest.mark.slow  # 8-26 s on this shared machine; make test covers zero=3 without resharding in stages in
# test_fsdp.py::test_pipeline_stages_fully_sharded_equal_serial and the pipeline dry run above
def test_the_405b_configuration_at_small_size_runs_with_its_collectives():
    """docs/auto.md's 405B plan, LLaMA-shaped at 4 layers: zero=3 over dp without resharding
    after forward (one gathered copy for the step's micro-batches: each bucket gathered once),
    Megatron tp + sequence parallel, 1F1B, full checkpointing (its recomputed tp collectives, per
    micro-batch). The full size is bench/bench_dry_run.py's row."""
    model, kw = meta_llama(layers=4, batch=8)
    plan = ap.plan(
        model,
        ap.Mesh((2, 2, 2), ("dp", "pp", "tp")),
        kwargs=kw,
        annotations=ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=True),
        dynamic=False,
        data_parallel=ap.DataParallel("dp", zero=3, reshard_after_forward=False),
        pipeline=ap.Pipeline("pp", microbatches=2, schedule="1f1b"),
        activation_checkpoint="full",
    )
    rep = plan.dry_run(steps=2)
    for rank, run in rep.runs.items():
        assert run.collectives_match, rank
        gathers = [b for k, a, b in run.collectives if (k, a) == ("all_gather", "dp")]
        held = held_params(plan, rank)
        own = [b for b in buckets_cached(plan) if any(n in held for n in b.names)]
        assert len(gathers) == len(own) == 3, (rank, gathers)  # embedding (or head) + 2 blocks, once a step
        assert abs(run.flops_ratio - 1) < 0.05, run.flops_ratio


def test_zero_bubble_with_checkpointing_recomputes_in_b_and_again_in_w():
    """A zero-bubble stage runs each micro-batch's backward in two calls (B, then W), and torch's
    checkpoint recomputes a region in each: the region's recompute context is made afresh each
    time (activation_checkpoint/recompute._Fresh; a generator's context entered once, and the second recompute
    failed in the dry run). The pair holds more than the memory model counts (each region's
    recompute kept by the graph from B to its W) and runs more FLOPs than it counts (the
    recompute twice), so the search leaves it out (pairs_with)."""
    model, (idx, tgt) = gpt(n_layer=4, n_embd=32, n_head=4, vocab_size=64, batch=8, seq=16)
    plan = ap.plan(
        model,
        ap.Mesh((2,), ("pp",)),
        args=(idx, tgt),
        pipeline=ap.Pipeline("pp", microbatches=4, schedule="zb-h1"),
        activation_checkpoint="full",
    )
    runs = plan.dry_run(steps=1).runs
    assert all(run.collectives_match for run in runs.values())
    assert runs[1].flops_ratio > 1.5, runs[1].flops_ratio  # the second stage's regions: recomputed in B and in W
    full, zb = plan.options.activation_checkpoint, plan.options.pipeline
    assert zb.splits_backward() and not full.pairs_with(zb)
    assert full.pairs_with(ap.Pipeline("pp", microbatches=4, schedule="1f1b"))
    assert ap.ActivationCheckpoint("selective").pairs_with(zb) is False


def test_a_pipeline_ranks_tp_sync_has_no_small_first_bucket_as_its_runner_makes_none():
    """A pipeline's runner makes its gradient sync with the bucket size alone (no small first
    bucket): the plan's buckets of a pipeline rank leave first_bucket_mb out too. Here the
    tp-synced norm weights of zero=3 (whole on rank 2) in one 700-byte bucket, not a 100-byte
    first one and the rest."""
    model, kw = meta_llama(layers=4, batch=8)
    plan = ap.plan(
        model,
        ap.Mesh((2, 2, 2), ("dp", "pp", "tp")),
        kwargs=kw,
        dynamic=False,
        annotations=ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=True),
        data_parallel=ap.DataParallel("dp", zero=3, bucket_mb=700 / 2**20, first_bucket_mb=100 / 2**20),
        pipeline=ap.Pipeline("pp", microbatches=2, schedule="1f1b"),
    )
    run = plan.dry_run(rank=2, steps=2).runs[2]
    assert run.collectives_match, (run.collectives, run.predicted_collectives)
