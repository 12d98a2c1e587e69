"""The training-loop contracts on real gloo processes (jobs in jobs_training_loop.py): a compiled
rank module and dropout training (both RNG modes) against serial."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "world,shape,axes,dp",
    # the 4-rank case (33 s) runs in `make fuzz`: the 2-rank one covers a compiled module over gloo in CI
    [(2, (2,), ("tp",), None), pytest.param(4, (2, 2), ("dp", "tp"), "dp", marks=pytest.mark.slow)],
)
def test_compiled_gpt_over_gloo(gloo, world, shape, axes, dp):
    for r in gloo(world).run("tests.gloo.jobs_training_loop:compiled_gpt_matches_serial", shape, axes, dp):
        assert max(r["repeated"]) - min(r["repeated"]) < 1e-6  # the issue: 4.1742 then 4.1773 twice
        for got, want in zip(r["losses"], r["serial"]):
            assert abs(got - want) < 1e-5 * max(1.0, abs(want))
        assert r["max_rel_param"] < 1e-4


@pytest.mark.parametrize("rng", ["placement", "serial"])
@pytest.mark.parametrize("world,shape,axes,dp", [(2, (2,), ("tp",), None), (4, (2, 2), ("dp", "tp"), "dp")])
def test_dropout_training_over_gloo(gloo, world, shape, axes, dp, rng):
    for r in gloo(world).run("tests.gloo.jobs_training_loop:dropout_training_matches_serial", shape, axes, dp, rng):
        assert r["replicas_equal"]
        if rng == "serial":
            assert r["max_rel_param"] < 1e-4
