"""bench/SURVEY.md from the survey's rows (bench/survey.py): the headline figure, the table, causes.

Example:
    >>> text = write(rows, seconds=1234.0, args=namespace)
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

BF16_REPORT = Path(__file__).resolve().parent / "SURVEY_BF16.md"


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


def bf16_ok(row: dict) -> bool:
    """Under the bf16 policy: planned on both meshes with no fallback op, within the tolerance of
    the serial policy (bench/survey_precision.py)."""
    return bool(row.get("bf16_equal")) and not row.get("bf16_fallback")


def bf16_headline(rows: list[dict]) -> str:
    base = [r for r in rows if ok(r)]
    good = [r for r in base if bf16_ok(r)]
    pct = 100.0 * len(good) / max(len(base), 1)
    return (
        f"**{len(good)} of {len(base)} language models that plan in fp32 ({pct:.1f}%) plan under the bf16 "
        "policy with no fallback op and match the serial model under the same recipe** (bf16 compute over "
        "fp32 masters: loss and every fp32 gradient) on meshes (2,) and (2, 2)."
    )


def bf16_cause(row: dict) -> str:
    """Why ``row`` failed under the policy (a time limit met in its bf16 stage is the row's cause)."""
    return row.get("bf16_cause") or row.get("cause") or "fallback: " + ", ".join(row.get("bf16_fallback", []))


def _bf16_row(r: dict) -> str:
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    fb = ", ".join(f.replace("aten.", "") for f in r.get("bf16_fallback", []))
    worst = "" if r.get("bf16_max_rel") is None else f"{r['bf16_max_rel']:.1e}"
    cause = "" if bf16_ok(r) else bf16_cause(r).replace("|", "/").replace("\n", " ")
    return (
        f"| {r['name']} | {r.get('plan', '')} | {yes(r.get('bf16_planned'))} | {yes(r.get('bf16_equal'))} | "
        f"{fb} | {worst} | {r.get('seconds', '')} | {cause} |"
    )


def write_bf16(rows: list[dict], seconds: float, args, total: int | None = None) -> str:
    """bench/SURVEY_BF16.md: the bf16 policy on the models that plan in fp32."""
    from bench.survey_precision import TOLERANCE

    base = [r for r in rows if ok(r)]
    failed = [r for r in base if not bf16_ok(r)]
    counts = Counter(
        (r.get("bf16_cause") or "fallback: " + ", ".join(r.get("bf16_fallback", [])))[:140] for r in failed
    )
    head = f"--head {args.head} " if args.head else ""
    partial = (
        []
        if total is None or total == len(rows)
        else [f"**Partial run: {len(rows)} of the {total} architectures were surveyed.**", ""]
    )
    return "\n".join(
        [
            "# Survey under the bf16 precision policy",
            "",
            bf16_headline(rows),
            "",
            *partial,
            f"Command: `python -m bench.survey -j {args.jobs} --limit {args.limit} {head}--precision bf16`, "
            + (f"{seconds / 60:.0f} min on this machine. " if seconds else "written with --report. ")
            + "Counted: the architectures that plan with no fallback and equal serial in fp32 (the same run; "
            f"{len(rows) - len(base)} of {len(rows)} do not, see bench/SURVEY.md). Plans: on (2,) the Megatron "
            "preset on tp under `ap.MixedPrecision(param_dtype=torch.bfloat16)` (or "
            '`ap.DataParallel("dp", zero=3, param_dtype=torch.bfloat16)` where the preset finds no pair), on '
            "(2, 2) the preset beside that DataParallel; `labels=input_ids`. Reference: the serial model "
            "computing with bf16 copies of its fp32 parameters. Tolerance: " + TOLERANCE + ". `max rel`: the "
            "largest gradient distance relative to the reference's norm.",
            "",
            "## Failures",
            "",
            "| count | cause |",
            "|---|---|",
            *[f"| {n} | {c.replace('|', '/')} |" for c, n in counts.most_common()],
            "",
            "## Every architecture planned in fp32",
            "",
            "| architecture | plan | planned | matches | fallback ops | max rel | s | cause |",
            "|---|---|---|---|---|---|---|---|",
            *map(_bf16_row, base),
            "",
        ]
    )


def _bf16_line() -> list[str]:
    """SURVEY.md's pointer to the bf16 survey (its headline), where one was written."""
    if not BF16_REPORT.exists():
        return []
    lines = BF16_REPORT.read_text().splitlines()
    return [f"Under the bf16 precision policy (bench/SURVEY_BF16.md): {lines[2]}", ""] if len(lines) > 2 else []


def write(rows: list[dict], seconds: float, args, total: int | None = None) -> str:
    if getattr(args, "precision", None) == "bf16":
        return write_bf16(rows, seconds, args, total)
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
        *_bf16_line(),
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
