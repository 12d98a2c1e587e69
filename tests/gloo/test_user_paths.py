"""Issue 32's user paths on real gloo processes: ranks that planned differently all raise a
clear error (none aborts), and failure messages say how long they really waited."""

from __future__ import annotations

import re

import pytest

from autopar.runtime.gloo_pool import JobError


@pytest.mark.parametrize("how,what", [("config", "parameter or buffer #0"), ("annotations", "the graph differs")])
def test_ranks_that_plan_differently_all_raise_without_debug(gloo, how, what):
    out = gloo(2).run("tests.gloo.jobs_user_paths:plans_differ", how, timeout=90)
    assert out[0] == out[1], out  # every rank, the same error
    assert "ranks planned differently (found before any collective)" in out[0] and what in out[0], out[0]
    if how == "config":
        assert "rank 0 has 'layers.0.fc1.weight' (32, 8) float32, rank 1 has 'layers.0.fc1.weight' (64, 8)" in out[0]
    assert gloo(2).run("tests.gloo.jobs:world_info") == [(0, 2), (1, 2)]  # no rank died


def test_collective_error_says_how_long_it_waited(gloo):
    with pytest.raises(JobError) as info:
        gloo(2).run("tests.gloo.jobs_user_paths:failure_after", 30.0, timeout=90)
    text = str(info.value)
    m = re.search(r"rank 0: all_reduce over ranks \(0, 1\) failed after ([0-9.]+) s \(timeout 30 s\)", text)
    assert m is not None, text
    assert float(m.group(1)) < 25, text  # the peer died: it failed long before the timeout
