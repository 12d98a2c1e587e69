"""When data parallel's buckets launch in backward, on 2 gloo processes: bench/bench_dp.py's
autopar contender (25 MB buckets), its step instrumented (rank 0).

For each of the first steps it prints the buckets (sizes in parameters), then backward's
events in order: each gradient's arrival (its bucket's index) and each bucket's launch, and
for each launch how many of the step's gradients had arrived by then. Buckets that launch as
they fill, in the order backward produces them, read "launch k" right after the last
gradient of bucket k, with gradients still to come; the second step shows the buckets rebuilt
from the first step's arrival order (as DDP rebuilds its buckets). It also counts, per step,
the tensor calls a gradient copy or concatenation would show (``torch.cat``,
``_foreach_copy_``, ``div_``): gradients living in their buckets make none of them but the
one copy of each fresh gradient into its slot (after ``zero_grad(set_to_none=True)``).

Example:
    $ OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.dp_launch_order --size small --steps 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the gloo workers import bench.*


def order_job(size: str, steps: int) -> list[dict]:
    """Runs on both ranks: ``steps`` instrumented steps of the autopar contender; rank 0's events."""
    import cProfile
    import pstats

    import torch

    from bench.bench_dp import autopar_module
    from bench.common import train_step

    torch.set_num_threads(1)
    module, a_args, a_kw, _ = autopar_module(size)
    step = train_step(module, a_args, a_kw)[0]
    sync = module.autopar_grad_sync
    events: list = []
    launch = sync._launch

    def launched(i):  # the instance's attribute: GradSync's hooks call self._launch
        events.append(("launch", i))
        return launch(i)

    sync._launch = launched
    for name, p in module.named_parameters():  # after GradSync's own hook (registered first)
        if name in sync.where:
            p.register_post_accumulate_grad_hook(lambda _p, n=name: events.append(("grad", sync.where[n][0])))

    watched = ("cat", "_foreach_copy_", "div_", "copy_")
    out = []
    for _ in range(steps):
        buckets = [len(b.names) for b in sync.buckets]
        events.clear()
        prof = cProfile.Profile()  # Python's calls of these tensor functions, hooks included
        prof.enable()
        step()
        prof.disable()
        calls = dict.fromkeys(watched, 0)
        for (_, _, func), row in pstats.Stats(prof).stats.items():
            name = (func.split("'")[1] if "'" in func else func.split(" ")[-1].rstrip(">")).rsplit(".", 1)[-1]
            if name in calls:
                calls[name] += row[1]
        seen, lines = 0, []
        total = sum(1 for e in events if e[0] == "grad")
        for kind, i in events:
            if kind == "grad":
                seen += 1
            else:
                lines.append(f"launch {i} after {seen}/{total} gradients")
        grads = [i for kind, i in events if kind == "grad"]
        out.append({"buckets": buckets, "launches": lines, "grad_buckets": grads, "calls": calls})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="quick | small | 30m (bench/bench_dp.py)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    from bench.common import close_pools, pool

    try:
        res = pool(2).run("bench.dp_launch_order:order_job", args.size, args.steps)[0]
    finally:
        close_pools()
    for n, r in enumerate(res, 1):
        print(f"step {n}: buckets (parameters each) {r['buckets']}")
        runs, last = [], None
        for b in r["grad_buckets"]:  # arrivals as runs of one bucket: "1x12 0x40" (bucket x count)
            if runs and runs[-1][0] == b:
                runs[-1][1] += 1
            else:
                runs.append([b, 1])
            last = b
        print("  gradients arrive into buckets:", " ".join(f"{b}x{c}" for b, c in runs), f"(last {last})")
        for line in r["launches"]:
            print("  " + line)
        print("  tensor calls:", ", ".join(f"{k} {v}" for k, v in r["calls"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
