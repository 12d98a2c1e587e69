"""No hangs: failed or dead ranks make the others fail fast, naming them; the pool recovers."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import autopar as ap
from autopar.runtime.gloo_pool import JobError
from autopar.runtime.simulator import SimBackend, run_ranks


def test_world_size_and_debug_consistency(gloo):
    for out in gloo(2).run("tests.dist_jobs_robust:debug_checks", timeout=90):
        assert "2 processes" in out["mesh"] and "4 ranks" in out["mesh"] and "nproc-per-node 4" in out["mesh"]
        assert "ranks disagree on the plan" in out["mismatch"], out["mismatch"]
        assert "first differing collective over ranks (0, 1): #0" in out["mismatch"], out["mismatch"]
        assert out["consistent"] == (4, 8)


def test_real_run_rank_dies(gloo):
    pool = gloo(2)
    with pytest.raises(JobError) as info:
        pool.run("tests.dist_jobs_robust:one_rank_fails", "exit", 2.0, timeout=60)
    text = str(info.value)
    assert "rank processes [1] died" in text, text
    assert "rank 0: all_reduce over ranks (0, 1) failed" in text and "one of ranks [1] died" in text, text


def test_real_run_rank_raises_before_collective(gloo):
    pool = gloo(2)
    assert pool.run("tests.dist_jobs:world_info") == [(0, 2), (1, 2)]  # recovered from the dead rank
    start = time.monotonic()
    with pytest.raises(JobError) as info:
        pool.run("tests.dist_jobs_robust:one_rank_fails", "raise", 2.0, timeout=60)
    text = str(info.value)
    assert "rank 0: all_reduce over ranks (0, 1) failed" in text, text
    assert "rank 1 failed: ValueError: boom on rank 1" in text, text
    assert time.monotonic() - start < 45


def test_simulator_fails_other_ranks_when_one_raises():
    def fn(rank):
        if rank == 1:
            raise ValueError("rank one broke")
        return torch.ops.autopar.all_reduce(torch.ones(2), "tp", [0, 1, 2], rank, "sum")
    start = time.monotonic()
    with pytest.raises(ap.SimulationError, match="rank 1 failed: ValueError: rank one broke"):
        run_ranks(3, fn, timeout=30)
    assert time.monotonic() - start < 10


def test_simulator_times_out_naming_missing_ranks():
    block = threading.Event()

    def fn(rank):
        if rank == 1:
            block.wait(1.5)  # late, but not failed: the others time out
            return None
        return torch.ops.autopar.all_reduce(torch.ones(2), "tp", [0, 1], rank, "sum")
    backend = SimBackend(2, timeout=0.5)
    with pytest.raises(ap.SimulationError, match=r"waited 0 s for ranks \[1\], which never arrived|"
                                                 r"waited 1 s for ranks \[1\]"):
        run_ranks(2, fn, backend=backend)
    block.set()


def test_consistency_compare_names_ranks_and_first_differing_collective():
    from autopar.runtime.consistency import compare
    same = [("ab", [("all_reduce", (0, 1), ("tp", "sum"))])] * 2
    compare(same)  # equal plans pass
    other = [same[0], ("cd", [("all_gather", (0, 1), (1, "tp"))])]
    with pytest.raises(ap.InconsistentPlanError, match=r"ranks \[0\] have plan ab; ranks \[1\] have plan cd"
                                                       r".*over ranks \(0, 1\): #0 is all_reduce\('tp', 'sum'\) "
                                                       r"on rank 0 but all_gather\(1, 'tp'\) on rank 1"):
        compare(other)
    shorter = [same[0], ("ab", [])]
    with pytest.raises(ap.InconsistentPlanError, match="nothing"):
        compare(shorter)
