"""plan.dry_run: rank programs run at full size on fake tensors in a fake world, held against the
plan's own figures (memory_per_rank, collectives, cost's FLOPs), and the device they run on."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

import autopar as ap
from tests.harness.hf_models import meta_llama
from autopar.codegen import program as program_module
from autopar.dryrun.verify import verified, verify_choice
from autopar.models.examples import gpt
from autopar.parallel.dp_module import memory_ranks

MEGATRON = {"blocks.*.attn.qkv": ap.colwise("tp"), "blocks.*.attn.proj": ap.rowwise("tp")}


def _gpt_plan(**options):
    model, (idx, tgt) = gpt(n_layer=2, n_embd=32, n_head=4, vocab_size=64, batch=8, seq=16)
    return ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), args=(idx, tgt), annotations=MEGATRON, **options)


@pytest.fixture(scope="module")
def tp_plan():
    return _gpt_plan(data_parallel="dp")


def test_a_cpu_traced_plan_runs_on_cuda_with_the_plans_collectives_flops_and_memory(tp_plan):
    report = tp_plan.dry_run(rank=1, device="cuda", steps=2)
    run = report.runs[1]
    # every collective of a step, kind, axis and bytes, as the plan lists them
    assert run.collectives_match, (run.collectives, run.predicted_collectives)
    assert [c[:2] for c in run.collectives].count(("all_reduce", "tp")) == 4
    # FLOPs: FlopCounterMode counts matmuls and attention; the formulas every op (the few
    # elementwise FLOPs of norms and softmax are the difference)
    assert abs(run.flops_ratio - 1) < 0.05
    # memory: the same parts, counted at every allocation. The measured peak lies between the
    # largest phase (the headline, run.predicted_bytes) and the parts' sum: this tiny model's
    # gradients are one bucket, allocated whole as backward starts, beside the loss's backward
    # (the phase model has no gradient there; at model size a bucket is 25 MiB of many GiB)
    assert run.predicted_bytes <= run.peak_bytes <= run.predicted_sum, (run.peak_bytes, run.predicted_phases)
    assert run.memory_ratio < 1.12, run.memory_ratio
    for kind in ("params", "grads", "optimizer_state", "activations"):
        assert run.peak_by_kind.get(kind, 0) > 0, run.peak_by_kind
    # Adam's state: two fp32 tensors per parameter element, exactly
    assert run.peak_by_kind["optimizer_state"] == run.predicted_by_kind["optimizer_state"]
    assert "peak GiB" in repr(report) and "<table>" in report._repr_html_()


def test_without_binding_the_device_a_cpu_constant_meets_the_device(monkeypatch):
    """The negative control of the test above: the GPT's positions, ``torch.arange(T,
    device=idx.device)``, traced on the CPU, made on the CPU when the device is not bound."""
    monkeypatch.setattr(program_module, "bind_device", lambda graph: 0)
    monkeypatch.setattr(sys.modules["autopar.plan"], "bind_device", lambda graph: 0)
    plan = _gpt_plan(data_parallel="dp")
    with pytest.raises(
        ap.PlanError, match=r"at node \w+ \(aten\.\S+\), in module blocks\.0\.attn: .* met the program.s"
    ) as caught:
        plan.dry_run(rank=0, device="cuda", steps=1)
    assert isinstance(caught.value.__cause__, FakeTensorDeviceMismatchError)


def test_zero3_with_checkpointing_gathers_and_frees_at_full_size():
    plan = _gpt_plan(data_parallel=ap.DataParallel("dp", zero=3), activation_checkpoint="selective")
    run = plan.dry_run(rank=0, steps=2).runs[0]
    kinds = {(k, a) for k, a, _ in run.collectives}
    assert ("all_gather", "dp") in kinds and ("reduce_scatter", "dp") in kinds
    assert sum(b for *_, b in run.collectives) > 0
    assert 0.5 < run.memory_ratio < 1.5, run.memory_ratio


def test_rank_none_runs_every_distinct_rank_and_bad_input_is_named(tp_plan):
    report = tp_plan.dry_run(steps=1)
    assert set(report.runs) == set(memory_ranks(tp_plan))
    assert report.peak_bytes == max(r.peak_bytes for r in report.runs.values())
    with pytest.raises(ap.MeshError, match="ranks 0..3"):
        tp_plan.dry_run(rank=4)


def test_module_to_moves_the_traced_constants():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])  # a lifted constant

    plan = ap.plan(Scaled(), ap.Mesh((2,), ("dp",)), args=(torch.randn(4, 4),), data_parallel="dp")
    gm = plan.build_module(0)
    assert gm.autopar_constants
    gm.to(torch.float64)
    for fqn in gm.autopar_constants:
        assert getattr(gm, fqn).dtype == torch.float64
    assert gm.autopar_device == torch.device("cpu")


def test_auto_verify_dry_runs_the_choice_and_warns_over_budget():
    model, (idx, tgt) = gpt(n_layer=2, n_embd=32, n_head=4, vocab_size=64, batch=8, seq=16)
    mesh = ap.Mesh((2,), ("dp",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the budget: no warning
        plan = ap.plan(model, mesh, args=(idx, tgt), auto=ap.Auto(memory_budget=1e7, device="h100", verify=True))
    record = plan.built["auto"]
    assert 0.75 < record["dry_run_peak"] / record["memory"] < 1.25  # a tiny model: the formulas leave out small tensors
    assert "dry run: rank 0 peaked at" in plan.explain("auto")
    with pytest.warns(UserWarning, match="peaked at .* in a dry run, over the memory budget"):
        verify_choice(plan, dict(record, budget=record["dry_run_peak"] / 2))
    plan.built["auto"] = dict(record, budget=record["dry_run_peak"] / 2)  # refused, no other tried: kept
    with pytest.warns(UserWarning, match="no other option tried was within it"):
        assert verified(plan, 2, plan.plan_option, tries=0) is plan


@pytest.mark.slow  # 5-19 s here: plans and dry-runs runners-up; the refusal path is above
def test_auto_verify_refuses_a_choice_over_budget_and_takes_the_next_that_fits():
    """A choice whose dry run peaks over the budget is refused: the runners-up (fastest first)
    are planned and dry-run until one is within it; explain("auto") names the refused."""
    model, (idx, tgt) = gpt(n_layer=2, n_embd=32, n_head=4, vocab_size=64, batch=8, seq=16)
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), args=(idx, tgt), auto=ap.Auto(device="h100", verify=True))
    record = plan.built["auto"]
    budget = record["dry_run_peak"] - 1  # the choice measured 1 B over: refused
    plan.built["auto"] = dict(record, budget=budget)
    taken = verified(plan, 2, plan.plan_option)
    got = taken.built["auto"]
    assert got["chosen"] != record["chosen"] and got["dry_run_peak"] <= budget
    assert got["dry_run_refused"][0] == {"option": record["chosen"], "dry_run_peak": record["dry_run_peak"]}
    assert f"refused {record['chosen']}: its dry run peaked at" in taken.explain("auto")
    # nothing within the budget: the search's choice stays, with the warning
    plan.built["auto"] = dict(record, budget=1.0)
    with pytest.warns(UserWarning, match="no other option tried was within it"):
        kept = verified(plan, 2, plan.plan_option, tries=1)
    assert kept is plan and "dry_run_refused" not in kept.built["auto"]


def test_checkpointed_blocks_of_a_zero3_llama_are_gathered_again_in_backward():
    """A LLaMA block's region takes zero=3's gathered block as one tuple argument: checkpoint held
    it from forward to backward (no regather; 13 GiB on an 8B) until the region passed its
    tensors one by one through the saved-tensor hooks. The dry run counts the gathers."""
    model, kw = meta_llama(layers=2, batch=8)
    ids = kw["input_ids"]
    plan = ap.plan(
        model,
        ap.Mesh((4,), ("dp",)),
        kwargs={"input_ids": ids, "labels": ids},
        data_parallel=ap.DataParallel("dp", zero=3),
        activation_checkpoint="full",
        dynamic=False,
    )
    run = plan.dry_run(rank=0, steps=1).runs[0]
    assert [k for k, *_ in run.collectives].count("all_gather") == 7  # 4 buckets, then the 3 before the head again
    assert run.collectives_match, (run.collectives, run.predicted_collectives)


def _zero3_tp_sp_llama(layers: int, activation_checkpoint=None, **dp):
    """A meta LLaMA on (4, 2) dp x tp: zero=3 over dp (``dp``: its other fields), Megatron tp + sp."""
    model, kw = meta_llama(layers=layers, batch=8)
    return ap.plan(
        model,
        ap.Mesh((4, 2), ("dp", "tp")),
        kwargs=kw,
        dynamic=False,
        annotations=ap.presets.megatron(model, "tp", kwargs=kw, sequence_parallel=True),
        data_parallel=ap.DataParallel("dp", zero=3, **dp),
        activation_checkpoint=activation_checkpoint,
    )


def test_a_zero3_ranks_sync_on_tp_is_of_the_pieces_it_stores():
    """zero=3 cuts flat buckets into ranges: the norm weights (replicated on tp, all-reduced there)
    are whole on one rank and absent on another, and each rank's tp all-reduce carries what it
    stores; the plan's listing for the rank says the same (it listed an even share: 64x too few
    bytes on the 405B search choice's rank 0, 1/4 here)."""
    plan = _zero3_tp_sp_llama(layers=2)
    runs = plan.dry_run(rank=0, steps=1).runs | plan.dry_run(rank=6, steps=1).runs
    synced = {}
    for rank, run in runs.items():
        assert run.collectives_match, (rank, run.collectives, run.predicted_collectives)
        synced[rank] = sum(b for k, a, b in run.collectives if (k, a) == ("all_reduce", "tp"))
    assert synced[0] != synced[6]  # different ranges of the flat buckets


def test_a_zero3_ranks_tp_sync_buckets_its_stored_pieces_in_the_order_they_arrive():
    """The tp-synced norm weights spread over several buckets (a 700-byte bucket: three of 64
    fp32). The rank's sync buckets the pieces its module holds (whole or empty) by their sizes,
    in the order zero=3's reduce-scatters set them (a gathered block's pieces at once, in the
    block's order), after its first backward; the plan bucketed the compute pieces in backward's
    order (norm weights in the other bucket: 70B, FSDP 32 x TP 8, 917,504 bytes moved)."""
    bucket = 700 / 2**20
    plan = _zero3_tp_sp_llama(layers=4, bucket_mb=bucket, first_bucket_mb=bucket, activation_checkpoint="full")
    for rank in (0, 2, 4):  # five norm weights whole, four, none
        run = plan.dry_run(rank=rank, steps=2).runs[rank]
        assert run.collectives_match, (rank, run.collectives, run.predicted_collectives)
