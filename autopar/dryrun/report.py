"""What a dry run measured on each rank, beside what the plan predicts for it.

``RankRun``: one rank program's run (peak bytes by kind, the collectives of one step in
order, FLOPs per step, seconds) with the plan's figures for that rank (``memory_per_rank``,
``plan.collectives()``, ``plan.cost()``'s FLOPs). ``DryRun``: the runs of one call, one per
distinct rank program, read as the rank that holds the most where one figure is asked for.

Example:
    >>> report = plan.dry_run(device="cuda")
    >>> report.peak_bytes, report.peak_by_kind["activations"]
    >>> report.collectives[:2]          # [("all_reduce", "tp", 8192.0), ...]
    >>> print(report)                   # measured vs predicted per rank
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

GiB = 2**30


@dataclass
class RankRun:
    rank: int
    device: str
    steps: int
    peak_bytes: int
    peak_by_kind: dict
    collectives: list  # (kind, axis, bytes per rank) of one step, in the order they ran
    flops: float  # per step (the last one)
    seconds: float
    predicted_bytes: float = 0.0  # plan.memory_per_rank(rank).peak: its largest phase, ap.predict's figure
    predicted_sum: float = 0.0  # memory_per_rank(rank).total: every part added, an upper bound
    predicted_by_kind: dict = field(default_factory=dict)
    predicted_phases: dict = field(default_factory=dict)  # memory_per_rank(rank).phases: by phase
    predicted_collectives: list = field(default_factory=list)  # plan.collectives(): (kind, axis, bytes)
    predicted_flops: float = 0.0  # plan.cost()'s
    flops_by_op: dict = field(default_factory=dict)  # FlopCounterMode's, per op of the last step
    held_by_kind: dict = field(default_factory=dict)  # bytes by kind after the last step (params, state)

    @property
    def memory_ratio(self) -> float:
        return self.peak_bytes / self.predicted_bytes if self.predicted_bytes else float("nan")

    @property
    def flops_ratio(self) -> float:
        return self.flops / self.predicted_flops if self.predicted_flops else float("nan")

    @property
    def collectives_match(self) -> bool:
        """The same collectives in kind, axis and bytes (as multisets: the plan lists the
        gradient buckets after the graph's collectives, a run interleaves them with backward)."""
        return sorted(_rounded(self.collectives)) == sorted(_rounded(self.predicted_collectives))

    def row(self) -> list[str]:
        coll = "equal" if self.collectives_match else f"{len(self.collectives)} vs {len(self.predicted_collectives)}"
        return [
            str(self.rank),
            f"{self.peak_bytes / GiB:.3f}",
            f"{self.predicted_bytes / GiB:.3f}",
            f"{self.memory_ratio:.3f}",
            f"{self.flops:.4g}",
            f"{self.flops_ratio:.3f}",
            coll,
            f"{self.seconds:.1f}",
        ]


HEADER = ["rank", "peak GiB", "predicted GiB", "ratio", "FLOPs/step", "ratio", "collectives", "s"]


class DryRun:
    """The runs of one ``plan.dry_run`` call (``runs``: rank -> RankRun); as one figure, the rank
    that peaked highest (``peak_rank``)."""

    def __init__(self, runs: dict):
        self.runs = runs
        self.peak_rank = max(runs, key=lambda r: (runs[r].peak_bytes, -r))

    def __getattr__(self, name):
        if name in ("runs", "peak_rank"):
            raise AttributeError(name)
        return getattr(self.runs[self.peak_rank], name)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.runs.values())

    def __repr__(self) -> str:
        rows = [HEADER] + [run.row() for run in self.runs.values()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        peak = self.runs[self.peak_rank]
        kinds = ", ".join(f"{k} {v / GiB:.3f}" for k, v in sorted(peak.peak_by_kind.items()) if v)
        return (
            f"<autopar.DryRun on {peak.device}, {peak.steps} steps>\n"
            + "\n".join(lines)
            + f"\npeak rank {self.peak_rank} at its peak (GiB): {kinds}"
        )

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in run.row()) + "</tr>" for run in self.runs.values()
        )
        return f"<table><tr>{head}</tr>{body}</table>"


def _rounded(collectives) -> list:
    return [(k, a, round(b)) for k, a, b in collectives]
