"""DisplayHooks, the display hooks of a technique.

What a technique shows of itself: ``print(plan)``, ``plan.explain``, ``plan.timeline_figure()``,
and its record in plan files.

Called by explore/ (plan_views.py, explain.py, plan_file.py).

Example:
    >>> from autopar.parallel.protocols.display import DisplayHooks
    >>> from autopar.parallel.technique import Technique
    >>> issubclass(Technique, DisplayHooks)
    True
"""

from __future__ import annotations

import dataclasses


class DisplayHooks:
    """The display hooks of a technique (all optional: each default changes nothing)."""

    def describe(self, plan) -> str:
        """What the technique built, as text print(plan) adds after the table ('' for nothing)."""
        return ""

    def explain_param(self, plan, fqn: str) -> list[str]:
        """Lines plan.explain(fqn) adds for this technique (how the parameter is stored, synced)."""
        return []

    def explain_module(self, plan, path: str) -> list[str]:
        """Lines plan.explain(path) adds for this technique about a module (checkpointed or not)."""
        return []

    def timeline(self, plan, events_per_rank=None) -> tuple | None:
        """plan.timeline_figure(): (rows, unit, marked) of the actions the technique runs each rank
        through in a step (a pipeline's schedule): per rank its (kind, micro-batch, stage, start,
        end) on unit slots ("slot"), or from the runners' measured ``events_per_rank`` ("ms");
        ``marked``: per rank the (kind, micro-batch, stage) drawn hatched. None: it runs none."""
        return None

    def fields(self) -> dict:
        """JSON-able fields for a plan file; ``from_fields`` is the inverse."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_fields(cls, fields: dict):
        return cls(**fields)
