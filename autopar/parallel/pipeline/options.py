"""Pipeline options: the ``pipeline=`` argument of ap.plan and the ``ap.split_before()`` annotation.

Example:
    >>> plan = ap.plan(model, ap.Mesh((2, 2), ("pp", "tp")), args=(idx, tg),
    ...                annotations={"blocks.2": ap.split_before(), **MEGATRON},
    ...                pipeline=ap.Pipeline("pp", microbatches=8, schedule="1f1b"))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autopar.errors import PlanError
from autopar.parallel.technique import Technique

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class PipelineError(PlanError):
    """A pipeline option, stage split or schedule that cannot work."""


@dataclass(frozen=True)
class Pipeline(Technique):
    """Pipeline parallelism on mesh axis ``axis``.

    ``schedule``: "gpipe" (fill-drain), "1f1b", or "interleaved" (1F1B over ``chunks`` model
    chunks per rank: rank r holds stages r, r + pp, ...); "1f1b" with chunks > 1 means
    interleaved. ``checkpoint`` recomputes each stage's activations in backward. ``loss``
    (outputs, labels) -> scalar replaces the model's own loss; ``metric`` (outputs, labels)
    -> scalar is averaged alongside. ``stages`` overrides the number of stages (pp * chunks).
    """

    axis: str = "pp"
    microbatches: int = 4
    schedule: str = "1f1b"
    chunks: int = 1
    checkpoint: bool = False
    loss: Callable | None = None
    metric: Callable | None = None

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise PipelineError(f"Unknown pipeline schedule {self.schedule!r}: use one of {SCHEDULES}.")
        if self.microbatches < 1 or self.chunks < 1:
            raise PipelineError(f"microbatches ({self.microbatches}) and chunks ({self.chunks}) must be >= 1.")
        if self.schedule == "interleaved" and self.chunks < 2:
            raise PipelineError("schedule='interleaved' needs chunks >= 2 (model chunks per rank).")
        if self.schedule == "gpipe" and self.chunks > 1:
            raise PipelineError(
                "schedule='gpipe' runs one chunk per rank: use chunks=1, or schedule='interleaved' for several chunks."
            )

    name = "pipeline"

    @property
    def kind(self) -> str:
        return "interleaved" if self.chunks > 1 else self.schedule

    # ------------------------------------------------------- the technique (technique.py)
    def validate(self, mesh, options, annotations: dict) -> None:
        from autopar.parallel.pipeline.api import check_options

        dp = options.data_parallel
        check_options(self, mesh, dp.axis if dp is not None else None, annotations)

    def after_plan(self, plan):
        from autopar.parallel.pipeline.api import stage_layout

        return stage_layout(plan, self, list(plan.options.split_before))

    def fields(self) -> dict:
        raise PipelineError(
            "Saving a pipelined plan is not supported yet (its stages are not recorded). "
            "Save the plan made without pipeline=..., load it with ap.load_plan, then add "
            "the pipeline with plan.with_pipeline(ap.Pipeline(...), split_before=[...])."
        )


@dataclass(frozen=True)
class SplitBefore:
    """Annotation: a new pipeline stage starts at this module's first operation."""

    def __repr__(self) -> str:
        return "split_before()"

    def describe(self) -> str:
        return "pipeline stage boundary before this module"


def split_before() -> SplitBefore:
    """Mark a module path as the start of a pipeline stage: ``{"layers.4": ap.split_before()}``."""
    return SplitBefore()
