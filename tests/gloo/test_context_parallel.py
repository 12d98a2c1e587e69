"""Context parallel on real gloo processes: the LLaMA-style model trained with its sequences split
(ring and all-gather attention; cp=4, and dp x cp) equals serial training."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("method, mesh_name", [("ring", "cp4"), ("allgather", "dp2xcp2")])
def test_context_parallel_training_matches_serial_over_gloo(gloo, method, mesh_name):
    for r in gloo(4).run("tests.gloo.jobs_context_parallel:train_matches_serial", method, mesh_name):
        assert r["max_rel"] < 1e-5, r
        for got, want in r["losses"]:
            assert abs(got - want) < 1e-5 * max(1.0, abs(want))
