"""Data parallel on real gloo processes: numerics of every option, call counts and order,
parameter broadcast at start."""

from __future__ import annotations

import pytest

from tests.harness import data_parallel as H
from tests.harness.comm import sync_calls
from tests.harness.meshes import DP

WORLD = {"dp2": 2, "dp4": 4, "dp2xtp2": 4}


@pytest.mark.parametrize("mesh_name", DP)
def test_every_option_matches_reference_on_gloo(gloo, mesh_name):
    out = gloo(WORLD[mesh_name]).run("tests.gloo.jobs_data_parallel:numerics", mesh_name, list(H.OPTIONS))[0]
    assert len(out) == len(H.OPTIONS) * len(H.OPTIMIZERS)
    for (option, opt_name), worst in out.items():
        if option == "bf16":
            assert 1e-6 < worst < (1e-2 if opt_name == "sgd" else 1e-1), (option, opt_name, worst)
        else:
            assert worst < 2e-5, (mesh_name, option, opt_name, worst)


@pytest.mark.parametrize("mesh_name,option", [("dp2", "buckets2"), ("dp2xtp2", "zero2")])
def test_collectives_per_step_and_order_on_gloo(gloo, mesh_name, option):
    results = gloo(WORLD[mesh_name]).run("tests.gloo.jobs_data_parallel:calls", mesh_name, option)
    n_buckets = results[0][1]
    per_step = n_buckets * (2 if "zero" in option else 1)
    seqs = [[(k, n) for k, _, n in calls] for calls, _ in results]
    for calls, _ in results:
        assert len(sync_calls(calls)) == per_step
    assert all(s == seqs[0] for s in seqs)


@pytest.mark.parametrize("mesh_name,zero", [("dp2", 0), ("dp2xtp2", 2)])
def test_parameters_broadcast_from_first_rank_of_each_dp_group(gloo, mesh_name, zero):
    results = gloo(WORLD[mesh_name]).run("tests.gloo.jobs_data_parallel:broadcast_from_first_rank", mesh_name, zero)
    assert all(same and changed for same, changed in results), results


def test_first_bucket_in_flight_before_first_layer_backward_on_gloo(gloo):
    for kinds in gloo(2).run("tests.gloo.jobs_data_parallel:overlap", "dp2"):
        assert kinds.index("launch") < kinds.index("first layer grad"), kinds
        assert kinds.count("launch") == 5  # 10 parameters, 2 per bucket
