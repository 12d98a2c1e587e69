"""ap.predict(plan): the search's cost model for any plan (hand-written or automatic).

ZeRO over folded axes (``DataParallel("dp", zero=3, shard_axes=("dp", "cp"))``, or over cp
alone) is costed as one group over them: the state sharded over their product, the gradient
sync (and zero=3's gathers) priced on the slowest link the group spans, cp's own gradient
all-reduce replaced by it (evaluate.Terms.zero_groups); ``sync_bytes`` names the group.

Example:
    >>> ap.predict(plan, "cpu-gloo")     # {'time_s': 0.0021, 'memory': 433668.0, ...}
    >>> ap.predict(folded, "h100")["sync_bytes"]    # {'dp*cp': 1.2e9}
"""

from __future__ import annotations

from autopar.search.evaluate import Terms, plan_terms
from autopar.search.options import Auto


def predict(plan, device=None, optimizer_states: int = 2) -> dict:
    """Step time (s) and memory per rank (B) of ``plan`` under ``device`` (a profile name, an
    ap.calibrate() result or an ap.Auto). ``comm_bytes``: bytes per rank and step of the
    activations' collectives by axis; ``sync_bytes``: of the data-parallel gradient sync (and
    ZeRO's gathers) by the group it runs over (``"dp"``, or ``"dp*cp"`` where ZeRO folds cp in);
    ``fp8_gather_bytes``: of those, zero=3's all-gathers in fp8 (``ap.Float8(fp8_all_gather=True)``,
    or the search's float8 pricing).

    ``memory``: what the rank that holds the most holds at its step's peak (``memory_rank``):
    plan.memory_per_rank(memory_rank).peak, its largest phase, plan.cost()'s ``peak_memory`` at the
    example (one definition: parallel/dp_module.memory_per_rank says what it counts, and a dry run
    measures it, docs/dry_run.md). ``memory_estimate``: the
    search's own figure for the plan, from its step shares (a pipeline rank's stages and
    micro-batches in flight estimated: search/evaluate.py), what it weighed while choosing."""
    dp = plan.state_storage
    auto = device if isinstance(device, Auto) else Auto(device=device)
    profile = auto.profile()
    total = Terms()
    for t in plan_terms(plan, {}, profile, optimizer_states).values():
        total.add(t)
    for technique in plan.options.techniques:  # a pipeline stage's share of the step
        total = total.scaled(technique.step_shares(plan.mesh, plan.built.get(technique.name)), plan.mesh, profile)
    sync, ahead, after = total.dp_sync(plan.mesh, profile, plan.batch_axis, dp)
    rank = plan.peak_memory_rank(optimizer_states)
    return {
        "time_s": total.time(plan.mesh, profile, plan.batch_axis, dp),
        "memory": float(plan.memory_per_rank(rank, optimizer_states).peak),
        "memory_rank": rank,
        "memory_estimate": total.memory(plan.mesh, plan.batch_axis, dp, plan),
        "compute_s": total.compute,
        "comm_s": total.comm,
        "sync_s": sync + total.other_sync(plan.mesh, dp),
        "prefetched_s": ahead,
        "zero_gather_s": after,
        "optimizer_s": total.step_seconds(plan.mesh, profile, plan.batch_axis, dp),
        "comm_bytes": dict(total.comm_bytes),
        "sync_bytes": total.sync_bytes(plan.mesh, profile, plan.batch_axis, dp),
        "fp8_gather_bytes": total.fp8_gather_bytes(plan.mesh, plan.batch_axis, dp),
    }
