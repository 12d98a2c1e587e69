"""The simulator without models: collectives between threads, failures and timeouts that name
the ranks, and the debug consistency check comparing plans."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import autopar as ap
from autopar.runtime.backend import use_backend
from autopar.runtime.simulator import SimBackend, SimulationError, run_ranks

ops = torch.ops.autopar


def test_simulator_rank_failure_does_not_hang():
    def step(rank):
        if rank == 1:
            raise ValueError("boom on purpose")
        return ops.all_reduce(torch.ones(2), "a", [0, 1, 2], rank, "sum")

    with pytest.raises(SimulationError, match="rank 1 failed: ValueError: boom on purpose"):
        run_ranks(3, step, timeout=20)


def test_simulator_timeout_names_missing_ranks():
    def step(rank):
        if rank == 0:
            return ops.all_reduce(torch.ones(2), "a", [0, 1], rank, "sum")
        return None  # rank 1 never joins

    with pytest.raises(SimulationError, match=r"waited 1 s for ranks \[1\]"):
        run_ranks(2, step, timeout=1)


def test_collective_without_backend_explains():
    with pytest.raises(RuntimeError, match="No autopar collective backend"):
        ops.all_reduce(torch.ones(2), "a", [0, 1], 0, "sum")


def test_sim_backend_all_to_all_matches_definition():
    backend = SimBackend(2)
    full = torch.arange(16.0).view(4, 4)
    with use_backend(backend):
        outs = run_ranks(2, lambda r: ops.all_to_all(full.chunk(2, 0)[r], 0, 1, "a", [0, 1], r), backend=backend)
    torch.testing.assert_close(outs[0], full[:, :2])
    torch.testing.assert_close(outs[1], full[:, 2:])


def test_sim_backend_all_to_all_v_variable_rows_and_gradient():
    """autopar::all_to_all_v: rank r sends send[r][j] rows to rank j (zero included: rank 2
    gets nothing from rank 0, and rank 0 nothing at all from rank 1); the backward sends each
    row's gradient back where the row came from."""
    send = [[2, 0, 1], [0, 3, 0], [1, 1, 2]]
    recv = [[send[i][r] for i in range(3)] for r in range(3)]
    rows = [torch.arange(float(sum(c))).unsqueeze(1) + 10 * r for r, c in enumerate(send)]
    backend = SimBackend(3)

    def step(r):
        x = rows[r].clone().requires_grad_(True)
        y = ops.all_to_all_v(x, torch.tensor(send[r]), torch.tensor(recv[r]), "a", [0, 1, 2], r)
        (y * (r + 1)).sum().backward()
        return y.detach(), x.grad

    with use_backend(backend):
        outs = run_ranks(3, step, backend=backend)
    for r, (y, _) in enumerate(outs):
        want = [rows[i][sum(send[i][:r]) : sum(send[i][: r + 1])] for i in range(3)]
        torch.testing.assert_close(y, torch.cat(want))
    for i, (_, grad) in enumerate(outs):  # each row's gradient: the factor of the rank it went to
        dest = torch.repeat_interleave(torch.arange(3), torch.tensor(send[i])) + 1.0
        torch.testing.assert_close(grad, dest.unsqueeze(1))


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
    with pytest.raises(
        ap.SimulationError,
        match=r"waited 0 s for ranks \[1\], which never arrived|"
        r"waited 1 s for ranks \[1\]",
    ):
        run_ranks(2, fn, backend=backend)
    block.set()


def test_consistency_compare_names_ranks_and_first_differing_collective():
    from autopar.runtime.consistency import compare

    same = [("ab", [("all_reduce", (0, 1), ("tp", "sum"))])] * 2
    compare(same)  # equal plans pass
    other = [same[0], ("cd", [("all_gather", (0, 1), (1, "tp"))])]
    with pytest.raises(
        ap.InconsistentPlanError,
        match=r"ranks \[0\] have plan ab; ranks \[1\] have plan cd"
        r".*over ranks \(0, 1\): #0 is all_reduce\('tp', 'sum'\) "
        r"on rank 0 but all_gather\(1, 'tp'\) on rank 1",
    ):
        compare(other)
    shorter = [same[0], ("ab", [])]
    with pytest.raises(ap.InconsistentPlanError, match="nothing"):
        compare(shorter)


def test_shard_of_a_permuted_tensor_is_laid_out_as_its_fake_kernel_says():
    """The real shard kernel returned a permuted input's layout (clone preserves it) while its fake
    kernel says contiguous: inductor's stride asserts failed in a compiled tp module's backward."""
    x = torch.randn(8, 32, 4, 8).transpose(1, 2)  # (batch, heads, seq, dim) from (batch, seq, heads, dim)
    real = ops.shard(x, 1, "tp", [0, 1], 1)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = ops.shard(mode.from_tensor(x), 1, "tp", [0, 1], 1)
    assert real.stride() == fake.stride() and real.is_contiguous()
    torch.testing.assert_close(real, x[:, 2:])


def test_a_slow_partner_does_not_put_the_transport_copy_in_live_bytes():
    """The simulator's copy of a rank's contribution is transport, not the rank's memory: held by a
    partner that has not finished its sum (a loaded machine), it must not show in the rank's
    LiveBytes (CI once read a tp all-reduce's 8 KiB there, under load only)."""
    from autopar.runtime.live_bytes import LiveBytes

    measured, partner_may_finish = threading.Event(), threading.Event()

    class SlowPartner(SimBackend):
        def _sum(self, pieces):
            if threading.current_thread().name == "autopar-rank1":
                partner_may_finish.wait(20)  # rank 1 holds both pieces while rank 0 measures
            return super()._sum(pieces)

    def step(rank):
        x = torch.ones(256)
        if rank == 1:
            return ops.all_reduce(x, "a", [0, 1], rank, "sum")
        with LiveBytes() as mem:
            out = ops.all_reduce(x, "a", [0, 1], rank, "sum")
            live = mem.live
        measured.set()
        partner_may_finish.set()
        return live, out.untyped_storage().nbytes()

    (live, out_bytes), _ = run_ranks(2, step, timeout=20, backend=SlowPartner(2, 20))
    assert measured.is_set() and live == out_bytes == 1024
