"""``ap.Auto(verify=True)``: the search's choice dry-run before it is handed over.

The search weighs memory by formulas; ``verify`` runs the chosen plan's peak rank (the one
``plan.memory_per_rank`` says holds the most) at full size on fake tensors, records the
measured peak in the search's record (``dry_run_peak``, ``dry_run_rank``: explain("auto")
prints them) and warns where it is over the memory budget, naming by how much.

Example:
    >>> plan = ap.plan(model, mesh, kwargs=batch, auto=ap.Auto(memory_budget=70 * 2**30, verify=True))
    >>> plan.built["auto"]["dry_run_peak"]
"""

from __future__ import annotations

import warnings

import torch

from autopar.dryrun.run import dry_run
from autopar.errors import PlanError


def verify_choice(plan, record: dict, optimizer_states: int = 2) -> dict:
    """The record with the dry run's peak of the chosen plan's peak rank; a warning over budget."""
    if plan.stage_layout is not None:
        warnings.warn(
            "ap.Auto(verify=True): the chosen plan has pipeline stages, which plan.dry_run does not run "
            "yet; its memory is the formulas' (plan.memory_per_rank).",
            stacklevel=3,
        )
        return record
    optimizer = torch.optim.AdamW if optimizer_states == 2 else torch.optim.SGD
    kwargs = {} if optimizer_states == 2 else {"lr": 1e-3, "momentum": 0.9 if optimizer_states else 0.0}
    if optimizer_states not in (0, 1, 2):
        raise PlanError(
            f"ap.Auto(verify=True, optimizer_states={optimizer_states}): dry runs step Adam (2), SGD (1, 0)."
        )
    rank = plan.peak_memory_rank(optimizer_states)
    run = dry_run(plan, rank, "cuda", 2, optimizer, **kwargs).runs[rank]
    out = dict(record, dry_run_peak=run.peak_bytes, dry_run_rank=rank, dry_run_seconds=run.seconds)
    budget = record.get("budget")
    if budget is not None and run.peak_bytes > budget:
        warnings.warn(
            f"ap.plan(auto=ap.Auto(verify=True)): the chosen plan ({record['chosen']}) peaked at "
            f"{run.peak_bytes:.4g} B on rank {rank} in a dry run, over the memory budget of {budget:.4g} B "
            f"by {run.peak_bytes - budget:.4g} B (the formulas said {run.predicted_bytes:.4g} B). Lower the "
            "budget by the difference to plan within it.",
            stacklevel=3,
        )
    return out
