"""The pipeline technique's work for the planner and the Plan: checking the options, cutting the
graph into stages, the runner of a rank (with its process groups in a distributed job), plan
variants with other pipeline options, and the stages' pieces put together for merging.

Example:
    >>> plan = ap.plan(model, mesh, args=(x,), pipeline=ap.Pipeline("pp", microbatches=4))
    >>> runner = plan.pipeline_runner(rank)
"""

from __future__ import annotations

import torch

from autopar.errors import InputError, PipelineError
from autopar.parallel.pipeline import schedules
from autopar.parallel.pipeline.runner import PipelineRunner, loss_group
from autopar.parallel.pipeline.split import split_stages
from autopar.parallel.process_groups import broadcast_replicated, make_groups, wants_distributed
from autopar.placement import Replicate
from autopar.runtime.backend import current_backend


def check_options(pipeline, mesh, data_parallel, annotations) -> None:
    """The pipeline axis exists, is not the data-parallel axis, and no annotation splits on it."""
    mesh.axis_index(pipeline.axis)
    if pipeline.schedule == "dualpipev":  # its phases need m >= 2pp (schedules.dualpipev): say so before tracing
        schedules.dualpipev(mesh.axis_size(pipeline.axis), pipeline.microbatches, 0)
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


def stage_layout(plan, pipeline, splits: list[str]):
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


def tied_rank_groups(plan) -> list[tuple[int, ...]]:
    """Every group of ranks that holds one tied weight on several pipeline ranks."""
    lay, mesh = plan.stage_layout, plan.mesh
    out = set()
    for names in plan.traced.tied.values():
        holders = sorted(
            {lay.rank_of_stage(st.index) for st in lay.stages for ph in st.attrs if plan.attr_name(ph) in names}
        )
        if len(holders) < 2:
            continue
        for r in mesh.ranks():
            c = list(mesh.coords(r))
            group = []
            for h in holders:
                c[lay.axis] = h
                group.append(mesh.rank_of(c))
            out.add(tuple(group))
    return sorted(out)


def loss_rank_groups(plan) -> list[tuple[int, ...]]:
    """The pp x dp groups the runners reduce the step's loss over in one all-reduce (runner.py
    ``loss_group``); none without a dp axis (the pp axis's groups serve)."""
    if plan.dp_axis is None:
        return []
    return sorted({loss_group(plan, r) for r in plan.mesh.ranks()})


def pipeline_runner(plan, rank: int, distributed: bool | None = None, **kwargs):
    """A PipelineRunner; in a torch.distributed job of the mesh's size (or with
    ``distributed=True``) its process groups are made and parameters broadcast first (the same
    set-up as ap.parallelize's, parallel/process_groups.py), and a world group kept for its
    point-to-point messages."""
    require_pipeline(plan)
    if distributed is None:
        distributed = wants_distributed(plan, rank)
    if not distributed:
        return PipelineRunner(plan, rank, **kwargs)
    p2p = make_groups(plan, rank, p2p=True)
    runner = PipelineRunner(plan, rank, p2p_group=p2p, **kwargs)
    broadcast_replicated(plan, rank, runner.named_parameters(), skip_axes=(plan.stage_layout.axis,))
    with torch.no_grad():
        for p, group in runner.tied_groups:  # a tied weight starts as the first stage's copy
            current_backend().broadcast(p.data, group, rank)
    return runner


def with_pipeline(plan, pipeline, split_before=()):
    """The same plan (same trace and layouts) with other pipeline options, without tracing again.

    Example:
        >>> gpipe = with_pipeline(plan, ap.Pipeline("pp", microbatches=8, schedule="gpipe"))
    """
    return plan.with_options(plan.options.replace(pipeline=pipeline, split_before=tuple(split_before)))


def restored(plan, per_rank: list[dict]) -> list[dict]:
    """Every rank's dict completed with what the other pipeline ranks hold at its other coordinates
    (plan.merge_state_dicts reads each name from every rank): a stage's parameters (or their
    gradients) live on its ranks only, and a weight tied across stages is named by each stage's
    runner as its own holder names it (``lm_head.weight`` on the last stage, the serial
    ``transformer.wte.weight`` on the first). The result holds every name any rank gave, in the
    plan's order, a tied weight under each of them.

    Example (pp=2, nanoGPT's tied head):
        >>> restored(plan, [{"transformer.wte.weight": w0, ...}, {"lm_head.weight": w1, ...}])
        [{"transformer.wte.weight": w0, "lm_head.weight": w0, ...}, {... the same names ...}]
    """
    mesh, axis = plan.mesh, plan.stage_layout.axis
    tied = {n: names for names in plan.traced.tied.values() for n in names}
    order = {k: i for i, k in enumerate(plan.param_specs)}
    wanted = sorted(dict.fromkeys(k for d in per_rank for k in d), key=lambda k: order.get(k, len(order)))
    out = []
    for rank in mesh.ranks():
        coords = list(mesh.coords(rank))
        peers = [coords[axis]] + [k for k in range(mesh.shape[axis]) if k != coords[axis]]  # its own first
        held = [per_rank[mesh.rank_of(coords[:axis] + [k] + coords[axis + 1 :])] for k in peers]
        out.append({key: _held_piece(held, key, tied.get(key, (key,)), rank) for key in wanted})
    return out


def _held_piece(held: list[dict], key: str, names, rank: int):
    """The first piece of ``key`` (under any of its tied ``names``) in ``held``; None where every
    holder gives None (a gradient not computed)."""
    found = False
    for d in held:
        for n in (key, *names):
            if n in d:
                found = True
                if d[n] is not None:
                    return d[n]
    if not found:
        raise InputError(
            f"merge_state_dicts: no pipeline rank at rank {rank}'s other coordinates gave {key!r}; "
            "pass every rank's dict (runner.named_parameters() or runner.params of each rank)."
        )
    return None
