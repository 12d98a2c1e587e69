"""LLaMA on a real (2, 2) = dp x tp gloo mesh, 4 processes: trains like serial, and the
collectives each rank runs (ap.comm_stats) are the plan's (Plan.collectives). HF LLaMA and Qwen2
under Ulysses context parallel likewise (packed documents, with tp, with ZeRO-3 folded)."""

from __future__ import annotations

import pytest

import transformers  # noqa: E402,F401  (pinned: a missing one is a failure, not a skip)


def test_llama_dp2_tp2_gloo(gloo):
    results = gloo(4).run("tests.hf.jobs:llama_trains_like_serial", (2, 2), ("dp", "tp"), timeout=400)
    for r in results:
        assert r["max_rel_param"] < 1e-4
        for got, want in zip(r["losses"], r["serial"]):
            assert abs(got - want) < 1e-4 * max(1.0, abs(want))
        assert r["comm_equal"], (r["ran"], r["planned"])


@pytest.mark.parametrize(
    "name, shape, axes, case",
    [("llama", (4,), ("cp",), "packed"), ("qwen2", (2, 2), ("tp", "cp"), "tp"), ("llama", (2, 2), ("dp", "cp"), "zero3")],
)  # fmt: skip
def test_hf_ulysses_trains_like_serial_over_gloo(gloo, name, shape, axes, case):
    """Ulysses context parallel (load balanced) on real processes: packed documents on cp=4 (the
    mask's rows gathered once per step, as planned), tp x cp with the Megatron preset, ZeRO-3
    folded over dp x cp; 3 AdamW steps end where serial's do, and a step's collectives are the plan's."""
    for r in gloo(4).run("tests.hf.jobs:ulysses_trains_like_serial", name, shape, axes, case, timeout=400):
        assert r["max_rel_param"] < 1e-4, r["max_rel_param"]
        assert r["comm_equal"], (r["ran"], r["planned"])
