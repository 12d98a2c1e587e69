"""ap.plan and ap.parallelize: the two entry points (ap.compile: parallelize's deprecated name).

Example:
    >>> plan = ap.plan(model, mesh, args=(x,), annotations={"fc1": ap.colwise("tp")}, data_parallel="dp")
    >>> module = ap.parallelize(model, mesh, args=(x,), annotations=..., data_parallel="dp")  # torchrun
"""

from __future__ import annotations

import datetime
import warnings

import torch

from autopar.checkpoint.meta import meta_names
from autopar.errors import MeshError
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.parallel.pipeline.api import take_splits
from autopar.plan import Plan
from autopar.planner import make_plan
from autopar.runtime.fingerprint import exchange_fingerprints
from autopar.runtime.failures import install_excepthook


def plan(
    model: torch.nn.Module,
    mesh: Mesh,
    *,
    args=(),
    kwargs=None,
    annotations=None,
    data_parallel=None,
    pipeline=None,
    strict: bool = False,
    dynamic: bool = True,
    repeat_blocks: bool = True,
    debug: bool = False,
    auto=None,
    rng: str = "placement",
    seed: int | None = None,
) -> Plan:
    """Trace ``model`` at the example inputs and plan it on ``mesh``.

    ``annotations`` maps fnmatch patterns (module paths, parameter or input names) to
    ap.colwise / ap.rowwise / ap.replicated / ap.place / ap.vocab_parallel /
    ap.sequence_parallel / ap.opaque / ap.split_before. ``data_parallel`` names the axis the
    batch (dim 0 of every input) is split on, or is an ap.DataParallel with that axis and its
    options (buckets, ZeRO, local SGD, reduce dtype). ``pipeline`` is an ap.Pipeline.
    ``strict`` makes an op without a rule on a split input an error instead of a gathered,
    replicated fallback. ``debug`` makes ap.parallelize check that all ranks hold the same plan
    before the first collective. ``repeat_blocks`` traces a long list of identical blocks two
    deep and copies the rest (the same graph, much faster for deep models; see
    autopar/trace/repeat_blocks.py); False exports all. ``auto=True`` or ``auto=ap.Auto(...)``
    lets a solver choose what every mesh axis does and the annotations (see autopar/search/);
    ``annotations`` and ``data_parallel`` are then constraints. ``rng`` chooses how dropout
    masks are drawn (docs/randomness.md): "placement" (default: the same mask on every rank of an
    axis the tensor is replicated on, its own piece where split) or "serial" (every rank keeps its
    piece of the serial model's mask: equal to serial bit for bit once seeded alike with
    ap.manual_seed). ``seed`` starts every rank's dropout generator (default:
    torch.initial_seed(); ap.parallelize makes all ranks agree). The keyword arguments become one
    ``ap.PlanOptions`` (``plan.options``).
    """
    annotations, splits = take_splits(annotations)
    options = PlanOptions(
        data_parallel=data_parallel,
        pipeline=pipeline,
        split_before=splits,
        strict=strict,
        dynamic=dynamic,
        repeat_blocks=repeat_blocks,
        debug=debug,
        auto=auto if auto is not False else None,
        rng=rng,
        seed=torch.initial_seed() if seed is None else seed,
    )
    return make_plan(model, mesh, options, args=args, kwargs=kwargs, annotations=annotations)


def parallelize(model: torch.nn.Module, mesh: Mesh, *, timeout: float | None = None, **plan_kwargs) -> torch.nn.Module:
    """This rank's module for a torch.distributed job (world size must equal mesh.size).

    Every rank traces and plans the same way, makes the process groups of every mesh axis
    (in the same order everywhere), and broadcasts replicated parameters from the first
    rank of each group so that all ranks start equal. ``timeout`` (seconds) bounds every
    collective's wait: a rank that failed or died makes the others raise CollectiveError
    naming it instead of hanging (the process groups are made with it). It bounds parallelize's own
    parameter broadcasts too, where ranks that planned at different speeds meet: keep it above
    that skew (or change it afterwards: ``current_backend().timeout``, then enforced per
    collective, at some cost per call). ``debug=True`` checks first that all ranks planned alike.
    """
    import torch.distributed as dist
    from autopar.runtime.backend import install_backend
    from autopar.runtime.dist_backend import DistBackend

    if not dist.is_available() or not dist.is_initialized():
        raise MeshError(
            "ap.parallelize needs an initialised process group: call "
            "torch.distributed.init_process_group (torchrun sets the environment)."
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != mesh.size:
        raise MeshError(
            f"The world has {world} processes but the mesh {mesh} has {mesh.size} ranks: "
            f"launch {mesh.size} processes (torchrun --nproc-per-node {mesh.size}) or change the mesh."
        )
    p = plan(model, mesh, **plan_kwargs)
    # ranks that planned differently all raise here, before any collective (debug: every collective compared)
    exchange_fingerprints(p, timeout, p.module(rank) if p.options.debug else None)
    mesh = p.mesh  # the mesh planned on (two-axis HSDP makes its axes one, with the same ranks)
    groups = {}
    # With a timeout, every group (the whole world's too) is made with it, so that blocking
    # collectives are bounded by the group itself (see DistBackend._run).
    group_kw = {"timeout": datetime.timedelta(seconds=timeout)} if timeout is not None else {}
    for axis in range(mesh.ndim):
        for g in mesh.groups(axis):
            if g not in groups:
                groups[g] = dist.new_group(list(g), **group_kw) if len(g) < world or group_kw else dist.group.WORLD
    for technique in p.options.techniques:  # e.g. HSDP's shard and replica groups
        for g in technique.process_groups(p):
            if g not in groups:
                groups[g] = dist.new_group(list(g), **group_kw)
    backend = DistBackend(groups, rank, timeout, groups_timeout=timeout)
    install_backend(backend)
    install_excepthook(rank)
    module = p.module(rank)
    unset = meta_names(model)  # built on the meta device: nothing to broadcast, ap.load_pretrained fills them
    with torch.no_grad():
        for name, param in list(module.named_parameters()) + list(module.named_buffers()):
            if name in unset:
                continue
            spec = p.param_specs.get(name)
            split = {a for t in p.options.techniques for a in t.stored_axes(p, name)}  # pieces differ there
            for axis in range(mesh.ndim):
                if (spec is None or spec[axis].is_replicate()) and axis not in split:
                    backend.broadcast(param.data, mesh.group(axis, rank), rank)
    module.autopar_plan = p
    return module


def compile(model: torch.nn.Module, mesh: Mesh, **kwargs) -> torch.nn.Module:
    """Deprecated: ap.compile, the old name of ap.parallelize (it shadowed the builtin and meant something
    other than torch.compile)."""
    warnings.warn("ap.compile is deprecated: call ap.parallelize (same arguments).", DeprecationWarning, stacklevel=2)
    return parallelize(model, mesh, **kwargs)
