"""Pipeline parallelism on a mesh axis: stages from the traced graph, schedules, a runner.

Example:
    >>> plan = ap.plan(model, ap.Mesh((4,), ("pp",)), args=(idx, tg),
    ...                pipeline=ap.Pipeline("pp", microbatches=8, schedule="1f1b"))
    >>> print(plan.schedule_table(0))
    >>> runner = plan.pipeline_runner(rank)          # under torch.distributed or plan.simulate
    >>> loss = runner.step((idx, tg)); opt.step()
"""

from autopar.parallel.pipeline.api import with_pipeline
from autopar.parallel.pipeline.options import Pipeline, PipelineError, SplitBefore, split_before

__all__ = ["Pipeline", "PipelineError", "SplitBefore", "split_before", "with_pipeline"]
