"""Plan: the result of planning, and what you do with it.

A Plan holds the traced graph with a layout on every node, the gradient flow, the specs of
every parameter, input and output, and the techniques' options. From it come each rank's
module, each rank's slice of a batch, conversions between serial and per-rank state dicts,
the in-process simulation of all ranks, and the check against the serial model. It delegates
the rest: display, costs and plan files to explore/ (``PlanViews``), and each technique's own
methods to the technique (``plan.pipeline_runner``, ``plan.grad_buckets``, ...: registered by
the technique in parallel/, found by name).

Example:
    >>> plan = ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), args=(x,), annotations=..., data_parallel="dp")
    >>> print(plan)
    >>> gm = plan.module(3)
    >>> args, kwargs = plan.local_inputs(3, x)
    >>> plan.check(x)                      # raises ap.PlanMismatch if any rank disagrees with serial
"""

from __future__ import annotations

import contextlib
import gc
import types
from functools import cached_property

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.codegen.device_args import bind_device
from autopar.codegen.emit import emit_graph
from autopar.codegen.program import Program
from autopar.codegen.rank_module import build_rank_module, tensor_slots
from autopar.codegen.rank_state import merge_states, shard_state
from autopar.dryrun.run import dry_run
from autopar.errors import DataParallelError, InputError, PlanError
from autopar.mesh import SubAxis
from autopar.explore.plan_views import PlanViews
from autopar.parallel import dp_module
from autopar.parallel.grad_scaler import mark_rank_params
from autopar.parallel.optimizer import mark_pieces
from autopar.parallel.registry import TECHNIQUES, plan_method, plan_method_names
from autopar.parallel.technique import Technique
from autopar.placement import Partial, Replicate, Shard, merge_tensors, shard_tensor
from autopar.runtime.serial_check import check_plan, default_tolerances
from autopar.runtime.simulator import run_ranks
from autopar.sharding.propagate import is_ragged, layout_of
from autopar.sharding.lowerings.base import check_lowerings
from autopar.sharding.piece_order import piece_orders
from autopar.sharding.ragged import check_ragged
from autopar.trace.model_members import named_parameters

