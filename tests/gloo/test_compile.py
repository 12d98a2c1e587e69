"""ap.parallelize on real torch.distributed processes: gloo workers (started once per session) train
the GPT on tp, dp and dp x tp meshes and must match serial training; mesh checks and DeviceMesh."""

from __future__ import annotations

import pytest

CASES = [(2, (2,), ("tp",), None), (2, (2,), ("dp",), "dp"), (4, (2, 2), ("dp", "tp"), "dp"), (4, (4,), ("tp",), None)]


@pytest.mark.parametrize("world,shape,axes,dp", CASES)
def test_gpt_training_matches_serial_over_gloo(gloo, world, shape, axes, dp):
    results = gloo(world).run("tests.gloo.jobs:gpt_step_matches_serial", shape, axes, dp)
    for r in results:
        assert r["max_rel_param"] < 1e-5
        for got, want in zip(r["losses"], r["serial"]):
            assert abs(got - want) < 1e-5 * max(1.0, abs(want))
    assert len({tuple(r["losses"]) for r in results}) == 1  # every rank reports the global loss


def test_compile_refuses_mesh_of_other_size(gloo):
    for msg in gloo(2).run("tests.gloo.jobs:compile_with_wrong_mesh"):
        assert "world has 2 processes but the mesh" in msg and "--nproc-per-node 3" in msg


def test_device_mesh_interop(gloo):
    for same, tp_size in gloo(4).run("tests.gloo.jobs:device_mesh_round_trip", (2, 2), ("dp", "tp")):
        assert same and tp_size == 2
