"""Context parallel on real gloo processes: the LLaMA-style model trained with its sequences split
(ring, all-gather and Ulysses attention; cp=4, and dp x cp; hybrid ring + Ulysses on (2, 2); zero=3 folded over dp x cp and over cp alone,
load balanced) equals serial training."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "method, mesh_name",
    [("ring", "cp4"), ("allgather", "dp2xcp2"), ("ring", "dp2xcp2_fold"), ("allgather", "cp4_fold"), ("ulysses", "cp4"),
     ("ulysses", "dp2xcp2_fold"), ("ring", "hybrid")],
)  # fmt: skip
def test_context_parallel_training_matches_serial_over_gloo(gloo, method, mesh_name):
    """The folded cases (DataParallel(zero=3, shard_axes=...)) gather and reduce-scatter over a
    process group of the dp x cp ranks, made beside the mesh axes' groups."""
    for r in gloo(4).run("tests.gloo.jobs_context_parallel:train_matches_serial", method, mesh_name):
        assert r["max_rel"] < 1e-5, r
        for got, want in r["losses"]:
            assert abs(got - want) < 1e-5 * max(1.0, abs(want))


@pytest.mark.parametrize("method, balanced", [("allgather", False), ("ring", True)])
def test_view_loss_trains_as_serial_over_gloo(gloo, method, balanced):
    """nanoGPT's ``targets.view(-1)`` on each rank's sequence piece (plain and zig-zag): the
    pieces plan.local_inputs hands out are contiguous, and training equals serial."""
    for r in gloo(4).run("tests.gloo.jobs_context_parallel:view_loss_matches_serial", method, balanced):
        assert r["max_rel"] < 1e-5, r
        for got, want in r["losses"]:
            assert abs(got - want) < 1e-5 * max(1.0, abs(want))


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_float64_model_trains_as_serial_to_1e12_over_gloo(gloo, method):
    """A float64 GPT on dp=2 x cp=2 over real processes: float64 throughout (attention's log-sum-exp,
    the loss's split-row mean), parameters and losses equal serial's to 1e-12."""
    for r in gloo(4).run("tests.gloo.jobs_context_parallel:view_loss_matches_serial", method, True, double=True):
        assert r["max_rel"] < 1e-12, r
        for got, want in r["losses"]:
            assert abs(got - want) < 1e-12 * abs(want), r


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_pipeline_with_context_parallel_matches_serial_over_gloo(gloo, method):
    """pp x cp (2, 2): pipeline stages over real processes, the sequences split on cp (load
    balanced), 2 micro-batches: the loss and every rank's gradients equal the serial step's."""
    for r in gloo(4).run("tests.gloo.jobs_context_parallel:pipeline_matches_serial", method):
        assert abs(r["loss"] - r["serial"]) < 1e-5 * max(1.0, abs(r["serial"])), r
        assert not r["errors"], r["errors"][:5]


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])  # cp=4: 22 s quiet, `make fuzz`
def test_memory_model_matches_live_bytes(gloo, cp):
    """bench/bench_context_parallel.py's memory job at its quick sizes (HF LLaMA, GQA, one sequence
    of 256 tokens, load balanced): on every rank, the cost model's held bytes (``activations``:
    allgather's gathered K/V, the ring's own pieces) and its peak (+ ``workspace``: the fp32
    accumulators and key blocks of one attention call, + the loss's ``backward``) within 15% of
    what LiveBytes measured; all-gather holds more than the ring, by the model as measured."""
    from bench import bench_context_parallel as bench

    got = {m: gloo(cp).run("bench.bench_context_parallel:memory_job", True, m) for m in bench.METHODS}
    for method, ranks in got.items():
        for rank, r in enumerate(ranks):
            assert abs(r["model_held"] / r["held"] - 1) < 0.15, (method, rank, r)
            assert abs(r["model_peak"] / r["peak"] - 1) < 0.15, (method, rank, r)
            assert r["model_workspace"] > 0, r
    gathered, ring = got["allgather"][0], got["ring"][0]
    assert gathered["held"] > ring["held"] and gathered["model_held"] > ring["model_held"]
