"""The search's record (plan.built["auto"], what plan.explain("auto") prints): the choice, each
component's options, the runners-up (each option's own optimum), what binds, the replicated axes.

Example:
    >>> record = record_of(ctx, best, options, len(probes))
    >>> record["chosen"], record["runners_up"][0]["option"]
"""

from __future__ import annotations

import dataclasses
import warnings

from autopar.errors import PlanError
from autopar.search.solver import solve
from autopar.search.weigh import label_of, least_memory


def duplicated_axes(ctx, s, options) -> list[dict]:
    """The chosen plan's replicated axes (their ranks repeat each other's work), each with the
    fastest option that divides the work over it instead: data parallel on it (which always
    divides the compute), else tensor parallel on it."""
    mesh, auto, profile = ctx.mesh, ctx.auto, ctx.profile
    out = []
    for a, name in enumerate(mesh.axis_names):
        if s.uses(a) or mesh.shape[a] == 1:
            continue
        using = [o for o in options if a in (o.label[0].dp, o.label[0].rep)] or [
            o for o in options if a in (o.label[0].tp, o.label[0].pp, o.label[0].cp)
        ]
        best = None
        for o in using:
            sol = solve([o], auto.memory_budget, profile.overlap)
            fits = sol is not None
            sol = sol or solve([o], None, profile.overlap)
            if sol is not None and (best is None or sol.time < best["time_s"]):
                best = {"option": label_of(mesh, o.label), "time_s": sol.time, "fits": fits}
        out.append({"axis": name, "size": mesh.shape[a], "instead": best})
    return out


def named(ctx, options: list):
    """The solution of the option ``auto.option`` names (a runners-up label), within the budget
    where it fits, else without it (a refused option is planned to be explained too)."""
    mesh, auto, profile = ctx.mesh, ctx.auto, ctx.profile
    named = [o for o in options if label_of(mesh, o.label) == auto.option]
    if not named:
        labels = sorted({label_of(mesh, o.label) for o in options})
        raise PlanError(
            f"ap.Auto(option={auto.option!r}): the search weighed no such option on {mesh}; its "
            f"{len(labels)} options are: {'; '.join(labels)}. Pass one of them (plan.explain('auto') lists "
            "the fastest), or leave option out to plan the fastest."
        )
    return solve(named, auto.memory_budget, profile.overlap) or solve(named, None, profile.overlap)


def settle_memory(plan, record: dict, optimizer_states: int = 2) -> dict:
    """The search's record with the chosen plan's memory as the plan holds it: ``memory``, the
    peak of the rank that holds the most (plan.memory_per_rank, what plan.cost() and ap.predict
    say), ``memory_estimate``, the figure the search weighed (a pipeline's from its step shares,
    search/evaluate.py). Where the plan holds more than the budget, a warning says by how much."""
    rank = plan.peak_memory_rank(optimizer_states)
    held = float(plan.memory_per_rank(rank, optimizer_states).peak)
    out = dict(record, memory=held, memory_rank=rank, memory_estimate=record["memory"])
    budget = record.get("budget")
    if budget is not None and held > budget:
        warnings.warn(
            f"ap.plan(auto=...): the chosen plan ({record['chosen']}) holds {held:.4g} B on rank {rank}, over the "
            f"memory budget of {budget:.4g} B: the search estimated {record['memory']:.4g} B "
            "(plan.memory_per_rank(rank) has the parts). Lower the budget by the difference to plan within it.",
            stacklevel=3,
        )
    return out


def record_of(ctx, best, options: list, n_probes: int) -> dict:
    """What plan.explain("auto") prints (JSON, saved with the plan); ``search_s`` filled in by the search."""
    mesh, auto, profile = ctx.mesh, ctx.auto, ctx.profile
    runners = []
    for o in options:  # each option's own optimum: what choosing it instead would cost
        sol = solve([o], auto.memory_budget, profile.overlap)
        runners.append(
            {
                "option": label_of(mesh, o.label),
                "time_s": sol.time if sol else None,
                "memory": sol.memory if sol else least_memory(o),
                "fits": sol is not None,
            }
        )
    runners.sort(key=lambda r: (r["time_s"] is None, r["time_s"] or 0.0))
    chosen = next(o for o in options if o.label == best.option)
    label = label_of(mesh, best.option)
    runner_up = next((r for r in runners if r["fits"] and r["option"] != label), None)
    binding = None  # the budget binds when a faster plan exists that it refuses
    if auto.memory_budget is not None:
        fastest = solve(options, None, profile.overlap)
        if fastest is not None and fastest.time < best.time * (1 - 1e-9):
            over = {"option": label_of(mesh, fastest.option), "time_s": fastest.time, "memory": fastest.memory}
            binding = {"constraint": "memory budget", "faster": over}
    comps = []
    for c in ctx.free:
        opts = {k: {"time_s": v[0], "sync_s": v[1], "memory": v[3 + best.row]} for k, v in chosen.comps[c.key].items()}
        pats = sorted(set(c.patterns))
        comps.append(
            {"key": c.key, "what": c.describe(), "choice": best.choices[c.key], "options": opts, "patterns": pats}
        )
    return {
        "chosen": label_of(mesh, best.option),
        "chosen_option": label_of(mesh, best.option),  # "chosen" may say more (the tp axis split nothing)
        "time_s": best.time,
        "memory": best.memory,
        "budget": auto.memory_budget,
        "profile": dataclasses.asdict(profile),
        "components": comps,
        "constrained": sorted(ctx.touched),
        "runners_up": runners[:12],
        "runner_up": runner_up,
        "binding": binding,
        "solver": "scipy.optimize.milp (HiGHS)",
        "search_s": 0.0,
        "probes": n_probes,
        "options": len(options),
    }
