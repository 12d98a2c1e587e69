"""Activation checkpointing on real gloo processes: a dropout GPT trained checkpointed on dp x tp
(rng='serial') equals serial training, full and selective."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "mode,offload,zero", [("full", False, 0), ("selective", False, 0), ("selective", True, 0), ("full", False, 3)]
)
def test_checkpointed_training_matches_serial_over_gloo(gloo, mode, offload, zero):
    """zero=3: the recompute gathers the block again (tests/simulated/test_activation_checkpoint.py
    counts the gathers and the bytes held)."""
    job = "tests.gloo.jobs_activation_checkpoint:train_matches_serial"
    for r in gloo(4).run(job, mode, offload=offload, zero=zero):
        assert r["max_rel"] < 1e-5, r
        for got, want in r["losses"]:
            assert abs(got - want) < 1e-5 * max(1.0, abs(want))


def test_bench_quick_memory_per_rank_and_model(gloo):
    """bench/bench_activation_checkpoint.py at tiny sizes on 4 gloo ranks: full keeps at most 0.55
    of none's peak, selective lies between, and the model's activations are within 15% of the
    bytes alive after the forward; offloading moves the selective policy's kept outputs (and the
    blocks' inputs) to host bytes: fewer device bytes held, the host bytes as the model says."""
    from bench import bench_activation_checkpoint as bench
    from bench import common

    common.use_pool(gloo(4))
    got = {p: bench.case("gpt", True, p) for p in bench.POLICIES}
    assert got["full"]["peak"] <= 0.55 * got["none"]["peak"]
    assert got["full"]["peak"] < got["selective"]["peak"] < got["none"]["peak"]
    for policy, r in got.items():
        assert abs(r["model_held"] / r["held"] - 1) < 0.15, (policy, r)
    for policy in ("full", "selective"):
        plain, off = got[policy], got[policy + "+offload"]
        assert plain["host"] == 0 < off["host"] and off["held"] < plain["held"], (plain, off)
        assert abs(off["model_host"] / off["host"] - 1) < 0.15, (policy, off)
        # what left the device is what arrived on the host
        assert abs((plain["held"] - off["held"]) / off["host"] - 1) < 0.15, (plain, off)


@pytest.mark.parametrize(
    "schedule,checkpoint,chunks",
    [("1f1b", False, 1), ("gpipe", False, 1), ("1f1b", True, 1), ("gpipe", True, 1), ("interleaved", True, 2),
     # zero-bubble: in make test simulated (tests/simulated/test_pipeline_memory.py)
     pytest.param("zb-h1", False, 1, marks=pytest.mark.slow),
     pytest.param("dualpipev", False, 2, marks=pytest.mark.slow)],
)  # fmt: skip
def test_pipeline_memory_per_rank_counts_its_stage_and_micro_batches(gloo, schedule, checkpoint, chunks):
    """memory_per_rank(rank) of a pipelined plan: the rank's own stages' micro-batches in flight
    (1F1B: 4 - r on rank r; GPipe and ZB-H1: all 4, ZB-H1's until their W) at the micro-batch's size, and the messages it holds
    (its sends until they are known received, its prefetched receives), within 15% of the most
    bytes LiveBytes sees held between the rank's actions; plan.cost() gives the activations of the
    rank that holds the most in all (plan.peak_memory_rank(): with checkpointing, parameters can
    outweigh the in-flight micro-batches, so that it need not be the rank with the most
    activations)."""
    m = 8 if chunks > 1 else 4  # interleaved: m = 2 pp, so that its steady 1F1B part runs (DualPipeV: its least)
    got = gloo(4).run("tests.gloo.jobs_activation_checkpoint:pipeline_memory", schedule, checkpoint, m, chunks)
    for rank, r in enumerate(got):
        if chunks == 1:
            assert r["in_flight"] == (4 - rank if schedule == "1f1b" else 4), (rank, r)
        assert abs(r["model"] / r["held"] - 1) < 0.15, (rank, r)
    peak = got[0]["peak_rank"]
    assert got[0]["cost"] == pytest.approx(got[peak]["model"])
    if not checkpoint:  # without checkpointing the activations decide which rank holds the most
        assert got[peak]["model"] == max(r["model"] for r in got)
    if schedule == "1f1b" and not checkpoint:  # the first stage holds the most micro-batches
        assert got[0]["model"] > got[-1]["model"]
