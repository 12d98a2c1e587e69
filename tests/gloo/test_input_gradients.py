"""The input-gradient contract on real gloo processes: every rank's gradient of an input that
requires grad is its piece of the serial one (whole where replicated), tp and dp alike."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("shape,axes,dp", [((2,), ("tp",), None), ((4,), ("dp",), "dp"), ((2, 2), ("dp", "tp"), "dp")])
def test_input_gradients_match_serial_on_gloo(gloo, shape, axes, dp):
    world = 1
    for n in shape:
        world *= n
    for rank, worst in enumerate(
        gloo(world).run("tests.gloo.jobs_input_grads:replicated_input_gradients", shape, axes, dp)
    ):
        for name, diff in worst:
            assert diff < 1e-5, (rank, name, diff)
