"""The search under the bf16 precision policy (issue 41): ``ap.plan(auto=...)`` with the policy given
as ``mixed_precision=ap.MixedPrecision(bf16)`` or as a DataParallel's ``param_dtype``.

Before, the probes were planned without the policy on its bf16 trace: each checkpointed variant
traced the model again in fp32 (its options named no compute dtype), the probes priced the fp32
program, and the saves shared between variants named the other trace's nodes (KeyError 'mul_9'
on bench_published's 8B, 'mul_10' on this tiny LLaMA, both planned with dynamic=False).
"""

from __future__ import annotations

import pytest
import torch

import autopar as ap
from tests.harness.hf_models import causal_lm

BF16 = torch.bfloat16
AUTO = ap.Auto(device="cpu-gloo", activation_checkpoint=(None, "selective", "full"))
POLICIES = {
    "MixedPrecision": dict(mixed_precision=ap.MixedPrecision(BF16)),
    "DataParallel(param_dtype=)": dict(data_parallel=ap.DataParallel("dp", param_dtype=BF16)),
}


@pytest.mark.parametrize("how", list(POLICIES))
def test_search_plans_under_the_policy(how):
    """The search plans in bf16 with checkpointing among its choices; its record, ap.predict and
    memory_per_rank say one figure, the bf16 copies of the fp32 masters counted where the chosen
    storage makes them; the plan runs in bf16."""
    model = causal_lm("llama", layers=2)
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    kw = {"input_ids": ids, "labels": ids}
    plan = ap.plan(model, ap.Mesh((2,), ("dp",)), kwargs=kw, auto=AUTO, dynamic=False, **POLICIES[how])
    assert plan.traced.dtype == BF16 and plan.options.data_parallel.param_dtype == BF16
    rec, peak = plan.built["auto"], plan.peak_memory_rank()
    mem = plan.memory_per_rank(peak)
    assert rec["memory"] == mem.peak == ap.predict(plan, AUTO)["memory"]
    assert rec["memory_estimate"] == pytest.approx(mem.peak, rel=0.05)
    if not plan.data_parallel.storage.gathers_params:
        assert mem["compute_copies"] * 2 == mem["params"]
    assert plan.simulate(lambda m, **k: m(**k).logits.dtype, **kw) == [BF16, BF16]


def test_search_prices_zero3_gathers_in_the_policy_dtype():
    """With ap.MixedPrecision alone the search's data parallel carries the policy's dtypes: its
    zero=3 option's figure is the zero=3 plan's (bf16 gathered blocks), not fp32's (429,057 B
    against 354,817 here before)."""
    model = causal_lm("llama", layers=2)
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    kw = {"input_ids": ids, "labels": ids}
    mesh, mp = ap.Mesh((4,), ("dp",)), ap.MixedPrecision(BF16)
    auto = ap.Auto(device="cpu-gloo", activation_checkpoint=(None,))
    record = ap.plan(model, mesh, kwargs=kw, auto=auto, mixed_precision=mp).built["auto"]
    zero3 = next(r for r in [record, *record["runners_up"]] if r.get("option", record["chosen"]) == "dp=dp, ZeRO-3")
    plan = ap.plan(model, mesh, kwargs=kw, data_parallel=ap.DataParallel("dp", zero=3), mixed_precision=mp)
    assert zero3["memory"] == pytest.approx(plan.memory_per_rank().peak, rel=1e-6)