R = Replicate()


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector off for a block that makes many objects and no garbage."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Plan(PlanViews):
    """Made by planner.make_plan (ap.plan, ap.load_plan); ``layouts`` is planner.Layouts
    (seeds, every node's layout, gradient flow), ``options`` an ap.PlanOptions."""

    def __init__(self, model, mesh, traced, layouts, options):
        self.model, self.mesh, self.traced = model, mesh, traced
        self.layouts, self.options = layouts, options
        self.seeds, self.ctx, self.flow = layouts.seeds, layouts.ctx, layouts.flow
        dp = options.data_parallel
        self.dp_axis = mesh.axis_index(dp.axis) if dp is not None and dp.axis is not None else None
        self.built: dict[str, object] = {}  # technique name -> what its after_plan built
        self._modules: dict[int, fx.GraphModule] = {}

    def finish(self) -> "Plan":
        """Refuse what a ragged batch cannot do (sharding/ragged.py), then let each technique build
        its structure over the layouts (``Technique.after_plan``)."""
        check_ragged(self.graph, self.mesh, self.ragged, self.output_target, self.options.rng == "serial")
        check_lowerings(self.graph)  # what a lowering cannot emit is refused now, not in plan.module()
        for technique in self.options.techniques:
            built = technique.after_plan(self)
            if built is not None:
                self.built[technique.name] = built
        return self

    def with_options(self, options) -> "Plan":
        """The same trace and layouts under other technique options (no tracing, no propagation).
        The data-parallel axis shapes the layouts, so it cannot change here. A precision policy
        of another compute dtype traces the model again in it (parallel/data_parallel/precision.py), with the
        same layouts (the plan's seeds).

        Example: ``plan.with_options(plan.options.replace(data_parallel=ap.DataParallel("dp", zero=2)))``
        """
        old, new = self.options.data_parallel, options.data_parallel
        if (old and old.axis) != (new and new.axis):
            raise DataParallelError(
                f"{new}: the plan's data-parallel axis is {old and old.axis!r}; the batch "
                "split shapes every layout, so plan again (ap.plan) to change the axis."
            )
        for name, cls in TECHNIQUES.items():  # one that stands for annotations (expert parallel) shaped the seeds
            was, now = getattr(self.options, name), getattr(options, name)
            if cls.annotate is not Technique.annotate and was != now:
                raise PlanError(
                    f"{name}={now!r}: the plan was made with {was!r}, which stands for layout annotations; "
                    "with_options keeps the layouts, so plan again (ap.plan) to change it."
                )
        for technique in options.techniques:
            technique.validate(self.mesh, options, {})
        if options.compute_dtype != self.traced.dtype:  # the program is traced in its compute dtype
            return self.traced.replan(options, self.layouts.seeds)
        plan = Plan(self.model, self.mesh, self.traced, self.layouts, options).finish()
        if "auto" in self.built:
            plan.built["auto"] = self.built["auto"]
        return plan

    def with_exact_gradients(self) -> "Plan":
        """The plan plan.check runs: each technique's exact variant (``Technique.exact``: fp32
        gradient sums, no optimizer sharding), or this plan when they are all exact already."""
        exact = tuple(e for e in (t.exact() for t in self.options.techniques) if e is not None)
        if exact == self.options.techniques:
            return self
        return self.with_options(self.options.replace(techniques=exact))

    def __getattr__(self, name: str):
        """A technique's method (``plan.pipeline_runner(rank)``, ``plan.grad_buckets()``, ...)."""
        fn = plan_method(name) if not name.startswith("__") else None
        if fn is None:
            raise AttributeError(f"'Plan' object has no attribute {name!r}")
        return types.MethodType(fn, self)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(plan_method_names()))

    @property
    def stage_layout(self):
        """The pipeline's StageLayout (parallel/pipeline/split.py), None without a pipeline."""
        return self.built.get("pipeline")

    @property
    def data_parallel(self):
        """The ap.DataParallel options of the dp axis (None without data parallelism)."""
        return self.options.data_parallel

    # ---- what the techniques answer, asked without naming one (outside parallel/ these stand for
    # plan.data_parallel and plan.dp_axis, which only the techniques' folders read)
    @cached_property
    def batch_axis(self) -> int | None:
        """The mesh axis (index) that splits the batch (dim 0 of every input): the first
        technique's ``data_axis()``, None where none splits it."""
        axis = next((a for a in (t.data_axis() for t in self.options.techniques) if a is not None), None)
        return None if axis is None else self.mesh.axis_index(axis)

    @property
    def state_storage(self):
        """The technique that keeps the parameters, gradients and optimizer state of the ranks it
        syncs as a storage policy of its own (``keeps_state``: data parallel's ZeRO levels), which
        the cost model and the search weigh; None where none does."""
        return next((t for t in self.options.techniques if t.keeps_state()), None)

    @property
    def weight_shards(self) -> tuple | None:
        """(the mesh axis that splits the batch, how many of its ranks share one weight's pieces)
        where a technique gathers weights over it before use (zero=3), else None (``weight_shards``)."""
        return next((s for s in (t.weight_shards(self) for t in self.options.techniques) if s is not None), None)

    def __deepcopy__(self, memo):
        # A plan does not change once made; a deep-copied rank module (module.autopar_plan) shares it.
        return self

    # ------------------------------------------------------------------ layout queries
    @property
    def graph(self) -> fx.Graph:
        return self.traced.gm.graph

    def layout(self, name: str):
        """The Layout of a graph node by name (placements, strategies, reason)."""
        node = self._nodes_by_name.get(name)
        if node is None or "autopar" not in node.meta:
            raise KeyError(name)
        return layout_of(node)

    @cached_property
    def _nodes_by_name(self) -> dict:
        # one index instead of a scan per query: callers ask for many nodes of large graphs
        return {n.name: n for n in self.graph.nodes}

    def attr_name(self, placeholder: str) -> str | None:
        t = self.traced
        return t.param_fqn.get(placeholder) or t.buffer_fqn.get(placeholder) or t.constant_fqn.get(placeholder)

    @cached_property
    def param_specs(self) -> dict[str, tuple]:
        """Placements of every parameter and buffer, by serial name (tied names included)."""
        specs = {}
        for node in self.graph.nodes:
            fqn = self.attr_name(node.name) if node.op == "placeholder" else None
            if fqn is not None and layout_of(node).outputs:
                specs[fqn] = layout_of(node).spec
        for names in self.traced.tied.values():
            used = [specs[n] for n in names if n in specs]
            for n in names:
                specs[n] = used[0]
        return specs

    @cached_property
    def ragged(self) -> frozenset:
        """The mesh axes on which dims sized at run time (the batch) may be cut unevenly: the
        example batch did not divide by them (sharding/propagate.is_ragged). Then any batch size
        runs, and means over the batch weigh each rank by its rows."""
        nodes = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        pairs = [(nodes[name].meta.get("val"), spec) for name, spec in zip(self.traced.user_inputs, self.input_specs)]
        return is_ragged(pairs, self.mesh)

    @cached_property
    def input_specs(self) -> list[tuple | None]:
        nodes = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        return [layout_of(nodes[name]).spec for name in self.traced.user_inputs]

    def output_target(self, spec: tuple) -> tuple:
        """How an output leaves a rank: reduced to R, gathered on every axis but data parallel."""
        out = []
        for axis, p in enumerate(spec):
            if isinstance(p, Partial) or (isinstance(p, Shard) and axis != self.batch_axis):
                out.append(R)
            else:
                out.append(p)
        return tuple(out)

    @cached_property
    def output_specs(self) -> list[tuple | None]:
        """The layout of each (flattened) user output as the rank's module returns it."""
        out_node = next(n for n in self.graph.nodes if n.op == "output")
        flat = pytree.tree_leaves(out_node.args[0])[: self.traced.n_user_outputs]
        return [
            self.output_target(layout_of(v).spec)
            if isinstance(v, fx.Node) and "autopar" in v.meta and layout_of(v).outputs
            else None
            for v in flat
        ]

    @cached_property
    def grad_sync_axes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> mesh axes its gradient is summed over by the gradient sync. A parameter
        split on a part of an axis (Shard.within / across: experts over one of two merged
        data-parallel axes) is summed over its replica groups there (the other part: a SubAxis)."""
        canonical = {n: names[0] for names in self.traced.tied.values() for n in names}
        out: dict[str, tuple] = {}
        for ph, axes in self.flow.param_sync_axes.items():
            fqn = self.traced.param_fqn[ph]
            key = canonical.get(fqn, fqn)
            out[key] = tuple(sorted(set(out.get(key, ())) | set(axes)))
        trainable = {n for n, p in named_parameters(self.model) if p.requires_grad}
        for fqn, spec in self.param_specs.items():
            key = canonical.get(fqn, fqn)
            replicas = [
                self.mesh.part(a, p.grouped, p.replica_part)
                for a, p in enumerate(spec)
                if isinstance(p, Shard) and p.grouped
            ]
            if replicas and key in trainable:
                out[key] = tuple(a for a in out.get(key, ()) if not isinstance(a, SubAxis)) + tuple(replicas)
        return out

    @cached_property
    def model_tensors(self) -> dict:
        """The model's parameters (tied names included) and buffers by name, in order, and the
        names of the persistent buffers."""
        return {
            "params": dict(self.model.named_parameters(remove_duplicate=False)),
            "buffers": dict(self.model.named_buffers()),
            "persistent": set(self.model.state_dict().keys()),
        }

    @property
    def persistent_buffers(self) -> set:
        return self.model_tensors["persistent"]

    # ------------------------------------------------------------------------- modules
    def module(self, rank: int) -> fx.GraphModule:
        """This rank's module (built once, then the same object): local shards, collectives inside."""
        self.mesh.check_rank(rank)
        if rank not in self._modules:
            self._modules[rank] = self.build_module(rank)
        return self._modules[rank]

    def build_module(self, rank: int, state: dict | None = None) -> fx.GraphModule:
        """A fresh module for ``rank`` with pieces of ``state`` (default: the model's current values)."""
        self.mesh.check_rank(rank)
        with gc_paused():  # thousands of small objects: each collection walks the whole model (2/3 of the time)
            gm = build_rank_module(
                self,
                rank,
                self.program,
                class_name=f"Rank{rank}Module",
                state=state,
                before_techniques=[_grad_sync, mark_pieces, mark_rank_params],
            )
        gm.train(self.model.training)  # starts in the model's mode, as a copy of it would
        return gm

    @cached_property
    def program(self) -> Program:
        """The emitted program every rank runs, its Python code generated once."""
        graph = emit_graph(self)
        bind_device(graph)  # before the rewrites: an outlined region gets the device as an input
        for technique in self.options.techniques:
            technique.rewrite_program(self, graph)
        graph.lint()
        t = self.traced
        # imported here: torch.export._unlift imports torch._dynamo (~1 s), which import autopar need not pay
        from torch.export._unlift import _get_codegen

        graph._codegen = _get_codegen(t.in_spec, t.out_spec, t.forward_arg_names or None)
        return Program(graph, slots=tensor_slots(self))

    # -------------------------------------------------------------------------- inputs
    def local_inputs(self, rank: int, *args, **kwargs) -> tuple[tuple, dict]:
        """This rank's slice of a global batch, in the model's (args, kwargs) structure.

        Each piece is contiguous, as a DTensor's local tensor is: a sequence cut (context
        parallel) narrows a middle dim, and a model that calls ``targets.view(-1)`` needs the
        piece's own storage (a batch cut is already contiguous and is not copied)."""
        self.mesh.check_rank(rank)
        flat, spec = pytree.tree_flatten((args, kwargs))
        names = self.traced.user_inputs
        if len(flat) != len(names):
            raise InputError(
                f"The plan was traced with {len(names)} inputs ({', '.join(names)}) but "
                f"{len(flat)} were given; pass the same structure as the example inputs."
            )
        local = []
        orders = piece_orders(self)
        inputs = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        for name, value, ispec in zip(names, flat, self.input_specs):
            if isinstance(value, torch.Tensor) and ispec is not None:
                self._check_input(name, value, ispec)
                ispec = orders.out_spec(inputs[name], ispec)  # pieces in another order (Shard.order)
                value = shard_tensor(value, ispec, self.mesh, rank).contiguous()
            local.append(value)
        return pytree.tree_unflatten(local, spec)

    def _check_input(self, name, value, ispec):
        """A split dim sized at run time (the batch) must divide; a static one may be cut unevenly."""
        val = next(n for n in self.graph.nodes if n.op == "placeholder" and n.name == name).meta.get("val")
        for axis, p in enumerate(ispec):
            if isinstance(p, Shard):
                n = self.mesh.shape[axis]
                size = val.shape[p.dim] if p.dim < val.dim() else None
                static = isinstance(size, int) or (isinstance(size, torch.SymInt) and size.node.expr.is_number)
                if p.dim >= value.dim() or (value.shape[p.dim] % n and not static and axis not in self.ragged):
                    raise InputError(
                        f"Input {name!r} has shape {tuple(value.shape)}; its dim {p.dim} is split over "
                        f"mesh axis {self.mesh.axis_names[axis]!r} of size {n} and must divide by it. "
                        f"Use a batch size that is a multiple of {n}, or plan with an example batch that is not "
                        "(then any batch size runs, cut unevenly)."
                    )

    # ----------------------------------------------------------------------- state dicts
    def merge_state_dicts(self, per_rank: list[dict]) -> dict:
        """Full serial tensors from every rank's dict of parameters (or of their gradients)."""
        for technique in self.options.techniques:
            per_rank = technique.restored(self, per_rank)
        return merge_states(per_rank, self.param_specs, self.mesh)

    def shard_state_dict(self, full: dict, rank: int) -> dict:
        """This rank's pieces of a full serial state dict (the inverse of merge_state_dicts)."""
        out = shard_state(full, self.param_specs, self.mesh, rank)
        for technique in self.options.techniques:
            out = {k: technique.stored(self, rank, k, v) for k, v in out.items()}
        return out

    def merge_outputs(self, per_rank: list):
        """The global outputs from every rank's outputs (shards concatenated)."""
        flats = [pytree.tree_flatten(o)[0] for o in per_rank]
        spec = pytree.tree_flatten(per_rank[0])[1]
        merged = []
        for i, ospec in enumerate(self.output_specs):
            pieces = [f[i] for f in flats]
            if ospec is None or not isinstance(pieces[0], torch.Tensor):
                merged.append(pieces[0])
            else:
                merged.append(merge_tensors([p.detach() for p in pieces], ospec, self.mesh))
        return pytree.tree_unflatten(merged, spec)

    # ------------------------------------------------------------------ running ranks
    def simulate(self, step, *args, timeout: float = 60.0, **kwargs) -> list:
        """Run ``step(module, *local_args, **local_kwargs)`` for every rank in this process.

        Collectives (forward and backward) are computed across the simulated ranks; the
        list of each rank's return value comes back.
        """
        inputs = [self.local_inputs(r, *args, **kwargs) for r in self.mesh.ranks()]
        modules = [self.module(r) for r in self.mesh.ranks()]

        def run(rank):
            a, k = inputs[rank]
            return step(modules[rank], *a, **k)

        return run_ranks(self.mesh.size, run, timeout=timeout)

    def check(self, *args, loss=None, rtol: float | None = None, atol: float | None = None, **kwargs) -> dict:
        """Compare every rank (simulated) with the serial model: outputs and every gradient.

        Raises ap.PlanMismatch naming the first tensor that differs. Returns a small report.
        ``rtol``/``atol`` default to the model's dtype (runtime/serial_check.py TOLERANCES: fp32 1e-5/1e-6);
        an element may differ by rtol of itself plus max(atol, rtol x its tensor's largest magnitude).
        """
        return check_plan(self, args, kwargs, loss, *default_tolerances(self.model, rtol, atol))

    def dry_run(self, rank=None, device="cuda", steps=2, optimizer=torch.optim.AdamW, **optimizer_kwargs):
        """Run ``rank``'s program (None: every distinct rank program) at full size on fake tensors on
        ``device``, ``steps`` whole training steps in a fake world of the mesh's size; returns the
        measured peak memory by kind, collectives and FLOPs beside the plan's (autopar/dryrun/).

        Example: ``plan.dry_run(device="cuda").peak_bytes``"""
        return dry_run(self, rank, device, steps, optimizer, **optimizer_kwargs)

    def __repr__(self) -> str:
        return (
            f"<autopar.Plan {type(self.model).__name__} on {self.mesh}: "
            f"{sum(1 for _ in self.graph.nodes)} nodes, {len(self.collectives())} collectives/step>"
        )


def _grad_sync(plan, module, rank: int) -> None:
    """The bucketed gradient sync, where gradients arrive in parts (gradient contract; the
    data-parallel options shape its buckets): attached before the techniques' hooks."""
    if plan.grad_sync_axes:
        dp_module.attach(plan, module, rank)
