"""Shared benchmark helpers: rows, a reused gloo pool, and side-by-side alternating timing.

Timing protocol (why): on a small shared machine the speed drifts over seconds, so two
contenders timed one after the other are not comparable. Here every iteration runs each
contender once, in a shuffled order (seeded alike on every rank), both ranks starting together
(barrier, outside the timed region); the figure is the median over iterations of the
per-iteration ratio. Identical contenders then read 1.00 +- a few percent.

Example:
    >>> times = alternate({"a": step_a, "b": step_b}, iters=30, warmup=5)
    >>> ratio = median_ratio(times["a"], times["b"])
"""

from __future__ import annotations

import random
import statistics
import time

from autopar.runtime.gloo_pool import GlooPool

_POOLS: dict[int, GlooPool] = {}


def pool(world: int) -> GlooPool:
    """A started gloo pool of ``world`` processes, shared by every benchmark of this run."""
    if world not in _POOLS:
        _POOLS[world] = GlooPool(world, timeout=900.0).start()
    return _POOLS[world]


def use_pool(p: GlooPool) -> None:
    """Share an already started pool (the test session's) instead of starting one."""
    _POOLS[p.world_size] = p


def close_pools() -> None:
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()


def row(benchmark: str, case: str, metric: str, value, target: str = "", note: str = "") -> dict:
    return {"benchmark": benchmark, "case": case, "metric": metric, "value": value, "target": target, "note": note}


def alternate(steps: dict, iters: int, warmup: int, barrier=None) -> dict[str, list[float]]:
    """Seconds per call of each step, run alternately (rotating order), after ``warmup`` calls each."""
    names = list(steps)
    for _ in range(warmup):
        for n in names:
            steps[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    rng = random.Random(0)  # the same order on every rank: their collectives must match
    for _ in range(iters):
        order = names[:]
        rng.shuffle(order)  # no contender always runs right after another (cache, allocator)
        for n in order:
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            steps[n]()
            times[n].append(time.perf_counter() - t0)
    return times


def median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def ms(ts: list[float]) -> float:
    return statistics.median(ts) * 1e3


def train_step(module, args, kwargs=None, optimizer=None):
    """(step, optimizer): one training step of ``module`` (forward returning (out, loss), backward,
    optimizer step, zero_grad); ``optimizer`` is a torch.optim class (SGD by default)."""
    import torch

    opt = (optimizer or torch.optim.SGD)(module.parameters(), lr=1e-3)

    def step():
        _, loss = module(*args, **(kwargs or {}))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, opt


def main(run) -> None:
    """``python -m bench.bench_x [--quick]``: print one benchmark module's rows."""
    import sys

    try:
        for r in run(quick="--quick" in sys.argv):
            print(r)
    finally:
        close_pools()
