"""cProfile of one rank's training step in ONE process (collectives on a one-rank gloo group):
autopar's rank module against its hand-written peer, call counts and own time per function.

Why one process: the call counts are deterministic (no waiting on another rank, no scheduling
noise), so a change's effect on the Python a step runs reads the same on a loaded machine.
The contenders are bench/bench_overhead.py's (tp: rank 0 of the Megatron annotations on tp=2
against bench/megatron.py; dp: rank 0 of ap.DataParallel against DDP).

Example:
    $ OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.profile_overhead tp --size small --steps 50
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the gloo worker imports bench.*


def _text(prof: cProfile.Profile, top: int, steps: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    calls = sum(v[1] for v in stats.stats.values())  # primitive + recursive calls
    out.write(f"function calls per step: {calls / steps:.0f}\n")
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def profile_job(kind: str, size: str, steps: int, top: int) -> dict:
    """Runs in a one-process gloo pool: build the contenders, warm them up, profile each."""
    import torch

    from autopar.runtime.backend import use_backend
    from bench.bench_overhead import LoopbackBackend, _dp, _tp

    torch.set_num_threads(1)
    out = {}
    with use_backend(LoopbackBackend(0)):
        built = _dp(size) if kind == "dp" else _tp(size)
        for name in ("autopar", "peer"):
            step = built[name]
            for _ in range(5):
                step()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            plain = (time.perf_counter() - t0) / steps
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(steps):
                step()
            prof.disable()
            out[name] = {"step_ms": plain * 1e3, "profile": _text(prof, top, steps)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=("tp", "dp"))
    p.add_argument("--size", default="small", help="tp: tiny | small | large | 30m; dp: quick | small | 30m")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    from bench.common import close_pools, pool

    try:
        res = pool(1).run("bench.profile_overhead:profile_job", args.kind, args.size, args.steps, args.top)[0]
    finally:
        close_pools()
    for name, r in res.items():
        print(f"==== {args.kind} {name} {args.size}: {r['step_ms']:.2f} ms per step (unprofiled)")
        print(r["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
