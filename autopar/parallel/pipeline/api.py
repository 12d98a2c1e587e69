"""The pipeline's entry points from ap.plan and Plan (kept here so the core files stay thin).

Example:
    >>> plan = ap.plan(model, mesh, args=(x,), pipeline=ap.Pipeline("pp", microbatches=4))
    >>> runner = plan.pipeline_runner(rank)
"""

from __future__ import annotations

from autopar.placement import Replicate
from autopar.parallel.pipeline.options import Pipeline, PipelineError, SplitBefore
from autopar.parallel.pipeline import schedules
from autopar.parallel.pipeline.split import split_stages


def take_splits(annotations: dict | None) -> tuple[dict | None, list[str]]:
    """Separate ``ap.split_before()`` annotations from the layout annotations."""
    if not annotations:
        return annotations, []
    splits = [k for k, v in annotations.items() if isinstance(v, SplitBefore)]
    rest = {k: v for k, v in annotations.items() if not isinstance(v, SplitBefore)}
    return rest, splits


def check_options(pipeline: Pipeline, mesh, data_parallel, annotations) -> None:
    """The pipeline axis exists, is not the data-parallel axis, and no annotation splits on it."""
    mesh.axis_index(pipeline.axis)
    if data_parallel == pipeline.axis:
        raise PipelineError(
            f"Axis {pipeline.axis!r} cannot be both the pipeline and the data-parallel axis: "
            "add a separate 'dp' axis to the mesh."
        )
    for pattern, ann in (annotations or {}).items():
        if getattr(ann, "axis", None) == pipeline.axis:
            raise PipelineError(
                f"Annotation {pattern!r}: {ann!r} splits tensors on the pipeline axis "
                f"{pipeline.axis!r}, which only holds stages. Use another mesh axis (tp)."
            )


def stage_layout(plan, pipeline: Pipeline, splits: list[str]):
    """Check that nothing is split on the pipeline axis, then cut the graph into stages."""
    axis = plan.mesh.axis_index(pipeline.axis)
    for node in plan.graph.nodes:
        lay = node.meta.get("autopar")
        for spec in lay.outputs if lay is not None else []:
            if spec is not None and not isinstance(spec[axis], Replicate):
                raise PipelineError(
                    f"Node {node.name!r} was laid out {spec[axis]!r} on the pipeline axis "
                    f"{pipeline.axis!r}; the pipeline axis must stay replicated."
                )
    layout = split_stages(plan.traced, plan.mesh, pipeline, splits)
    o = layout.options  # the schedule is valid for these sizes and cannot deadlock (raises if not):
    schedules.replay(schedules.build(o.kind, layout.pp, o.microbatches, o.chunks), layout.n_stages)
    return layout


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
    from autopar.planner import with_options

    return with_options(plan, plan.options.replace(pipeline=pipeline, split_before=tuple(split_before)))
