"""The search with Ulysses among its context-parallel methods (in ap.Auto's default space beside
all-gather and ring): it costs each method's plan as ap.predict does (time, and memory: each
method's own saved tensors, not the probe's method's), and picks Ulysses where it is the cheapest
plan that fits, all-gather where that moves fewer bytes."""

from __future__ import annotations

import pytest

import autopar as ap
from tests.harness.llama_like import llama_batch, llama_like

AUTO = dict(device="h100", alpha=1e-6, beta=1e9, flops_per_s=1e9, pipeline=False, activation_checkpoint=(None,))
METHODS = ("allgather", "ring", "ulysses")


def _runners(rec) -> dict:
    return {r["option"]: r for r in rec["runners_up"]}


def test_search_costs_each_method_as_predict_does():
    """GQA on (2, 2) dp x cp: every method's time and memory equal ap.predict's of the plan the
    user would write (before, ring and Ulysses were priced at all-gather's memory: the probe's
    saved tensors were shared across methods)."""
    model, batch = llama_like(kv_heads=2, layers=2), llama_batch(batch=2, seq=128)
    mesh = ap.Mesh((2, 2), ("a", "b"))
    rec = ap.plan(model, mesh, args=batch, data_parallel="a", auto=ap.Auto(zero=(0,), **AUTO)).built["auto"]
    runners = _runners(rec)
    memory = {}
    for method in METHODS:
        got = runners[f"a=dp, b=cp, ZeRO-0, cp {method} zig-zag"]
        cp = ap.ContextParallel("b", method=method, load_balance=True)
        plan = ap.plan(model, mesh, args=batch, data_parallel="a", context_parallel=cp)
        want = ap.predict(plan, ap.Auto(**AUTO))
        assert want["time_s"] == pytest.approx(got["time_s"], rel=1e-9), method
        assert want["memory"] == pytest.approx(got["memory"], rel=1e-9), method
        memory[method] = got["memory"]
    assert memory["allgather"] > memory["ring"]  # the gathered K/V (cp x the piece) against one piece


def _long_sequence_search(kv_heads: int, budget: float) -> dict:
    """One axis of 4, one sequence of 256 tokens, slow links (bytes decide); a budget that the
    unsplit plans (R, tp) do not fit."""
    model, batch = llama_like(kv_heads=kv_heads, layers=2), llama_batch(batch=1, seq=256)
    auto = ap.Auto(
        device="h100", alpha=1e-9, beta=1e8, flops_per_s=1e12, pipeline=False, activation_checkpoint=(None,),
        zero=(0,), memory_budget=budget, sequence_parallel=False,
    )  # fmt: skip
    return ap.plan(model, ap.Mesh((4,), ("a",)), args=batch, auto=auto).built["auto"]


def test_search_picks_ulysses_where_it_moves_least():
    """4 heads, 4 K/V heads on cp=4: Ulysses' all-to-alls move 2 (2q + 2kv) 3/4 = 6 kv per call,
    all-gather's 4 (cp-1) kv = 12 kv, the ring's more; the search picks Ulysses."""
    rec = _long_sequence_search(kv_heads=4, budget=1.1e6)
    assert rec["chosen"] == "a=cp, cp ulysses zig-zag", rec["runners_up"]
    runners = _runners(rec)
    times = {m: runners[f"a=cp, cp {m} zig-zag"]["time_s"] for m in METHODS}
    assert times["ulysses"] < times["allgather"] < times["ring"], times


def test_search_offers_ulysses_only_where_the_heads_split():
    """3 ranks cannot split 4 heads: Ulysses is no option there (its plan is a PlanError), the
    other methods still are."""
    model, batch = llama_like(kv_heads=4, layers=1), llama_batch(batch=1, seq=96)
    auto = ap.Auto(zero=(0,), sequence_parallel=False, **AUTO)
    rec = ap.plan(model, ap.Mesh((3,), ("a",)), args=batch, auto=auto).built["auto"]
    options = set(_runners(rec)) | {rec["chosen"]}
    assert "a=cp, cp ring zig-zag" in options and not any("ulysses" in o for o in options)


def test_search_offers_hybrid_on_two_free_adjacent_axes():
    """Hybrid context parallel (the ring or all-gather across the outer axis, Ulysses within the
    inner one) is a structure where two adjacent axes are free; ap.predict costs a hybrid plan
    (its collectives on the parts of the merged axis, each on the link its ranks span); a user's
    hybrid ContextParallel under auto= is a PlanError that says what to do."""
    from autopar.search.candidates import structures

    mesh = ap.Mesh((2, 2), ("a", "b"))
    hybrid = [s for s in structures(mesh, False, None, None, True, False, METHODS) if s.cp_inner is not None]
    assert {(s.cp, s.cp_inner, s.cp_method) for s in hybrid} == {
        (0, 1, ("ring", "ulysses")),
        (0, 1, ("allgather", "ulysses")),
    }
    assert hybrid[0].roles(mesh) == "a=cp, b=cp" and not hybrid[0].can_fold()
    assert hybrid[0].context_parallel(mesh).axis == ("a", "b")
    assert not [s for s in structures(mesh, False, None, None, True, False, ("ring",)) if s.cp_inner is not None]
    model, batch = llama_like(kv_heads=4, layers=2), llama_batch(batch=1, seq=64)
    got = {}
    for outer in ("ring", "allgather"):
        cp = ap.ContextParallel(("a", "b"), method=(outer, "ulysses"), load_balance=True)
        got[outer] = ap.predict(ap.plan(model, mesh, args=batch, context_parallel=cp), ap.Auto(**AUTO))
        assert got[outer]["comm_bytes"]["b"] > 0 and got[outer]["comm_bytes"]["a"] > 0  # Ulysses within, outer across
    assert got["ring"]["comm_bytes"]["a"] > got["allgather"]["comm_bytes"]["a"]  # the ring moves the gradients too
    with pytest.raises(ap.PlanError, match="hybrid"):
        ap.plan(model, mesh, args=batch, context_parallel=cp, auto=ap.Auto(**AUTO))
