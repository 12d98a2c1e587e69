"""The search's time on the published configurations' meshes (bench_published's searches), each in
a fresh process: wall-clock and CPU seconds of the search alone, its peak RSS, its choice and a
digest of its whole record (to check that a faster search chooses the same plans).

CPU seconds are given beside wall-clock because the machine this ran on is shared: under load
the wall clock of a 10 s search varies by 2x and more, its CPU time much less.

Example:
    $ PYTHONPATH=. python -m bench.search_time 405b 80 95     # the 512-rank searches
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.bench_published import PUBLISHED, SCRIPT

# the bench's script, with the search itself timed (wall and CPU) and its record digested
WRAP = r"""
import hashlib, json, sys, time
import autopar.planner as planner
_search, _spent = planner.search, {}
def _timed(*a, **k):
    c, w = time.process_time(), time.perf_counter()
    try:
        return _search(*a, **k)
    finally:
        _spent.update(cpu=time.process_time() - c, wall=time.perf_counter() - w)
planner.search = _timed
"""
TAIL = r"""
rec = {k: v for k, v in plan.built["auto"].items() if k != "search_s"}
print("SEARCH", json.dumps({"wall_s": round(_spent["wall"], 2), "cpu_s": round(_spent["cpu"], 2),
      "rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
      "chosen": plan.built["auto"]["chosen"],
      "digest": hashlib.sha1(json.dumps(rec, sort_keys=True, default=str).encode()).hexdigest()[:12]}))
"""


def search_time(size: str, budget: int) -> dict:
    name, (_, shape, names, local, seq, mode, *_) = next((k, v) for k, v in PUBLISHED.items() if v[0] == size)
    arg = json.dumps([size, list(shape), list(names), local, seq, mode, budget])
    out = subprocess.run([sys.executable, "-c", WRAP + SCRIPT + TAIL, arg], capture_output=True, text=True)
    if out.returncode:
        return {"case": name, "budget": budget, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    line = next(x for x in out.stdout.splitlines() if x.startswith("SEARCH "))
    return {"case": name, "budget": budget, **json.loads(line[len("SEARCH ") :])}


if __name__ == "__main__":
    size, budgets = sys.argv[1], [int(b) for b in sys.argv[2:]] or [80, 95]
    for b in budgets:
        print(json.dumps(search_time(size, b)))
