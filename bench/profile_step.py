"""cProfile of one contender's training step on rank 0 of 2 gloo processes: where a step's
Python time goes (autopar's data-parallel sync against DDP's, a tensor-parallel rank module
against the hand-written Megatron module).

Both ranks run ``steps`` steps of the same contender (the collectives must match); rank 0's
profile is printed, sorted by own time (``tottime``) and by cumulative time.

Example:
    $ OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.profile_step dp autopar --size full --steps 20
    $ OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.profile_step tp megatron --kind gpt --size small
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the gloo workers import bench.*


def _stats_text(prof: cProfile.Profile, top: int) -> str:
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key).print_stats(top)
    return out.getvalue()


def profile_job(bench: str, contender: str, size: str, kind: str, steps: int, top: int) -> dict:
    """Runs on every rank: build the contenders of ``bench`` (dp or tp), warm ``contender``'s step
    up, then time and profile ``steps`` more of it (rank 0's profile is returned)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if bench == "dp":
        from bench.bench_dp import contenders

        step = contenders(size, only=(contender,))[0][contender]
    else:
        from bench.bench_tp import _step, contenders

        built = contenders(kind, size, dist.get_rank(), dist.get_world_size(), only=(contender,))[0]
        step = _step(*built[contender])
    for _ in range(3):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    plain = (time.perf_counter() - t0) / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    dist.barrier()
    return {"step_ms": plain * 1e3, "profile": _stats_text(prof, top)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", choices=("dp", "tp"))
    ap.add_argument(
        "contender", help="dp: autopar | ddp | per_param | ddp_one_bucket | local_loss; tp: autopar | megatron"
    )
    ap.add_argument("--size", default=None, help="dp: quick | small | 30m; tp: small | large | 30m")
    ap.add_argument("--kind", default="gpt", help="tp: gpt | mlp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    from bench.common import close_pools, pool

    size = args.size or ("small" if args.bench == "dp" else "small")
    try:
        res = pool(2).run(
            "bench.profile_step:profile_job", args.bench, args.contender, size, args.kind, args.steps, args.top
        )[0]
    finally:
        close_pools()
    print(f"{args.bench} {args.contender} {size}: {res['step_ms']:.2f} ms per step (unprofiled, rank 0)")
    print(res["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
