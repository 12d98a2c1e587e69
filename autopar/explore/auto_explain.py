"""What plan.explain says about an automatic plan: the choice, why, and the runners-up.

Example:
    >>> print(plan.explain("auto"))          # the whole search
    >>> print(plan.explain("blocks.0.mlp"))  # ... ends with the search's reason for this module
"""

from __future__ import annotations

import fnmatch

from autopar.explore.display import fmt_bytes


def _ms(t) -> str:
    return "-" if t is None else f"{t * 1e3:.3f} ms"


def _gib(b) -> str:
    return fmt_bytes(b)


def _bandwidth(prof: dict) -> str:
    bw = prof.get("memory_bandwidth")
    return "" if bw is None else f", memory {bw:.3g} B/s"


def _estimate(rec: dict) -> str:
    """The search's own estimate of the memory, where the plan's count differs from it by >1%."""
    est = rec.get("memory_estimate")
    if est is None or abs(est - rec["memory"]) <= 0.01 * max(rec["memory"], 1.0):
        return ""
    return f"; the search estimated {_gib(est)} (rank {rec.get('memory_rank', 0)} holds the most)"


def _dry_run(rec: dict) -> str:
    """What ap.Auto(verify=True)'s dry run measured (autopar/dryrun/verify.py), where it ran."""
    if "dry_run_peak" not in rec:
        return ""
    over = rec["budget"] is not None and rec["dry_run_peak"] > rec["budget"]
    refused = "".join(
        f"; refused {r['option']}: its dry run peaked at {_gib(r['dry_run_peak'])}, over the budget"
        for r in rec.get("dry_run_refused", ())
    )
    return (
        f"; dry run: rank {rec['dry_run_rank']} peaked at {_gib(rec['dry_run_peak'])}"
        + (" (over the budget)" if over else "")
        + refused
    )


def search_text(rec: dict) -> str:
    prof = rec["profile"]
    budget = "none" if rec["budget"] is None else _gib(rec["budget"])
    asked = ""
    if rec.get("asked"):  # ap.Auto(option=...): a runner-up planned to be explained
        asked = f" (asked for with ap.Auto(option=...); the search itself chooses {rec['search_choice']})"
    lines = [
        f"automatic plan: {rec['chosen']}{asked}",
        f"  predicted step {_ms(rec['time_s'])}, memory per rank {_gib(rec['memory'])} (budget {budget})"
        + _estimate(rec)
        + _dry_run(rec),
        f"  cost model: profile {prof['name']}: {prof['flops_per_s']:.3g} FLOP/s{_bandwidth(prof)}, intra-node alpha "
        f"{prof['intra'][0]:.2g} s beta {prof['intra'][1]:.3g} B/s, inter-node alpha {prof['inter'][0]:.2g} s "
        f"beta {prof['inter'][1]:.3g} B/s, gradient sync overlap {prof['overlap']}",
        f"  solver {rec['solver']}: {rec['options']} options from {rec['probes']} probe plans "
        f"in {rec['search_s']:.2f} s",
    ]
    if rec.get("runner_up"):
        r = rec["runner_up"]
        lines.append(f"  runner-up: {r['option']}: {_ms(r['time_s'])}, {_gib(r['memory'])}")
    if rec.get("binding"):
        f = rec["binding"]["faster"]
        lines.append(
            f"  binding constraint: the memory budget; without it {f['option']} would take "
            f"{_ms(f['time_s'])} at {_gib(f['memory'])} per rank"
        )
    elif rec["budget"] is not None:
        lines.append("  binding constraint: none (the fastest option fits the budget)")
    lines += _duplication_lines(rec)
    if rec["constrained"]:
        lines.append(f"  fixed by your annotations (not searched): {', '.join(rec['constrained'])}")
    lines.append("  components (time and memory per rank of each choice under the chosen axis roles):")
    if not rec["components"]:
        lines.append(
            "    none: nothing here can be split on a tensor-parallel axis (no Megatron pair, vocabulary or experts "
            "the search may choose for, or all of them fixed by your annotations); the options below differ in "
            "the mesh axes' roles, ZeRO level, checkpointing and pipeline only"
        )
    for c in rec["components"]:
        lines.append(f"    {c['key']}: {c['choice']}  ({c['what']})")
        lines += [
            f"      {k}: {_ms(v['time_s'])} + sync {_ms(v['sync_s'])}, {_gib(v['memory'])}"
            for k, v in c["options"].items()
        ]
    lines.append("  runners-up (each option with its best component choices):")
    if not [r for r in rec["runners_up"] if r["option"] != rec["chosen"]]:
        lines.append(
            f"    none: the chosen option was the only one the constraints allow ({rec['options']} option(s): the "
            "mesh, your data_parallel / annotations and ap.Auto's zero, pipeline and checkpointing choices fix the rest)"
        )
    for r in rec["runners_up"]:
        fit = ("" if r["fits"] else "  (over budget)") + ("  <- chosen" if r["option"] == rec["chosen"] else "")
        lines.append(f"    {r['option']}: {_ms(r['time_s'])}, {_gib(r['memory'])}{fit}")
    return "\n".join(lines)


def _duplication_lines(rec: dict) -> list[str]:
    """Plain words for axes left replicated: their ranks do the same work, and why that is
    predicted fastest (the best option using the axis, and its time)."""
    lines = []
    for d in rec.get("duplicated", []):
        head = (
            f"  ranks duplicate work: axis {d['axis']} is replicated, so its {d['size']} ranks compute the "
            "same thing on the same data"
        )
        alt = d["instead"]
        if alt is None:
            lines.append(head + " (no option the constraints allow uses it).")
            continue
        lines.append(
            head + f"; predicted fastest anyway: the best option using {d['axis']} ({alt['option']}) takes "
            f"{_ms(alt['time_s'])} against {_ms(rec['time_s'])}, its communication costing more than the "
            f"compute it divides at this model's size on profile {rec['profile']['name']}"
            + ("" if alt["fits"] else " (and it is over the memory budget)")
            + "."
        )
    return lines


def module_reason(rec: dict, path: str) -> str | None:
    """The search's line for a module inside one of its components (None otherwise)."""
    for c in rec.get("components", []):
        pats = [c["key"], c["key"] + ".*", *c.get("patterns", [])]
        if any(fnmatch.fnmatchcase(path, p) for p in pats):
            alts = ", ".join(f"{k} {_ms(v['time_s'])} / {_gib(v['memory'])}" for k, v in c["options"].items())
            return f"  automatic plan: {c['key']} chosen {c['choice']} ({alts})"
    return None
