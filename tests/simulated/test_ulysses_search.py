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
