"""ap.calibrate(): alpha, beta and FLOP/s of this machine (and process group), as a Profile.

FLOP/s: float32 matmuls of the given size, timed after a warm-up (every rank at once in a
distributed job, so that ranks sharing cores measure what they will get). alpha and beta:
all-reduces on the default process group of a small and a large message; with a ring of n
ranks an all-reduce of b bytes costs 2(n-1) alpha + 2(n-1)/n b / beta, so two sizes give
both. Each size's time is the fastest of ``repeat`` (on a shared machine the others measure
the load) and the slowest rank's (a collective ends when its last rank does), so every rank
fits the same two numbers; the large message grows (x4, up to 64 MiB) until it takes twice the
small one, so that the difference of the two is the bandwidth rather than noise. Without an
initialised process group alpha and beta come from ``fallback``.

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
    t_small = _agreed(_allreduce(small, repeat, group), group)
    t_large = _agreed(_allreduce(large, repeat, group), group)
    while t_large < 2 * t_small and large < MAX_MESSAGE:  # the same decision on every rank
        large *= 4
        t_large = _agreed(_allreduce(large, repeat, group), group)
    alpha, beta = fit_link(n, small, t_small, large, t_large)
    stats = torch.tensor([fps], dtype=torch.float64)
    dist.all_reduce(stats, group=group)  # every rank gets the same profile (the mean FLOP/s)
    fps = stats.item() / n
    return dataclasses.replace(base, name="calibrated", flops_per_s=fps, intra=(alpha, beta), inter=(alpha, beta))


MAX_MESSAGE = 64 << 20


def fit_link(n: int, small: int, t_small: float, large: int, t_large: float) -> tuple[float, float]:
    """(alpha, beta) of a ring all-reduce over ``n`` ranks from the times of two message sizes.
    The difference of the two times is trusted down to half the large message's time: below
    that (the large message not clearly slower: noise on a loaded machine) a difference of
    half its time is taken, so beta stays within twice what the large message alone gives.

    Example:
        >>> fit_link(2, 64, 1e-4, 1 << 20, 1.1e-3)     # (~5e-05 s, ~1.05e9 B/s)
    """
    f = 2 * (n - 1) / n
    beta = f * (large - small) / max(t_large - t_small, t_large / 2)
    alpha = max((t_small - f * small / beta) / (2 * (n - 1)), 1e-7)
    return alpha, beta


def _agreed(seconds: float, group) -> float:
    """The slowest rank's ``seconds``: every rank then fits the same numbers."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


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
    return min(times)
