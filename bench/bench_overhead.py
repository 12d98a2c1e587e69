"""Framework overhead alone: one rank's training step against its hand-written peer in ONE
process, every collective a real torch.distributed call on a one-process gloo group.

Why: on a shared machine two processes waiting on each other read a few percent of noise
(their scheduling, not the code); the code's own cost (per-op Python, hooks, copies,
collective dispatch) is what this isolates. Each contender computes exactly what its rank
computes in a 2-rank run (its half of the batch or of the weights) and makes the same
collective calls, each on a group of one (gloo's own cost per call stays in, no waiting):

- ``dp``: rank 0 of ``ap.DataParallel("dp")`` on 2 ranks (its gradient buckets' all-reduces)
  against torch DDP on its local batch (both at their defaults: 25 MB buckets, the first 1 MB);
- ``tp``: rank 0 of the Megatron annotations on tp=2 against bench/megatron.py's module.

The identical pair (the peer against a second copy of itself) shows the run's noise. Steps
alternate in a shuffled order; figures are medians of per-iteration ratios.

Example:
    $ OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.bench_overhead
"""

from __future__ import annotations

import os

from bench.common import alternate, main, median_ratio, ms, pool, row, train_step

ITERS = {"quick": (10, 2), "small": (200, 10), "30m": (20, 3)}


class LoopbackBackend:
    """autopar's DistBackend with every group mapped to this process's one-rank group: the
    collectives run through the same code as in a real job, with nobody to wait for."""

    def __new__(cls, rank: int = 0):
        import torch.distributed as dist

        from autopar.runtime.dist_backend import DistBackend

        class _AnyGroup(dict):
            def __missing__(self, key):
                return dist.group.WORLD

        backend = DistBackend(_AnyGroup(), rank)
        backend._pg = lambda group, r: dist.group.WORLD  # every rank of a group is this process
        return backend


def _dp(size: str):
    import torch.distributed as dist

    import autopar as ap
    from bench.bench_dp import _batch, _model, ddp_module

    idx, tg = _batch(size, 2)
    plan = ap.plan(_model(size), ap.Mesh((2,), ("dp",)), args=(idx, tg), data_parallel="dp")
    a_args, a_kw = plan.local_inputs(0, idx, tg)
    local = (idx.chunk(2)[0], tg.chunk(2)[0])
    assert dist.get_world_size() == 1
    steps = {
        "autopar": train_step(plan.build_module(0), a_args, a_kw)[0],
        "peer": train_step(ddp_module(size), local)[0],
        "peer_copy": train_step(ddp_module(size), local)[0],
    }
    return steps


def _tp(size: str):
    import autopar as ap
    from bench.bench_tp import _step
    from bench.megatron import GPT_STYLES, megatronize
    from bench.models import annotations, build

    model, args = build("gpt", size)
    plan = ap.plan(model, ap.Mesh((2,), ("tp",)), args=args, annotations=annotations("gpt"))
    return {
        "autopar": _step(plan.build_module(0), args),
        "peer": _step(megatronize(model, 0, 2, GPT_STYLES), args),
        "peer_copy": _step(megatronize(model, 0, 2, GPT_STYLES), args),
    }


def overhead_job(kind: str, size: str, iters: int, warmup: int) -> dict:
    """Runs in a one-process gloo pool: build, then time the three steps alternately."""
    import torch

    from autopar.runtime.backend import use_backend

    torch.set_num_threads(1)
    with use_backend(LoopbackBackend(0)):
        steps = _dp(size) if kind == "dp" else _tp(size)
        return {"times": alternate(steps, iters, warmup)}


def _tp_size(size: str) -> str:
    return {"quick": "tiny"}.get(size, size)


def run(quick: bool) -> list[dict]:
    sizes = ["quick"] if quick else os.environ.get("BENCH_SIZES", "small,30m").split(",")
    rows = []
    for size in [s for s in sizes if s in ITERS]:
        iters, warmup = ITERS[size]
        iters = int(os.environ.get("BENCH_ITERS", iters))
        for kind, peer in (("dp", "DDP"), ("tp", "Megatron")):
            s = size if kind == "dp" else _tp_size(size)
            t = pool(1).run("bench.bench_overhead:overhead_job", kind, s, iters, warmup)[0]["times"]
            case = f"{kind} {s}, 1 process (collectives on a 1-rank gloo group)"
            rows += [
                row(
                    "overhead",
                    case,
                    f"{peer} / {peer} (noise)",
                    round(median_ratio(t["peer_copy"], t["peer"]), 3),
                    "1.00 +- 0.02",
                ),
                row(
                    "overhead",
                    case,
                    f"autopar / {peer} step time",
                    round(median_ratio(t["autopar"], t["peer"]), 3),
                    "<= 1.02",
                    f"median step ms: autopar {ms(t['autopar']):.2f}, {peer} {ms(t['peer']):.2f}; n={iters}",
                ),
            ]
    return rows


if __name__ == "__main__":
    main(run)
