"""ap.clip_grad_norm_ on real gloo processes: every rank gets the serial norm and steps as serial."""

from __future__ import annotations

import pytest

CASES = [
    (2, (2,), ("tp",), 0, 2.0),
    (2, (2,), ("dp",), 2, 2.0),
    (4, (2, 2), ("dp", "tp"), 1, 2.0),
    (4, (2, 2), ("dp", "tp"), 2, "inf"),
]


@pytest.mark.parametrize("world,shape,axes,zero,norm_type", CASES)
def test_clip_over_gloo(gloo, world, shape, axes, zero, norm_type):
    results = gloo(world).run("tests.gloo.jobs_clip:clip_step_matches_serial", shape, axes, zero, norm_type)
    assert len({r[0] for r in results}) == 1  # bit-identical on every rank
    for total, serial, worst in results:
        assert total == pytest.approx(serial, rel=1e-5)
        assert worst < 1e-5
