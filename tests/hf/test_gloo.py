"""LLaMA on a real (2, 2) = dp x tp gloo mesh, 4 processes: trains like serial, and the
collectives each rank runs (ap.comm_stats) are the plan's (Plan.collectives)."""

from __future__ import annotations

import transformers  # noqa: E402,F401  (pinned: a missing one is a failure, not a skip)


def test_llama_dp2_tp2_gloo(gloo):
    results = gloo(4).run("tests.hf.jobs:llama_trains_like_serial", (2, 2), ("dp", "tp"), timeout=400)
    for r in results:
        assert r["max_rel_param"] < 1e-4
        for got, want in zip(r["losses"], r["serial"]):
            assert abs(got - want) < 1e-4 * max(1.0, abs(want))
        assert r["comm_equal"], (r["ran"], r["planned"])
