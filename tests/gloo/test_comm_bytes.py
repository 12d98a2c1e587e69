"""Real processes send the planned bytes: what DistBackend moves equals plan.collectives()."""

from __future__ import annotations

import pytest


def test_real_gloo_ranks_send_the_planned_bytes(gloo):
    """Four real processes (ap.parallelize, DistBackend): each rank sends what plan.collectives says."""
    for planned, sent in gloo(4).run("tests.gloo.jobs_comm_bytes:gpt_bytes_planned_and_sent"):
        assert sent == pytest.approx(planned)
        assert planned[("tp", "all_reduce")] == 8 * 4096 and planned[("dp", "all_reduce")] > 0
