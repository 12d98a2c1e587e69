"""The benchmarks on real gloo processes (tiny sizes): the Megatron reference is exact, and
training with the fast (in-place) collectives matches serial."""

from __future__ import annotations

import pytest


def test_tp_bench_quick_and_megatron_reference_exact(gloo):
    from bench import bench_tp, common

    common.use_pool(gloo(2))
    rows = {r["metric"]: r for r in bench_tp.run(quick=True)}
    assert rows["megatron grad error vs serial"]["value"] < 1e-4
    assert "LOSS DIFFERS" not in rows["megatron / megatron (sanity)"]["note"]
    for other in ("megatron", "dtensor"):
        assert rows[f"autopar / {other}"]["value"] > 0


def test_real_gloo_training_matches_serial_with_fast_collectives(gloo):
    res = gloo(2).run("tests.gloo.jobs:gpt_step_matches_serial", (2,), ("tp",), None)
    assert res[0]["max_rel_param"] < 1e-5 and res[0]["losses"] == pytest.approx(res[0]["serial"], rel=1e-5)


def test_uneven_bench_quick_equals_serial(gloo):
    from bench import bench_uneven, common

    common.use_pool(gloo(4))
    rows = bench_uneven.run(quick=True)
    ratios = [r for r in rows if r["metric"] == "uneven / even step time"]
    assert len(ratios) == 2 and all(r["value"] > 0 for r in ratios)
    for r in rows:
        if "bytes" in r["metric"]:
            assert r["value"] > 0 and float(r["note"].rsplit(" ", 1)[1]) < 1e-5  # first-step loss vs serial
