"""PlanOptions: every choice ap.plan takes besides the model, mesh, inputs and annotations.

One frozen value instead of keyword arguments passed along and a string-keyed dict: the
plan keeps it (``plan.options``), save/load writes it field by field, and the planning
pipeline (planner.py) reads only it. The parallelism techniques it names (data parallel,
pipeline) are the plug-ins of parallel/technique.py.

Example:
    >>> opts = PlanOptions(data_parallel=ap.DataParallel("dp", zero=2), strict=True)
    >>> opts.replace(data_parallel=ap.DataParallel("dp")).techniques
    (DataParallel('dp', bucket_mb=25),)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.parallel.data_parallel import DataParallel
from autopar.parallel.pipeline.options import Pipeline, PipelineError


@dataclass(frozen=True)
class PlanOptions:
    data_parallel: DataParallel | None = None  # the batch-split axis and its gradient sync
    pipeline: Pipeline | None = None  # stages on a mesh axis
    split_before: tuple[str, ...] = ()  # module paths where a pipeline stage starts
    strict: bool = False  # an op without a rule on split inputs is an error, not a gather
    dynamic: bool = True  # batch and sequence dims exported as dynamic
    repeat_blocks: bool = True  # trace identical blocks two deep and copy the rest
    debug: bool = False  # ap.parallelize checks that every rank planned alike
    auto: object = None  # True or ap.Auto: the search chooses layouts (search/); None once done
    rng: str = "placement"  # dropout masks: "placement" or "serial" (runtime/rng.py)
    seed: int = 0  # every rank's dropout generator starts here

    def __post_init__(self):
        object.__setattr__(self, "data_parallel", DataParallel.of(self.data_parallel))
        object.__setattr__(self, "split_before", tuple(self.split_before))
        from autopar.runtime.rng import check_mode

        check_mode(self.rng)
        if self.pipeline is not None and not isinstance(self.pipeline, Pipeline):
            raise PipelineError(f"pipeline must be an ap.Pipeline, got {type(self.pipeline).__name__}.")
        if self.split_before and self.pipeline is None:
            raise PipelineError(
                f"split_before annotations ({', '.join(self.split_before)}) need a pipeline: "
                "pass pipeline=ap.Pipeline('pp', microbatches=...) to ap.plan."
            )

    @property
    def techniques(self) -> tuple:
        """The parallelism techniques in the order they apply (parallel/technique.py)."""
        return tuple(t for t in (self.data_parallel, self.pipeline) if t is not None)

    def replace(self, **changes) -> "PlanOptions":
        return dataclasses.replace(self, **changes)
