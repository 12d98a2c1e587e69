"""Median milliseconds per phase (forward, backward, optimizer step + zero_grad) of the data-parallel
contenders, alternating on 2 gloo ranks (rank 0's figures): where a step's difference lies.

Example:
    $ OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.phase_times small 30
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def phases_job(size: str, iters: int) -> dict:
    import random

    import torch
    import torch.distributed as dist
    from bench.bench_dp import autopar_module, ddp_module

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    module, a_args, _, (idx, tg) = autopar_module(size)
    local = (idx.chunk(world)[rank], tg.chunk(world)[rank])
    mods = {"autopar": (module, a_args), "ddp": (ddp_module(size), local)}
    opts = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, (m, _) in mods.items()}
    out = {n: {"fwd": [], "bwd": [], "opt": []} for n in mods}
    rng = random.Random(0)
    for it in range(iters + 3):
        order = list(mods)
        rng.shuffle(order)
        for n in order:
            m, a = mods[n]
            dist.barrier()
            t0 = time.perf_counter()
            loss = m(*a)[1]
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opts[n].step()
            opts[n].zero_grad()
            t3 = time.perf_counter()
            if it >= 3:
                out[n]["fwd"].append(t1 - t0)
                out[n]["bwd"].append(t2 - t1)
                out[n]["opt"].append(t3 - t2)
    return {n: {k: statistics.median(v) * 1e3 for k, v in d.items()} for n, d in out.items()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    size, iters = (argv + ["small", "30"])[:2] if len(argv) < 2 else argv[:2]
    from bench.common import close_pools, pool

    try:
        res = pool(2).run("bench.phase_times:phases_job", size, int(iters))[0]
    finally:
        close_pools()
    for n, d in res.items():
        print(n, "  ".join(f"{k} {v:7.2f}" for k, v in d.items()), f" total {sum(d.values()):7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
