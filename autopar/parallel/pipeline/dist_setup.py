"""Process groups for a pipelined plan in a torch.distributed job (gloo on CPU, NCCL on GPU).

Every rank calls ``pipeline_runner(rank)`` at the same point; it makes, in the same order
everywhere, one group per mesh-axis group (the stages' tp/dp collectives, the loss
reduction over pp), one per set of ranks sharing a tied weight, and one world group kept
for point-to-point messages, then installs a DistBackend over them and broadcasts each
replicated parameter from the first rank of each of its non-pipeline groups.

Example:
    >>> runner = plan.pipeline_runner(dist.get_rank())   # inside torchrun / a GlooPool job
"""

from __future__ import annotations

from autopar.runtime.backend import install_backend
from autopar.runtime.dist_backend import DistBackend


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


def wants_distributed(plan, rank: int) -> bool:
    import torch.distributed as dist

    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() == plan.mesh.size
        and dist.get_rank() == rank
    )


def setup(plan, rank: int):
    """Make the groups, install the backend; returns the point-to-point group."""
    import torch.distributed as dist

    mesh, world = plan.mesh, dist.get_world_size()
    groups = {}
    for axis in range(mesh.ndim):
        for g in mesh.groups(axis):
            groups[g] = dist.new_group(list(g)) if len(g) < world else dist.group.WORLD
    extra = [g for t in plan.options.techniques for g in t.process_groups(plan)]  # e.g. HSDP's groups
    for g in list(tied_rank_groups(plan)) + extra:
        if g not in groups:
            groups[g] = dist.new_group(list(g)) if len(g) < world else dist.group.WORLD
    p2p = dist.new_group(list(range(world)))
    install_backend(DistBackend(groups, rank))
    return p2p


def broadcast_replicated(runner) -> None:
    """Start equal: replicated parameters from the first rank of each non-pipeline group."""
    import torch
    from autopar.runtime.backend import current_backend

    plan, rank = runner.plan, runner.rank
    backend = current_backend()
    with torch.no_grad():
        for axis in range(plan.mesh.ndim):
            if axis == plan.stage_layout.axis:
                continue
            for name, p in runner.named_parameters():
                spec = plan.param_specs.get(name)
                split = {a for t in plan.options.techniques for a in t.stored_axes(plan, name)}  # pieces differ
                if (spec is None or spec[axis].is_replicate()) and axis not in split:
                    backend.broadcast(p.data, plan.mesh.group(axis, rank), rank)
        for p, group in runner.tied_groups:  # a tied weight starts as the first stage's copy
            backend.broadcast(p.data, group, rank)
