"""ap.plan and ap.parallelize: the two entry points (ap.compile: parallelize's deprecated name).

Example:
    >>> plan = ap.plan(model, mesh, args=(x,), annotations={"fc1": ap.colwise("tp")}, data_parallel="dp")
    >>> module = ap.parallelize(model, mesh, args=(x,), annotations=..., data_parallel="dp")  # torchrun
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist

from autopar.errors import MeshError
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.parallel import TECHNIQUES
from autopar.parallel.process_groups import broadcast_replicated, make_groups
from autopar.plan import Plan
from autopar.planner import make_plan
from autopar.runtime.fingerprint import exchange_fingerprints
from autopar.search import Auto


def plan(
    model: torch.nn.Module,
    mesh: Mesh,
    *,
    args=(),
    kwargs=None,
    annotations=None,
    strict: bool = False,
    dynamic: bool = True,
    repeat_blocks: bool = True,
    debug: bool = False,
    auto=None,
    rng: str = "placement",
    seed: int | None = None,
    **techniques,
) -> Plan:
    """Trace ``model`` at the example inputs and plan it on ``mesh``.

    ``annotations`` maps fnmatch patterns (module paths, parameter or input names) to
    ap.colwise / ap.rowwise / ap.replicated / ap.place / ap.vocab_parallel /
    ap.sequence_parallel / ap.opaque / ap.split_before. Each parallelism technique is a keyword
    of its registered name (autopar.parallel.TECHNIQUES): ``data_parallel`` names the axis the
    batch (dim 0 of every input) is split on, or is an ap.DataParallel with that axis and its
    options (buckets, ZeRO 1-3, HSDP, local SGD, precision); ``pipeline`` is an ap.Pipeline.
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
    annotations, fields = dict(annotations or {}), {}
    for cls in TECHNIQUES.values():  # annotations that belong to a technique (ap.split_before())
        annotations, more = cls.take_annotations(annotations)
        fields.update(more)
    options = PlanOptions(
        strict=strict,
        dynamic=dynamic,
        repeat_blocks=repeat_blocks,
        debug=debug,
        auto=auto if auto is not False else None,
        rng=rng,
        seed=torch.initial_seed() if seed is None else seed,
        **fields,
        **techniques,
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
    ``auto=`` searches without pipeline stages here (a rank module comes back, not a pipeline
    runner: plan with ap.plan and use plan.pipeline_runner for those)."""
    if not dist.is_available() or not dist.is_initialized():
        raise MeshError(
            "ap.parallelize needs an initialised process group: call "
            "torch.distributed.init_process_group (torchrun sets the environment)."
        )
    if plan_kwargs.get("auto") not in (None, False):  # a module comes back, not a pipeline runner
        plan_kwargs["auto"] = dataclasses.replace(Auto.of(plan_kwargs["auto"]), pipeline=False)
    p = plan(model, mesh, **plan_kwargs)
    # a technique that runs the mesh as several jobs (fault tolerance: one per replica group) joins its own
    joined = next((j for t in p.options.techniques if (j := t.join(p, timeout)) is not None), None)
    rank, skip = joined if joined is not None else (dist.get_rank(), ())
    if joined is None and dist.get_world_size() != mesh.size:
        raise MeshError(
            f"The world has {dist.get_world_size()} processes but the mesh {mesh} has {mesh.size} ranks: "
            f"launch {mesh.size} processes (torchrun --nproc-per-node {mesh.size}) or change the mesh."
        )
    # ranks that planned differently all raise here, before any collective (debug: every collective compared)
    exchange_fingerprints(p, timeout, p.module(rank) if p.options.debug else None)
    if joined is None:
        make_groups(p, rank, timeout)  # the mesh planned on (two-axis HSDP: one axis, the same ranks)
    module = p.module(rank)
    broadcast_replicated(p, rank, list(module.named_parameters()) + list(module.named_buffers()), skip)
    module.autopar_plan = p
    return module


def compile(model: torch.nn.Module, mesh: Mesh, **kwargs) -> torch.nn.Module:
    """Deprecated: ap.compile, the old name of ap.parallelize (it shadowed the builtin and meant something
    other than torch.compile)."""
    warnings.warn("ap.compile is deprecated: call ap.parallelize (same arguments).", DeprecationWarning, stacklevel=2)
    return parallelize(model, mesh, **kwargs)
