"""The pipeline's entry points from ap.plan and Plan (kept here so the core files stay thin).

Example:
    >>> plan = ap.plan(model, mesh, args=(x,), pipeline=ap.Pipeline("pp", microbatches=4))
    >>> runner = plan.pipeline_runner(rank)
"""
from __future__ import annotations

import copy

from autopar.placement import Replicate
from autopar.parallel.pipeline.options import Pipeline, PipelineError, SplitBefore
from autopar.parallel.pipeline.split import split_stages


def take_splits(annotations: dict | None) -> tuple[dict | None, list[str]]:
    """Separate ``ap.split_before()`` annotations from the layout annotations."""
    if not annotations:
        return annotations, []
    splits = [k for k, v in annotations.items() if isinstance(v, SplitBefore)]
    rest = {k: v for k, v in annotations.items() if not isinstance(v, SplitBefore)}
    return rest, splits


def check_options(pipeline, mesh, data_parallel, annotations, splits) -> None:
    if pipeline is None:
        if splits:
            raise PipelineError(f"split_before annotations ({', '.join(splits)}) need a pipeline: pass "
                                "pipeline=ap.Pipeline('pp', microbatches=...) to ap.plan.")
        return
    if not isinstance(pipeline, Pipeline):
        raise PipelineError(f"pipeline must be an ap.Pipeline, got {type(pipeline).__name__}.")
    mesh.axis_index(pipeline.axis)
    if data_parallel == pipeline.axis:
        raise PipelineError(f"Axis {pipeline.axis!r} cannot be both the pipeline and the data-parallel axis: "
                            "add a separate 'dp' axis to the mesh.")
    for pattern, ann in (annotations or {}).items():
        if getattr(ann, "axis", None) == pipeline.axis:
            raise PipelineError(f"Annotation {pattern!r}: {ann!r} splits tensors on the pipeline axis "
                                f"{pipeline.axis!r}, which only holds stages. Use another mesh axis (tp).")


def attach(plan, pipeline: Pipeline, splits: list[str]) -> None:
    """Check that nothing is split on the pipeline axis, then cut the graph into stages."""
    axis = plan.mesh.axis_index(pipeline.axis)
    for node in plan.graph.nodes:
        lay = node.meta.get("autopar")
        for spec in (lay.outputs if lay is not None else []):
            if spec is not None and not isinstance(spec[axis], Replicate):
                raise PipelineError(f"Node {node.name!r} was laid out {spec[axis]!r} on the pipeline axis "
                                    f"{pipeline.axis!r}; the pipeline axis must stay replicated.")
    plan.stage_layout = split_stages(plan.traced, plan.mesh, pipeline, splits)
    from autopar.parallel.pipeline.timeline import slots
    slots(plan)  # the schedule is valid for these sizes and cannot deadlock (raises if not)


def require_pipeline(plan):
    if plan.stage_layout is None:
        raise PipelineError("This plan has no pipeline: pass pipeline=ap.Pipeline(...) to ap.plan.")
    return plan


def pipeline_runner(plan, rank: int, distributed: bool | None = None, **kwargs):
    """A PipelineRunner; in a torch.distributed job of the mesh's size (or with
    ``distributed=True``) its process groups are made and parameters broadcast first."""
    from autopar.parallel.pipeline import dist_setup
    from autopar.parallel.pipeline.runner import PipelineRunner
    require_pipeline(plan)
    if distributed is None:
        distributed = dist_setup.wants_distributed(plan, rank)
    if not distributed:
        return PipelineRunner(plan, rank, **kwargs)
    group = dist_setup.setup(plan, rank)
    runner = PipelineRunner(plan, rank, p2p_group=group, **kwargs)
    dist_setup.broadcast_replicated(runner)
    return runner


def with_pipeline(plan, pipeline: Pipeline, split_before=()):
    """The same plan (same trace and layouts) with other pipeline options, without tracing again.

    Example:
        >>> gpipe = with_pipeline(plan, ap.Pipeline("pp", microbatches=8, schedule="gpipe"))
    """
    check_options(pipeline, plan.mesh, plan.mesh.axis_names[plan.dp_axis] if plan.dp_axis is not None else None,
                  {}, list(split_before))
    new = copy.copy(plan)
    new._modules = {}
    attach(new, pipeline, list(split_before))
    return new
