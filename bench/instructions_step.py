"""Instructions per training step under callgrind: autopar's rank module against its peer, in ONE
process (bench/bench_overhead.py's contenders: collectives on a one-rank gloo group).

Why: on a loaded machine wall-clock ratios wander by more than a few percent, and cProfile
sees Python calls only. Callgrind counts the instructions every thread executes (Python, the
aten kernels, autograd, gloo's threads), the same from run to run whatever the load, so a
change of a step's work reads as a change of this count. It does not see waiting: what two
processes lose to each other (a blocking collective's latency, skew) is not in it.

How: the script runs itself under ``valgrind --tool=callgrind --instr-atstart=no`` (the
start-up, tracing and warm-up run uninstrumented, several times faster), and around each
contender's ``--steps`` steps switches instrumentation on and dumps the counts through
callgrind's client requests, reached through a small C helper compiled once with gcc (needs
valgrind's headers). Expect tens of minutes on a loaded 2-core machine, most of it start-up.

Example:
    $ OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.instructions_step dp --size small --steps 3
"""

from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HELPER = r"""
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void stop(const char *name) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(name); }
"""
NAMES = ("autopar", "peer", "peer_copy")


def helper(workdir: Path) -> Path:
    """The client-request helper, compiled into ``workdir``."""
    src, lib = workdir / "callgrind_helper.c", workdir / "callgrind_helper.so"
    if not lib.exists():
        src.write_text(HELPER)
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def measure(kind: str, size: str, steps: int, lib: str) -> None:
    """Under callgrind: build the contenders, warm each up, dump the counts of ``steps`` steps."""
    import torch
    import torch.distributed as dist

    from autopar.runtime.backend import use_backend
    from bench.bench_overhead import LoopbackBackend, _dp, _tp

    requests = ctypes.CDLL(lib)
    # one process: an in-memory store, no port to pick (a free port found, closed, then bound
    # again could be taken by another job in between)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    with use_backend(LoopbackBackend(0)):
        built = _dp(size) if kind == "dp" else _tp(size)
        for name in NAMES:
            for _ in range(3):
                built[name]()
            requests.start()
            for _ in range(steps):
                built[name]()
            requests.stop(name.encode())
    dist.destroy_process_group()


def totals(out_prefix: str) -> dict[str, int]:
    """{contender: instructions} from the dumps (one file per client-request dump)."""
    found = {}
    for path in sorted(Path(out_prefix).parent.glob(Path(out_prefix).name + "*")):
        text = path.read_text(errors="replace")
        name = re.search(r"^desc: Trigger: Client Request: (\S+)", text, re.M)
        total = re.search(r"^totals: (\d+)", text, re.M)
        if name and total:
            found[name.group(1)] = int(total.group(1))
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=("dp", "tp"))
    p.add_argument("--size", default="small", help="dp: quick | small | 30m; tp: tiny | small | large | 30m")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--inner", default=None, help=argparse.SUPPRESS)  # the run under valgrind: the helper's path
    args = p.parse_args(argv)
    if args.inner:
        measure(args.kind, args.size, args.steps, args.inner)
        return 0
    work = Path(tempfile.mkdtemp(prefix="autopar_callgrind_"))
    lib, out = helper(work), work / "callgrind.out"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p"]
    cmd += [sys.executable, "-m", "bench.instructions_step", args.kind, "--size", args.size]
    cmd += ["--steps", str(args.steps), "--inner", str(lib)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    found = totals(str(out))
    peer = found.get("peer")
    print(
        f"{args.kind} {args.size}: instructions per step (callgrind, one process, {args.steps} steps; dumps in {work})"
    )
    for name, n in found.items():
        print(f"  {name:10s} {n / args.steps / 1e6:10.2f} M" + (f"   {n / peer:.4f} of peer" if peer else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
