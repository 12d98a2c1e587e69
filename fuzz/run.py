"""`make fuzz`: many random cases; each failure is saved as a replayable seed file.

A failure is any case that neither matches serial nor raises a PlanError (a wrong number,
an internal exception). It is written to fuzz/failures/<hash>.json with the case, the error
and the command that replays it; the run goes on to find more.

Example:
    $ .venv/bin/python -m fuzz.run --examples 2000 --seed 7
    $ .venv/bin/python -m fuzz.replay fuzz/failures/3f2a9c1b.json
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import time
import traceback

from hypothesis import HealthCheck, given, seed, settings

from .spec import replay_command, run_case
from .strategies import cases

FAILURES = os.path.join(os.path.dirname(__file__), "failures")


def save_failure(case: dict, error: BaseException) -> str:
    os.makedirs(FAILURES, exist_ok=True)
    digest = hashlib.sha1(json.dumps(case, sort_keys=True).encode()).hexdigest()[:10]
    path = os.path.join(FAILURES, f"{digest}.json")
    rel = os.path.relpath(path)
    with open(path, "w") as f:
        json.dump(
            {
                "case": case,
                "error": f"{type(error).__name__}: {error}"[:4000],
                "traceback": traceback.format_exc()[-4000:],
                "replay": replay_command(rel),
            },
            f,
            indent=1,
        )
    return rel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--pool", type=int, default=10**6, help="how many distinct models to draw from")
    opts = ap.parse_args(argv)
    counts: collections.Counter = collections.Counter()
    saved: list[str] = []

    @seed(opts.seed)
    @settings(max_examples=opts.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases(pool=opts.pool))
    def explore(case):
        try:
            counts[run_case(case).split(":")[0]] += 1
        except Exception as e:  # noqa: BLE001 - every non-PlanError outcome is a finding
            counts["FAILURE"] += 1
            saved.append(save_failure(case, e))

    explore()
    print(f"fuzz seed {opts.seed}: {dict(counts)}")
    for path in saved:
        print(f"  failure: {path}  (replay: {replay_command(path)})")
    return 1 if saved else 0


if __name__ == "__main__":
    raise SystemExit(main())
