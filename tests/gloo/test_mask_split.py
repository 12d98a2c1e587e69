"""A mask every consumer reads split is built split (propagate.hoist_slices), on real gloo
processes: HF LLaMA's causal mask on data parallel, loss and gradients equal the serial model's."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("mesh_name,world", [("dp2", 2)])  # dp x tp: on the simulator (unit/test_hoist_slices)
def test_llama_causal_mask_split_on_gloo(gloo, mesh_name, world):
    for loss, serial, worst, (masks, split) in gloo(world).run(
        "tests.gloo.jobs_mask_split:llama_sdpa_matches_serial", mesh_name
    ):
        assert abs(loss - serial) < 1e-5 * max(1.0, abs(serial)), (loss, serial)
        assert worst < 1e-5, worst
        assert masks >= 4 and split == masks, (masks, split)
