"""Fault tolerance (issue 48, docs/fault_tolerance.md): what one lost replica group costs.

Two replica groups of 2 gloo processes each (dp=2 x tp=2, a small MLP with a batch norm, SGD
with momentum), each its own job under ap.FaultTolerant with a torchft lighthouse (heartbeat
timeout 1 s). After 4 steps both groups committed, one process of group 1 is SIGKILLed; the
group is restarted as torchrun would, heals from group 0 and rejoins (tests/gloo/ft_driver.py).
Per failure:

- ``steps lost``: attempts of the survivor that did not commit (its all-reduce met the dead peer);
- ``survivor stall``: the longest gap between two of the survivor's commits (the failure noticed,
  a new quorum without the dead group);
- ``rejoin``: seconds from the kill to the restarted group's first step taking part again (its
  processes restart, import, plan, join the quorum and fetch the peer's state: mostly start-up).

The final parameters are checked against the serial run over the committed batches too.

Example:
    $ PYTHONPATH=. python -m bench.bench_fault_tolerance [--quick]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.common import main, row


def run(quick: bool = False) -> list[dict]:
    from tests.gloo import ft_driver

    rows = []
    for failure in range(1 if quick else 3):
        with tempfile.TemporaryDirectory() as tmp:
            out = ft_driver.run_job(Path(tmp), "tp", steps=12, groups=2, kill_at=4, timeout=200)
            rec, diff = ft_driver.recovery(out), ft_driver.max_difference(out)
        case = f"dp2 x tp2, failure {failure + 1}"
        note = f"final parameters vs serial over the committed batches: {diff:.1e}"
        rows.append(row("fault_tolerance", case, "steps lost", rec["steps_lost"], "<= 1", note))
        rows.append(row("fault_tolerance", case, "survivor stall (s)", round(rec["survivor_stall_s"], 2)))
        rows.append(row("fault_tolerance", case, "rejoin after the kill (s)", round(rec["rejoin_s"], 2)))
    return rows


if __name__ == "__main__":
    main(run)
