"""ap.plan and ap.compile: the two entry points.

Example:
    >>> plan = ap.plan(model, mesh, args=(x,), annotations={"fc1": ap.colwise("tp")}, data_parallel="dp")
    >>> module = ap.compile(model, mesh, args=(x,), annotations=..., data_parallel="dp")  # under torchrun
"""
from __future__ import annotations

import datetime

import torch
import torch.utils._pytree as pytree

from autopar.sharding.annotations import replicate, resolve
from autopar.checkpoint.meta import input_device, meta_names, retarget_meta_device
from autopar.parallel.data_parallel import DataParallel
from autopar.errors import AnnotationError, MeshError
from autopar.sharding.gradient_flow import analyse
from autopar.runtime.consistency import verify_consistent
from autopar.runtime.failures import install_excepthook
from autopar.mesh import Mesh
from autopar.trace.opaque import keep_opaque, opaque, opaque_paths
from autopar.plan import Plan
from autopar.sharding.propagate import propagate
from autopar.trace.export import trace
from autopar.parallel.pipeline import api as pipeline_api


def plan(model: torch.nn.Module, mesh: Mesh, *, args=(), kwargs=None, annotations=None,
         data_parallel=None, strict: bool = False, dynamic: bool = True, repeat_blocks: bool = True,
         bucket_mb: float = 25.0, bucket_max_params: int | None = None, pipeline=None,
         debug: bool = False) -> Plan:
    """Trace ``model`` at the example inputs and plan it on ``mesh``.

    ``annotations`` maps fnmatch patterns (module paths, parameter or input names) to
    ap.colwise / ap.rowwise / ap.replicate / ap.place. ``data_parallel`` names the axis the
    batch (dim 0 of every input) is split on, or is an ap.DataParallel with that axis and its
    options (buckets, ZeRO, local SGD, reduce dtype); ``bucket_mb`` / ``bucket_max_params``
    apply when it is a plain name. ``strict`` makes an op without a rule on a
    split input an error instead of a gathered, replicated fallback. ``debug`` makes
    ap.compile check that all ranks hold the same plan before the first collective.
    ``repeat_blocks`` traces a long list of identical blocks two deep and copies the rest
    (the same graph, much faster for deep models; see autopar/trace/repeat_blocks.py); False exports all.
    """
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be an ap.Mesh, got {type(mesh).__name__}.")
    args = args if isinstance(args, tuple) else (args,)
    dp = DataParallel.of(data_parallel, bucket_mb, bucket_max_params)
    data_parallel = dp.axis if dp is not None else None
    annotations, splits = pipeline_api.take_splits(annotations)
    pipeline_api.check_options(pipeline, mesh, data_parallel, annotations, splits)
    dp_axis = mesh.axis_index(data_parallel) if data_parallel is not None else None
    for ann in (annotations or {}).values():
        if hasattr(ann, "axis"):
            mesh.axis_index(ann.axis)
    keep = opaque_paths(annotations, model)  # ap.opaque(): traced as one replicated op each
    annotations = {p: (replicate() if isinstance(a, opaque) else a) for p, a in (annotations or {}).items()}
    with keep_opaque(model, keep, args, kwargs or {}):
        traced = trace(model, args, kwargs, dynamic=dynamic, repeat_blocks=repeat_blocks)
    if meta_names(model):  # a meta-device model: its rank modules run where the inputs are
        traced.materialize_device = input_device(args, kwargs)
        if traced.materialize_device is not None:
            retarget_meta_device(traced.gm.graph, traced.materialize_device)
    ndims = _input_ndims(traced, args, kwargs)
    seeds = resolve(annotations, model, mesh, traced.user_inputs, data_parallel, ndims)
    _unify_tied(seeds, traced)
    ctx = propagate(traced, mesh, seeds, strict)
    flow = analyse(traced.gm.graph, mesh, ctx.needs_grad, ctx.param_derived, ctx.param_nodes)
    options = {"bucket_bytes": int(bucket_mb * 2**20), "bucket_max_params": bucket_max_params,
               "strict": strict, "data_parallel": dp, "debug": debug}
    result = Plan(model, mesh, traced, seeds, flow, ctx, dp_axis, options)
    if pipeline is not None:
        pipeline_api.attach(result, pipeline, splits)
    return result


def _input_ndims(traced, args, kwargs) -> dict:
    flat = pytree.tree_leaves((args, kwargs or {}))
    return {name: (v.dim() if isinstance(v, torch.Tensor) else 0) for name, v in zip(traced.user_inputs, flat)}


def _unify_tied(seeds, traced) -> None:
    """Tied parameters are one tensor: they get one layout, whichever name was annotated."""
    for names in traced.tied.values():
        given = {n: seeds.params[n] for n in names if n in seeds.params}
        if len(set(given.values())) > 1:
            raise AnnotationError(f"Tied parameters {names} share one tensor but were annotated "
                                  f"differently: {given}. Annotate them alike (or only one of them).")
        if given:
            spec = next(iter(given.values()))
            for n in names:
                seeds.params[n] = spec


def compile(model: torch.nn.Module, mesh: Mesh, *, timeout: float | None = None,
            **plan_kwargs) -> torch.nn.Module:
    """This rank's module for a torch.distributed job (world size must equal mesh.size).

    Every rank traces and plans the same way, makes the process groups of every mesh axis
    (in the same order everywhere), and broadcasts replicated parameters from the first
    rank of each group so that all ranks start equal. ``timeout`` (seconds) bounds every
    collective's wait: a rank that failed or died makes the others raise CollectiveError
    naming it instead of hanging (the process groups are made with it). It bounds compile's own
    parameter broadcasts too, where ranks that planned at different speeds meet: keep it above
    that skew (or change it after compile: ``current_backend().timeout``, then enforced per
    collective, at some cost per call). ``debug=True`` checks first that all ranks planned alike.
    """
    import torch.distributed as dist
    from autopar.runtime.collectives import DistBackend, install_backend
    if not dist.is_available() or not dist.is_initialized():
        raise MeshError("ap.compile needs an initialised process group: call "
                        "torch.distributed.init_process_group (torchrun sets the environment).")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != mesh.size:
        raise MeshError(f"The world has {world} processes but the mesh {mesh} has {mesh.size} ranks: "
                        f"launch {mesh.size} processes (torchrun --nproc-per-node {mesh.size}) or change the mesh.")
    p = plan(model, mesh, **plan_kwargs)
    groups = {}
    # With a timeout, every group (the whole world's too) is made with it, so that blocking
    # collectives are bounded by the group itself (see DistBackend._run).
    group_kw = {"timeout": datetime.timedelta(seconds=timeout)} if timeout is not None else {}
    for axis in range(mesh.ndim):
        for g in mesh.groups(axis):
            if g not in groups:
                groups[g] = dist.new_group(list(g), **group_kw) if len(g) < world or group_kw else dist.group.WORLD
    backend = DistBackend(groups, rank, timeout, groups_timeout=timeout)
    install_backend(backend)
    install_excepthook(rank)
    module = p.module(rank)
    if p.options.get("debug"):
        verify_consistent(p, module, timeout)
    unset = meta_names(model)  # built on the meta device: nothing to broadcast, ap.load_pretrained fills them
    with torch.no_grad():
        for name, param in list(module.named_parameters()) + list(module.named_buffers()):
            if name in unset:
                continue
            spec = p.param_specs.get(name)
            for axis in range(mesh.ndim):
                if spec is None or spec[axis].is_replicate():
                    backend.broadcast(param.data, mesh.group(axis, rank), rank)
    module.autopar_plan = p
    return module
