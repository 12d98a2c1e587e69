"""Activation checkpointing on real gloo processes: a dropout GPT trained checkpointed on dp x tp
(rng='serial') equals serial training, full and selective."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_training_matches_serial_over_gloo(gloo, mode):
    for r in gloo(4).run("tests.gloo.jobs_activation_checkpoint:train_matches_serial", mode):
        assert r["max_rel"] < 1e-5, r
        for got, want in r["losses"]:
            assert abs(got - want) < 1e-5 * max(1.0, abs(want))
