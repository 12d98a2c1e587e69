"""Hybrid context parallel (``ap.ContextParallel(("cpr", "cpu"), method=("ring", "ulysses"))``):
Ulysses' all-to-all on the inner axis, then the ring (or the all-gather) over the outer one on the
rank's share of the heads. On tiny HF LLaMA and Qwen2, (2, 2): outputs, every gradient and 3 AdamW
steps equal serial, load balanced or not; with packed documents; the collectives that ran are the
plan's, on the right groups; a mesh in the wrong order is a PlanError."""

from __future__ import annotations

from collections import Counter

import pytest

import autopar as ap
from tests.harness.hf_models import adamw_matches_serial, batch, causal_lm, llama, packed_batch

import transformers  # noqa: F401  (pinned: a missing one is a failure, not a skip)

BUILD = {
    "llama": lambda: llama(layers=2, attn="sdpa"),
    "qwen2": lambda: causal_lm("qwen2", layers=2, attn="sdpa"),
}
MESH = ap.Mesh((2, 2), ("cpr", "cpu"))


def _kw(seed=1):
    ids, labels = batch(b=2, s=16, seed=seed)
    return {"input_ids": ids, "labels": labels}


def _plan(name, outer, balanced, kw):
    cp = ap.ContextParallel(("cpr", "cpu"), method=(outer, "ulysses"), load_balance=balanced)
    return ap.plan(BUILD[name](), MESH, kwargs=kw, context_parallel=cp)


@pytest.mark.parametrize("name, outer, balanced", [("llama", "ring", True), ("qwen2", "allgather", False)])
def test_hybrid_matches_serial(name, outer, balanced):
    kw = _kw()
    plan = _plan(name, outer, balanced, kw)
    assert plan.mesh.axis_names == ("cpr_cpu",) and len(plan.built["context_parallel"]) == 2
    plan.check(**kw, loss=lambda out: out.loss)
    adamw_matches_serial(plan, BUILD[name], [_kw(seed=s) for s in (1, 2, 3)], where=f"hybrid {outer}")


def test_hybrid_ring_with_packed_documents():
    kw = packed_batch()
    plan = _plan("llama", "ring", True, kw)
    plan.check(**kw, loss=lambda out: out.loss)


def test_hybrid_collectives_run_on_their_groups():
    """All-to-alls within the inner groups (0, 1), (2, 3); the ring across them (0, 2), (1, 3); the
    bytes that ran per group are the plan's per rank."""
    kw = _kw()
    plan = _plan("llama", "ring", True, kw)
    planned = [c for c in plan.collectives() if "attn" in c.module]
    by_axis = Counter(c.axis for c in planned)
    assert by_axis["cpu"] and by_axis["cpr"] and not by_axis["cpr_cpu"]
    with ap.comm_stats() as stats:
        plan.simulate(lambda m, **local: m(**local).loss.backward(), **kw)
    groups = {"cpu": [(0, 1), (2, 3)], "cpr": [(0, 2), (1, 3)]}
    for axis, kinds in (("cpu", ("all_to_all",)), ("cpr", ("ring_shift",))):
        want = sum(c.bytes for c in planned if c.axis == axis and c.kind != "all_gather")
        for group in groups[axis]:
            ran = [r for r in stats.records if r.group == group and r.kind in kinds and r.numel > 2 * 16]
            assert sum(r.bytes for r in ran) == pytest.approx(want), (axis, group)


def test_bad_hybrids_are_plan_errors():
    kw = _kw()
    with pytest.raises(ap.PlanError, match="'ulysses' on the inner one"):
        ap.ContextParallel(("cpr", "cpu"), method=("ulysses", "ring"))
    with pytest.raises(ap.PlanError, match="right after"):
        cp = ap.ContextParallel(("cpu", "cpr"), method=("ring", "ulysses"))
        ap.plan(BUILD["llama"](), MESH, kwargs=kw, context_parallel=cp)
    with pytest.raises(ap.PlanError, match="two axes take a method each"):
        ap.ContextParallel(("cpr", "cpu"), method="ring")


def test_hybrid_plan_file_round_trip(tmp_path):
    """plan.save / ap.load_plan: the merged mesh and the method pair (a JSON list) come back."""
    kw = _kw()
    plan = _plan("llama", "ring", True, kw)
    plan.save(tmp_path / "hybrid.json")
    again = ap.load_plan(tmp_path / "hybrid.json", BUILD["llama"]())
    assert again.options.context_parallel.method == ("ring", "ulysses") and again.mesh.axis_names == ("cpr_cpu",)
    again.check(**kw, loss=lambda out: out.loss)
