"""ap.calibrate(): alpha, beta and FLOP/s of this machine (and process group), as a Profile.

FLOP/s: float32 matmuls of the given size, timed after a warm-up (every rank at once in a
distributed job, so that ranks sharing cores measure what they will get). alpha and beta:
all-reduces on the default process group of a small and a large message; with a ring of n
ranks an all-reduce of b bytes costs 2(n-1) alpha + 2(n-1)/n b / beta, so two sizes give
both. Without an initialised process group alpha and beta come from ``fallback``.

Example:
    >>> prof = ap.calibrate()                        # single process: FLOP/s measured
    >>> plan = ap.plan(model, mesh, kwargs=batch, auto=ap.Auto(device=prof))
"""

from __future__ import annotations

import torch.distributed as dist
import dataclasses
import statistics
import time

import torch

from autopar.search.profiles import PROFILES, Profile


def calibrate(
    matmul: int = 256, small: int = 64, large: int = 1 << 20, repeat: int = 5, fallback: str = "cpu-gloo", group=None
) -> Profile:
    """A Profile measured here (name "calibrated"); collective in a torch.distributed job."""
    base = PROFILES[fallback]
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        dist.barrier(group)
    fps = _flops(matmul, repeat)
    if not distributed or dist.get_world_size(group) < 2:
        return dataclasses.replace(base, name="calibrated", flops_per_s=fps)
    n = dist.get_world_size(group)
    t_small, t_large = (_allreduce(nbytes, repeat, group) for nbytes in (small, large))
    f = 2 * (n - 1) / n
    beta = f * (large - small) / max(t_large - t_small, 1e-9)
    alpha = max((t_small - f * small / beta) / (2 * (n - 1)), 1e-7)
    stats = torch.tensor([fps, alpha, beta], dtype=torch.float64)
    dist.all_reduce(stats, group=group)  # every rank gets the same profile (the mean)
    fps, alpha, beta = (stats / n).tolist()
    return dataclasses.replace(base, name="calibrated", flops_per_s=fps, intra=(alpha, beta), inter=(alpha, beta))


def _flops(m: int, repeat: int) -> float:
    a, b = torch.randn(m, m), torch.randn(m, m)
    a @ b
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        times.append((time.perf_counter() - t0) / 4)
    return 2 * m**3 / statistics.median(times)


def _allreduce(nbytes: int, repeat: int, group) -> float:
    x = torch.zeros(max(nbytes // 4, 1))
    dist.all_reduce(x, group=group)
    times = []
    for _ in range(repeat):
        dist.barrier(group)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
