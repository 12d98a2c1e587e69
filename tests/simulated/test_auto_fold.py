"""ZeRO over folded axes (``DataParallel("dp", zero=z, shard_axes=("dp", "cp"))``, or over cp
alone) in the search's cost model: ap.predict costs such plans as one group over dp x cp (the
state sharded over their product, one reduction instead of dp's and cp's), held against the
plan's own accounting (plan.cost(), plan.memory_per_rank()) as unfolded plans are; the search
accepts a user's folded DataParallel and offers folding itself where a structure has a cp axis.
"""

from __future__ import annotations

import functools

import pytest

import autopar as ap
from tests.harness.llama_like import llama_batch, llama_like
from tests.harness.models import gpt_batch, small_gpt

GPT_BATCH = gpt_batch(batch=2, seq=16)
STATE = ("params", "grads", "optimizer_state")
# links slow enough that what crosses them decides; no pipeline or checkpointing to save memory instead
AUTO = dict(device="h100", alpha=1e-6, beta=1e9, flops_per_s=1e9, pipeline=False, activation_checkpoint=(None,))


def _dp(cp_only: bool, zero: int, fold: bool):
    if cp_only:
        return ap.DataParallel(zero=zero, shard_axes=("cp",)) if fold else None
    return ap.DataParallel("dp", zero=zero, shard_axes=("dp", "cp") if fold else None)


@functools.cache
def _gpt_plan(cp_only: bool, zero: int, fold: bool):
    mesh = ap.Mesh((2,), ("cp",)) if cp_only else ap.Mesh((2, 2), ("dp", "cp"))
    cp = ap.ContextParallel("cp", method="ring", load_balance=True)
    return ap.plan(small_gpt(), mesh, args=GPT_BATCH, data_parallel=_dp(cp_only, zero, fold), context_parallel=cp)


@pytest.mark.parametrize("cp_only", [False, True])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_predict_of_folded_plans_is_the_plans_own_accounting(cp_only, zero):
    """ap.predict's memory of a folded plan is plan.cost()'s (whose state is what
    memory_per_rank counts on every rank, the buckets' padding aside), as for the unfolded plan
    on the same mesh; the state is sharded over dp x cp (over cp alone: the cp ranks), and the
    gradient sync runs over the folded group, named as plan.collectives() names it."""
    for fold in (True, False) if not cp_only else (True,):
        plan = _gpt_plan(cp_only, zero, fold)
        pred, at = ap.predict(plan, "cpu-gloo"), plan.cost().at()
        cost = at["memory"]
        assert pred["memory"] == pytest.approx(at["peak_memory"], rel=1e-9), fold
        for rank in plan.mesh.ranks():
            mem = plan.memory_per_rank(rank)
            for key, ck in zip(STATE, ("params", "grads", "optimizer")):
                assert mem[key] == pytest.approx(cost[ck], rel=0.03), (fold, rank, key)
    folded = _gpt_plan(cp_only, zero, True)
    whole = sum(p.numel() * p.element_size() for p in folded.model.parameters())
    assert folded.cost().at()["memory"]["optimizer"] == pytest.approx(2 * whole / folded.mesh.size)
    group = "cp" if cp_only else "dp*cp"
    planned = sum(
        c.bytes for c in folded.collectives() if c.axis == group and (c.phase in ("grad sync", "optimizer") or
        c.node.startswith("fsdp bucket"))
    )  # fmt: skip
    got = ap.predict(folded, "cpu-gloo")
    assert set(got["sync_bytes"]) == {group}
    assert got["sync_bytes"][group] == pytest.approx(
        planned, rel=0.1
    )  # zero=3: an embedding's bucket not gathered again
    if not cp_only:  # unfolded: dp's sync, cp's all-reduce apart (slower here: two groups' latencies)
        unfolded = ap.predict(_gpt_plan(False, zero, False), "cpu-gloo")
        assert set(unfolded["sync_bytes"]) == {"dp"}
        assert unfolded["memory"] > got["memory"]


def _llama():
    return llama_like(kv_heads=1, layers=2), llama_batch(batch=2, seq=128)


def test_search_folds_cp_when_only_folding_fits():
    """On (2, 2) with cp on b, under a budget between the least memory of the unfolded plans
    (ZeRO 0-3 on a) and of the folded ones (ZeRO 1-3 over a x b): the search folds, meets the
    budget, explain names the fold, ap.predict of the plan is the search's figure and the plan
    equals serial."""
    model, batch = _llama()
    mesh = ap.Mesh((2, 2), ("a", "b"))
    cp = ap.ContextParallel("b", method="ring", load_balance=True)

    def memory(dp):
        return ap.predict(ap.plan(model, mesh, args=batch, data_parallel=dp, context_parallel=cp), ap.Auto(**AUTO))[
            "memory"
        ]

    unfolded = min(memory(ap.DataParallel("a", zero=z)) for z in (0, 1, 2, 3))
    folded = min(memory(ap.DataParallel("a", zero=z, shard_axes=("a", "b"))) for z in (1, 2, 3))
    assert folded < unfolded
    budget = (folded + unfolded) / 2
    auto = ap.Auto(memory_budget=budget, **AUTO)
    plan = ap.plan(model, mesh, args=batch, data_parallel="a", context_parallel=cp, auto=auto)
    rec = plan.built["auto"]
    assert "folded over a*b" in rec["chosen"] and rec["memory"] <= budget, rec["chosen"]
    assert plan.data_parallel.shard_axes == ("a", "b")
    assert all(not r["fits"] for r in rec["runners_up"] if "folded" not in r["option"])
    assert "folded over a*b" in str(plan.explain("auto"))
    pred = ap.predict(plan, ap.Auto(**AUTO))
    assert pred["time_s"] == pytest.approx(rec["time_s"], rel=1e-9) and pred["memory"] == pytest.approx(rec["memory"])
    plan.check(*batch, loss=lambda out: out[1])


def test_users_folded_data_parallel_is_searched_under():
    """A user's DataParallel(shard_axes=...) is kept: every option the search weighs folds over
    the user's axes (on (2,) over cp alone, without data parallel), and ap.predict of the plan
    is the search's figure."""
    model, batch = _llama()
    cases = [
        (ap.Mesh((2, 2), ("a", "b")), ap.DataParallel("a", zero=3, shard_axes=("a", "b")), "folded over a*b"),
        (ap.Mesh((2,), ("b",)), ap.DataParallel(zero=2, shard_axes=("b",)), "ZeRO-2 folded over b"),
    ]
    for mesh, dp, label in cases:
        plan = ap.plan(model, mesh, args=batch, data_parallel=dp, auto=ap.Auto(**AUTO))
        rec = plan.built["auto"]
        assert all(label in r["option"] and "b=cp" in r["option"] for r in rec["runners_up"]), rec["runners_up"]
        assert plan.data_parallel == dp and plan.options.context_parallel.axis == "b"
        pred = ap.predict(plan, ap.Auto(**AUTO))
        assert pred["time_s"] == pytest.approx(rec["time_s"], rel=1e-9)
        assert pred["memory"] == pytest.approx(rec["memory"])
