"""One set-up of a torch.distributed job for every kind of rank program: the process groups,
the backend over them, and the replicated parameters made equal (ap.parallelize for rank
modules, plan.pipeline_runner for pipeline ranks).

Every rank makes, in the same order, one group per mesh-axis group, one per group a technique
asks for (``Technique.process_groups``: HSDP's shard and replica groups, the ranks sharing a
weight tied across pipeline stages), and on request a world group for point-to-point messages;
then installs a DistBackend over them. With a timeout every group is made with it, so blocking
collectives are bounded by the group itself (runtime/dist_backend.py).

Example:
    >>> make_groups(plan, rank, timeout=60)            # in a torchrun job, on every rank
    >>> broadcast_replicated(plan, rank, module.named_parameters())
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from autopar.placement import Shard
from autopar.runtime.backend import current_backend, install_backend
from autopar.runtime.dist_backend import DistBackend
from autopar.runtime.failures import install_excepthook
from autopar.trace.meta_device import meta_names


def wants_distributed(plan, rank: int) -> bool:
    """Whether this process is ``rank`` of an initialised job of the plan's size."""
    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() == plan.mesh.size
        and dist.get_rank() == rank
    )


def make_groups(plan, rank: int, timeout: float | None = None, p2p: bool = False):
    """Make every group the plan's collectives use and install the backend; returns the world
    group for point-to-point messages when ``p2p`` (a pipeline's), else None."""
    world = dist.get_world_size()
    kw = {"timeout": datetime.timedelta(seconds=timeout)} if timeout is not None else {}
    groups = {g: dist.new_group(list(g), **kw) if len(g) < world or kw else dist.group.WORLD for g in plan_groups(plan)}
    p2p_group = dist.new_group(list(range(world)), **kw) if p2p else None
    install_backend(DistBackend(groups, rank, timeout, groups_timeout=timeout))
    install_excepthook(rank)
    return p2p_group


def plan_groups(plan) -> list[tuple]:
    """Every group of ranks the plan's collectives use, in the order every rank makes them: the
    mesh axes' groups, those of the axes' parts that split a tensor, the techniques' own."""
    mesh, groups = plan.mesh, {}
    for axis in list(range(mesh.ndim)) + split_parts(plan):  # parts: their groups and their replicas
        groups.update((tuple(g), None) for g in mesh.groups(axis))
    for technique in plan.options.techniques:  # HSDP's groups, tied weights across stages, ...
        groups.update((tuple(g), None) for g in technique.process_groups(plan))
    return list(groups)


def split_parts(plan) -> list:
    """The SubAxes the plan's collectives use: for every parameter split on a part of an axis
    (Shard.within / across: experts over one of two merged data-parallel axes), both parts: the
    groups that split it (its dispatch) and its replica groups (its gradient sync)."""
    found = {
        (a, p.grouped)
        for spec in plan.param_specs.values()
        for a, p in enumerate(spec)
        if isinstance(p, Shard) and p.grouped
    }
    return [plan.mesh.part(a, k, part) for a, k in sorted(found) for part in ("inner", "outer")]


def broadcast_replicated(plan, rank: int, named_tensors, skip_axes=()) -> None:
    """Start equal: each tensor replicated on an axis (and not stored in pieces there by a
    technique) from the first rank of its group on that axis. Tensors of a model built on the
    meta device are skipped: ap.load_pretrained fills them."""
    backend, mesh, unset = current_backend(), plan.mesh, meta_names(plan.model)
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name in unset:
                continue
            spec = plan.param_specs.get(name)
            split = {a for t in plan.options.techniques for a in t.stored_axes(plan, name)}  # pieces differ
            for axis in range(mesh.ndim):
                if axis not in skip_axes and (spec is None or spec[axis].is_replicate()) and axis not in split:
                    backend.broadcast(tensor.data, mesh.group(axis, rank), rank)
