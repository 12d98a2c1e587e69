"""ZeRO-3 / HSDP on 4 real gloo processes (jobs in jobs_fsdp.py): 3 AdamW steps equal serial and
each rank holds its share of the parameters."""

from __future__ import annotations

import pytest

from tests.harness import data_parallel as H


@pytest.mark.parametrize("mesh_name,options", [("dp4", {}), ("dp2xtp2", {}), ("dp4", dict(shard_size=2))])
def test_real_gloo_runs_equal_serial(gloo, mesh_name, options):
    results = gloo(4).run("tests.gloo.jobs_fsdp:three_steps", mesh_name, options)
    assert results[0][0] < 2e-5, results[0]
    full = sum(p.numel() for p in H.make_model().parameters())
    share = {"dp4": 4, "dp2xtp2": 4}[mesh_name] // (2 if options else 1)  # tp x dp splits, HSDP half
    assert all(held <= full / share + 64 for _, held in results), results
