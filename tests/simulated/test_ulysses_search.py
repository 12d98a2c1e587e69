"""The search with Ulysses among its context-parallel methods (opt-in:
``ap.Auto(context_parallel=("allgather", "ring", "ulysses"))``; the default space keeps the two
older methods): it costs a Ulysses plan as ap.predict does, and ranks it beside ring and all-gather."""

from __future__ import annotations

import pytest

import autopar as ap
from tests.harness.llama_like import llama_batch, llama_like

AUTO = dict(device="h100", alpha=1e-6, beta=1e9, flops_per_s=1e9, pipeline=False, activation_checkpoint=(None,))


def test_search_costs_ulysses_as_predict_does():
    model, batch = llama_like(kv_heads=2, layers=2), llama_batch(batch=2, seq=128)
    mesh = ap.Mesh((2, 2), ("a", "b"))
    auto = ap.Auto(zero=(0,), context_parallel=("allgather", "ring", "ulysses"), **AUTO)
    rec = ap.plan(model, mesh, args=batch, data_parallel="a", auto=auto).built["auto"]
    runners = {r["option"]: r for r in rec["runners_up"]}
    assert {"cp allgather zig-zag", "cp ring zig-zag", "cp ulysses zig-zag"} <= {k.split(", ")[-1] for k in runners}
    cp = ap.ContextParallel("b", method="ulysses", load_balance=True)
    plan = ap.plan(model, mesh, args=batch, data_parallel="a", context_parallel=cp)
    got = runners["a=dp, b=cp, ZeRO-0, cp ulysses zig-zag"]
    assert ap.predict(plan, ap.Auto(**AUTO))["time_s"] == pytest.approx(got["time_s"], rel=1e-9)
