"""bench/SURVEY.md from the survey's rows (bench/survey.py): the headline figure, the table, causes.

Example:
    >>> text = write(rows, seconds=1234.0, args=namespace)
"""

from __future__ import annotations

from collections import Counter


def ok(row: dict) -> bool:
    """Planned on both meshes, equal to serial, and no op fell back to gathered-and-replicated."""
    return bool(row.get("equal")) and not row.get("fallback")


def headline(rows: list[dict]) -> str:
    built = [r for r in rows if r.get("built")]
    good = [r for r in built if ok(r)]
    pct = 100.0 * len(good) / max(len(built), 1)
    return (
        f"**{len(good)} of {len(built)} architectures that build ({pct:.1f}%) plan with no fallback op "
        f"and equal serial** (forward and every gradient) on meshes (2,) and (2, 2); "
        f"{len(rows) - len(built)} of {len(rows)} did not build from the shrunk default config or do not run "
        "serially on the survey's inputs (token ids, or images), and are not counted (see 'Not built')."
    )


def _row(r: dict) -> str:
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    frac = "" if r.get("params_per_rank") is None else f"{r['params_per_rank']:.2f}"
    fb = ", ".join(f.replace("aten.", "") for f in r.get("fallback", []))
    cause = (r.get("cause") or "").replace("|", "/").replace("\n", " ")
    return (
        f"| {r['name']} | {r.get('head', '')} | {yes(r.get('built'))} | {r.get('plan', '')} | "
        f"{yes(r.get('planned'))} | {yes(r.get('equal'))} | {fb} | {frac} | {r.get('seconds', '')} | {cause} |"
    )


def _causes(rows: list[dict], built: bool = True) -> list[str]:
    counts = Counter()
    for r in rows:
        if not built and not r.get("built"):
            counts[(r.get("cause") or "")[:140]] += 1
        elif built and r.get("built") and not ok(r):
            key = r.get("cause") or ("fallback: " + ", ".join(r.get("fallback", [])))
            counts[key.split(" at ")[0][:140]] += 1
    return [f"| {n} | {c.replace('|', '/')} |" for c, n in counts.most_common()]


def write(rows: list[dict], seconds: float, args, total: int | None = None) -> str:
    partial = (
        []
        if total is None or total == len(rows)
        else [
            f"**Partial run: {len(rows)} of the {total} architectures were surveyed** in the time the run had; "
            "the rest are not counted.",
            "",
        ]
    )
    lines = [
        "# Survey of the installed transformers",
        "",
        headline(rows),
        "",
        *partial,
        f"Command: `make survey` (`python -m bench.survey -j {args.jobs} --limit {args.limit}`), "
        + (
            f"{seconds / 60:.0f} min on this machine. "
            if seconds
            else "written with --report from a run's worker files. "
        )
        + "Plan: the Megatron preset on axis tp where it finds a "
        "column/row pair, plain data parallel otherwise; (2, 2) is dp x tp. `params/rank`: the fraction of "
        "the parameters rank 0 holds on (2,). `fallback`: ops with no rule whose split inputs were gathered.",
        "",
        "## Failures by cause",
        "",
        "| count | cause |",
        "|---|---|",
        *_causes(rows),
        "",
        "## Not built",
        "",
        "| count | cause |",
        "|---|---|",
        *_causes(rows, built=False),
        "",
        "## Every architecture",
        "",
        "| architecture | head | built | plan | planned | equal serial | fallback ops | params/rank | s | cause |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *map(_row, rows),
        "",
    ]
    return "\n".join(lines)
