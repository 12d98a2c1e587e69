"""``ap.Auto(verify=True)``: the search's choice dry-run before it is handed over.

The search weighs memory by formulas; ``verify`` runs the chosen plan's peak rank (the one
``plan.memory_per_rank`` says holds the most; a pipelined plan's too: its runner, parallel/pipeline/dry_run.py)
at full size on fake tensors and records the measured peak in the search's record
(``dry_run_peak``, ``dry_run_rank``: explain("auto") prints them). Where it is over the memory
budget the choice is refused and the next option that fits by the formulas (the runners-up in
the search's order, fastest first: ``ap.Auto(option=label)`` plans each) is planned and dry-run
in turn, up to ``TRIES`` of them; ``dry_run_refused`` lists what was refused and its measured
peak (explain("auto") says so). Where none is within the budget, the search's own choice is kept
and a warning says by how much it is over.

Example:
    >>> plan = ap.plan(model, mesh, kwargs=batch, auto=ap.Auto(memory_budget=70 * 2**30, verify=True))
    >>> plan.built["auto"]["dry_run_peak"], plan.built["auto"].get("dry_run_refused")
"""

from __future__ import annotations

import warnings

import torch

from autopar.dryrun.run import dry_run
from autopar.errors import PlanError


TRIES = 3  # options dry-run after a refused choice: each is a plan and a dry run (seconds to minutes at scale)


def verify_choice(plan, record: dict, optimizer_states: int = 2, warn: bool = True) -> dict:
    """The record with the dry run's peak of the chosen plan's peak rank; a warning over budget
    (``warn``)."""
    optimizer = torch.optim.AdamW if optimizer_states == 2 else torch.optim.SGD
    kwargs = {} if optimizer_states == 2 else {"lr": 1e-3, "momentum": 0.9 if optimizer_states else 0.0}
    if optimizer_states not in (0, 1, 2):
        raise PlanError(
            f"ap.Auto(verify=True, optimizer_states={optimizer_states}): dry runs step Adam (2), SGD (1, 0)."
        )
    rank = plan.peak_memory_rank(optimizer_states)
    run = dry_run(plan, rank, "cuda", 2, optimizer, **kwargs).runs[rank]
    out = dict(record, dry_run_peak=run.peak_bytes, dry_run_rank=rank, dry_run_seconds=run.seconds)
    if warn:
        _warn_over(out)
    return out


def _warn_over(record: dict) -> None:
    budget, peak = record.get("budget"), record["dry_run_peak"]
    if budget is not None and peak > budget:
        warnings.warn(
            f"ap.plan(auto=ap.Auto(verify=True)): the chosen plan ({record['chosen']}) peaked at "
            f"{peak:.4g} B on rank {record['dry_run_rank']} in a dry run, over the memory budget of {budget:.4g} B "
            f"by {peak - budget:.4g} B (the formulas said {record['memory']:.4g} B), and no other option "
            "tried was within it. Lower the budget by the difference to plan within it.",
            stacklevel=4,
        )


def verified(plan, optimizer_states: int, plan_option, tries: int = TRIES):
    """The chosen plan if its dry run is within the budget, else the first runner-up (fastest
    first, among those that fit by the formulas) whose dry run is; the search's choice with a
    warning where none of ``tries`` is. Its record lists the refused (``dry_run_refused``)."""
    record = verify_choice(plan, plan.built["auto"], optimizer_states, warn=False)
    budget, first = record.get("budget"), (plan, record)
    refused, tried = [], {record["chosen"]}
    while budget is not None and record["dry_run_peak"] > budget:
        refused.append({"option": record["chosen"], "dry_run_peak": record["dry_run_peak"]})
        candidates = [r for r in record.get("runners_up", []) if r["fits"] and r["option"] not in tried]
        if not candidates or len(refused) > tries:
            plan, record = first
            _warn_over(record)
            break
        label = min(candidates, key=lambda r: r["time_s"])["option"]
        tried.add(label)
        plan = plan_option(label)
        record = dict(plan.built["auto"], runners_up=record["runners_up"])
        for key in ("asked", "search_choice"):  # taken by the search, not asked for
            record.pop(key, None)
        record = verify_choice(plan, record, optimizer_states, warn=False)
    if refused and record["dry_run_peak"] <= (budget or 0):
        record["dry_run_refused"] = refused
    plan.built["auto"] = record
    return plan
