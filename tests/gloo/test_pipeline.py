"""Pipeline over real torch.distributed (gloo) processes: numerics against serial training."""

from __future__ import annotations

import pytest

CONFIGS = [("gpipe", 1, False), ("interleaved", 2, True)]  # 1F1B: the 4-process tests


def _check(results):
    for rank_results in results:
        for r in rank_results:
            assert r["loss"] == pytest.approx(r["serial"], rel=1e-5), r["config"]
            assert not r["errors"], (r["config"], r["errors"][:3])


def test_pp2_real_gloo(gloo):
    results = gloo(2).run("tests.gloo.jobs_pipeline:gpt_pipeline_matches_serial", (2,), ("pp",), None, CONFIGS)
    _check(results)
    assert "wte.weight" in results[0][0]["names"] and "lm_head.weight" in results[1][0]["names"]


def test_pp2_uneven_micro_batches_real_gloo(gloo):
    """6 rows in 4 micro-batches (2, 2, 1, 1): two message shapes per boundary, losses weighted by rows."""
    job = "tests.gloo.jobs_pipeline:gpt_pipeline_matches_serial"
    _check(gloo(2).run(job, (2,), ("pp",), None, [("1f1b", 1, False), ("interleaved", 2, True)], 6))


@pytest.mark.parametrize(
    "shape,axes,dp,config",
    [((2, 2), ("pp", "tp"), None, ("1f1b", 1, True)), ((2, 2), ("dp", "pp"), "dp", ("interleaved", 2, False))],
)
def test_2x2_real_gloo(gloo, shape, axes, dp, config):
    _check(gloo(4).run("tests.gloo.jobs_pipeline:gpt_pipeline_matches_serial", shape, axes, dp, [config]))


def test_pp4_sgd_real_gloo(gloo):
    results = gloo(4).run("tests.gloo.jobs_pipeline:gpt_pipeline_sgd", (4,), ("pp",), None)
    for r in results:
        assert r["losses"] == pytest.approx(r["serial"], rel=1e-5)
        assert r["max_rel_param"] < 1e-5
        assert r["max_rel_merged"] < 1e-5  # plan.merge_state_dicts of the runners: the serial state


def test_skips_masks_multi_tensor_real_gloo(gloo):
    for r in gloo(4).run("tests.gloo.jobs_pipeline:skipnet_matches_serial"):
        assert r["loss"] == pytest.approx(r["serial"], rel=1e-5)
        assert r["loss2"] == pytest.approx(r["serial2"], rel=1e-5)
        assert not r["errors"], r["errors"]


def test_steady_state_sends_no_shape_header_and_never_receives_blocking(gloo):
    """From the second step with seen shapes on: data messages only, every receive an irecv
    posted ahead (a new batch shape sends its headers once, then is known too)."""
    for r in gloo(2).run("tests.gloo.jobs_pipeline:steady_state_messages"):
        for loss, serial in r["losses"]:
            assert loss == pytest.approx(serial, rel=1e-5)
        first, again, new_shape, back = r["counts"]
        assert first["isend_header"] + first["irecv_header"] > 0 and first["recv_data"] > 0, first
        for c in (again, back):
            assert c["isend_header"] == c["irecv_header"] == c["recv_header"] == c["recv_data"] == 0, c
            assert c["isend_data"] == first["isend_data"] > 0, c  # the same data messages
            assert c["irecv_data"] == first["irecv_data"] + first["recv_data"], c  # all posted ahead
        assert new_shape["isend_header"] + new_shape["irecv_header"] > 0, new_shape


def _check_adamw(results):
    for r in results:
        assert r["losses"] == pytest.approx(r["serial"], rel=1e-5)
        assert not r["errors"], r["errors"][:3]
        assert r["max_param_diff"] < 1e-5


@pytest.mark.parametrize("zero,schedule", [(1, "zb-h1"), (2, "dualpipev"), (3, "zbv")])
def test_zero_bubble_dp2xpp2_adamw_real_gloo(gloo, zero, schedule):
    """ZB-H1 (DualPipeV, ZBV) with checkpointing beside ZeRO: 3 AdamW steps on real ranks equal serial's."""
    _check_adamw(gloo(4).run("tests.gloo.jobs_pipeline:gpt_zero_bubble_adamw", zero, 3, schedule))


@pytest.mark.parametrize(
    "schedule,ckpt",
    [
        ("zbv", True),
        pytest.param("zb-h1", False, marks=pytest.mark.slow),  # ZBV's case covers the split on 4 ranks
        pytest.param("dualpipev", False, marks=pytest.mark.slow),
    ],
)
def test_zero_bubble_pp4_adamw_real_gloo(gloo, schedule, ckpt):
    """pp=4 on 4 real ranks (a V: 8 stages, rank r holding r and 7 - r): 3 AdamW steps equal serial's."""
    _check_adamw(gloo(4).run("tests.gloo.jobs_pipeline:gpt_zero_bubble_adamw", 0, 3, schedule, (4,), ("pp",), ckpt))


@pytest.mark.slow  # 8 gloo processes on the 2-core CI machine; dp2 x pp2 above (4 ranks) covers the same path
@pytest.mark.parametrize("zero,schedule,ckpt", [(1, "zb-h1", True), (3, "zbv", False), (2, "dualpipev", True)])
def test_zero_bubble_dp2xpp2xtp2_adamw_real_gloo(gloo, zero, schedule, ckpt):
    """dp x pp x tp on 8 real ranks: Megatron's tp inside each stage, ZeRO on dp, the B/W split on
    pp; 3 AdamW steps equal serial's (the first step's gradients too, below ZeRO-2)."""
    job = "tests.gloo.jobs_pipeline:gpt_zero_bubble_adamw"
    _check_adamw(gloo(8).run(job, zero, 3, schedule, (2, 2, 2), ("dp", "pp", "tp"), ckpt))


def test_zbv_pp2_real_gloo(gloo):
    """ZBV on 2 real ranks, checkpointed, and DualPipeV (its overlapped pairs' messages in flight
    both ways at once): rank 1 hands stage 1's output to its own stage 2 in process."""
    configs = [("zbv", 2, True), ("dualpipev", 2, False)]
    _check(gloo(2).run("tests.gloo.jobs_pipeline:gpt_pipeline_matches_serial", (2,), ("pp",), None, configs))
