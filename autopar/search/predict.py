"""ap.predict(plan): the search's cost model for any plan (hand-written or automatic).

Example:
    >>> ap.predict(plan, "cpu-gloo")     # {'time_s': 0.0021, 'memory': 433668.0, ...}
"""

from __future__ import annotations

from autopar.errors import PlanError
from autopar.search.evaluate import Terms, plan_terms
from autopar.search.options import Auto


def predict(plan, device=None, optimizer_states: int = 2) -> dict:
    """Step time (s) and memory per rank (B) of ``plan`` under ``device`` (a profile name, an
    ap.calibrate() result or an ap.Auto)."""
    dp = plan.data_parallel
    if dp is not None and dp.shard_axes is not None:
        raise PlanError(
            f"ap.predict: the search's cost model does not cost ZeRO over folded axes ({dp}) yet; "
            "plan.memory_per_rank() and plan.cost() do."
        )
    auto = device if isinstance(device, Auto) else Auto(device=device)
    profile = auto.profile()
    total = Terms()
    for t in plan_terms(plan, {}, profile, optimizer_states).values():
        total.add(t)
    for technique in plan.options.techniques:  # a pipeline stage's share of the step
        total = total.scaled(technique.step_shares(plan.mesh, plan.built.get(technique.name)), plan.mesh, profile)
    sync, ahead, after = total.dp_sync(plan.mesh, profile, plan.dp_axis, dp)
    return {
        "time_s": total.time(plan.mesh, profile, plan.dp_axis, dp),
        "memory": total.memory(plan.mesh, plan.dp_axis, dp, plan),
        "compute_s": total.compute,
        "comm_s": total.comm,
        "sync_s": sync + total.sync_other,
        "prefetched_s": ahead,
        "zero_gather_s": after,
        "optimizer_s": total.step_seconds(plan.mesh, profile, plan.dp_axis, dp),
        "comm_bytes": dict(total.comm_bytes),
    }
