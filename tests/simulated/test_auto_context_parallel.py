"""The search with context parallel in its space (ap.Auto(context_parallel=...)).

A long sequence on few rows: data parallel has no more rows to split, a replicated axis keeps
every activation. A context-parallel axis keeps ~1/cp of them (every sequence split, attention by
all-gathered K/V or a ring) and is chosen under a budget the replicated plan misses; the plan
equals serial, and ap.predict of it is the search's prediction.
"""

from __future__ import annotations

import pytest

import autopar as ap
from tests.harness.llama_like import llama_batch, llama_like
from tests.harness.models import gpt_batch, small_gpt

# links slow enough that what crosses them decides between the splits; no pipeline or
# checkpointing to save the memory instead
AUTO = dict(device="h100", alpha=1e-6, beta=1e9, flops_per_s=1e9, pipeline=False, activation_checkpoint=(None,))


def _runners(rec):
    return {r["option"]: r for r in rec["runners_up"]}


def test_context_parallel_under_a_tight_budget_equals_serial():
    """Two rows of 128 positions on (2, 2), the rows on a (dp): on b, sequence parallel tensor
    parallelism moves every block's activations, context parallel only K and V (one KV head:
    multi-query attention), so cp is the faster split; under a budget that no plan replicated on
    b meets it is chosen, and its memory is within the budget. (ZeRO 0 and 3 only: with every
    level, and each folded over a x b, the cp options fill the twelve runners-up the record keeps.)"""
    zeros, methods = (0, 3), ("allgather", "ring")  # Ulysses: tests/simulated/test_ulysses_search.py
    model = llama_like(kv_heads=1, layers=2)
    batch = llama_batch(batch=2, seq=128)
    mesh = ap.Mesh((2, 2), ("a", "b"))
    replicated = min(
        ap.predict(ap.plan(model, mesh, args=batch, data_parallel=ap.DataParallel("a", zero=z)), ap.Auto(**AUTO))[
            "memory"
        ]
        for z in zeros
    )
    free = ap.plan(
        model, mesh, args=batch, data_parallel="a", auto=ap.Auto(zero=zeros, context_parallel=methods, **AUTO)
    )
    free = free.built["auto"]
    cp = {k: r for k, r in _runners(free).items() if "b=cp" in k}
    assert {k.split(", ", 3)[-1] for k in cp} == {"cp allgather zig-zag", "cp ring zig-zag"}, sorted(cp)
    # unfolded: ZeRO folded over a x b keeps less still, and a budget under it leaves no tp option to compare
    least = min(r["memory"] for k, r in cp.items() if "folded" not in k)
    assert least < replicated  # the activations split over b
    budget = (least + replicated) / 2
    auto = ap.Auto(memory_budget=budget, zero=zeros, context_parallel=methods, **AUTO)
    plan = ap.plan(model, mesh, args=batch, data_parallel="a", auto=auto)
    rec = plan.built["auto"]
    assert "b=cp" in rec["chosen"], (rec["chosen"], sorted(_runners(rec)))
    assert rec["memory"] <= budget and plan.options.context_parallel.axis == "b"
    assert plan.options.context_parallel.load_balance  # 128 positions cut into 2 x 2 chunks
    tp = [r for k, r in _runners(rec).items() if "b=tp" in k and r["fits"]]
    assert tp and all(rec["time_s"] < r["time_s"] for r in tp)
    pred = ap.predict(plan, ap.Auto(**AUTO))
    assert pred["time_s"] == pytest.approx(rec["time_s"], rel=1e-9) and pred["memory"] == pytest.approx(rec["memory"])
    assert len(plan.built["context_parallel"]) == 2  # both attention calls meet every key
    plan.check(*batch, loss=lambda out: out[1])


def test_users_context_parallel_on_an_eager_repeated_stack():
    """A user's ap.ContextParallel fixes the axis, method and order; the search plans the rest
    (dp on the other axis of (2, 2) or not). The GPT computes attention eagerly: cp rewrites it to
    SDPA on the search's own copy of the (shortened: 4 blocks, two planned) trace, and the new
    nodes count for every block, so ap.predict of the final plan is the search's prediction."""
    model = small_gpt(layers=4)
    batch = gpt_batch(batch=2, seq=16)
    mesh = ap.Mesh((2, 2), ("a", "b"))
    ring = ap.ContextParallel("b", method="ring", load_balance=True)
    plan = ap.plan(model, mesh, args=batch, context_parallel=ring, auto=ap.Auto(**AUTO))
    rec = plan.built["auto"]
    assert "b=cp" in rec["chosen"] and plan.options.context_parallel == ring
    assert all("b=cp" in r["option"] and "cp ring zig-zag" in r["option"] for r in rec["runners_up"])
    pred = ap.predict(plan, ap.Auto(**AUTO))
    assert pred["time_s"] == pytest.approx(rec["time_s"], rel=1e-9) and pred["memory"] == pytest.approx(rec["memory"])
    assert len(plan.built["context_parallel"]) == 4
    plan.check(*batch, loss=lambda out: out[1])


def test_no_context_parallel_without_attention_or_when_asked():
    """An input split on dim 1 with no attention to meet it is not context parallel (the probe is
    refused); Auto(context_parallel=()) leaves sequences whole."""
    import torch

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    x = torch.randn(2, 8, 16)
    rec = ap.plan(mlp, ap.Mesh((2,), ("a",)), args=(x,), auto=ap.Auto(**AUTO)).built["auto"]
    assert not any("cp" in r["option"] for r in rec["runners_up"])
    model, batch = llama_like(), llama_batch(batch=1, seq=32)
    rec = ap.plan(model, ap.Mesh((2,), ("a",)), args=batch, auto=ap.Auto(context_parallel=(), **AUTO)).built["auto"]
    assert not any("cp" in r["option"] for r in rec["runners_up"])
