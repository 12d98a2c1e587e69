"""Plan: the result of planning, and what you do with it.

A Plan holds the traced graph with a layout on every node, the gradient flow, and the
specs of every parameter, input and output. From it come each rank's module, each rank's
slice of a batch, conversions between serial and per-rank state dicts, the in-process
simulation of all ranks, and the check against the serial model.

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
from functools import cached_property

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export._unlift import _get_codegen

from autopar.explore import display
from autopar.codegen.emit import emit_graph, rank_attrs
from autopar.errors import InputError
from autopar.parallel import dp_module as dpplan
from autopar.parallel.optimizer import mark_pieces
from autopar.checkpoint import guard
from autopar.checkpoint.meta import materialize
from autopar.placement import Partial, Replicate, Shard, merge_tensors, shard_tensor
from autopar.codegen.program import Program
from autopar.sharding.propagate import layout_of
from autopar.runtime.rng import attach_state
from autopar.runtime.simulator import run_ranks
from autopar.codegen.rank_state import merge_states, set_attr, shard_state

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


def _own(piece: torch.Tensor) -> torch.Tensor:
    """This rank's own copy of a piece. A meta piece holds no data: a new empty one of its shape
    (cloning a strided meta view runs torch's Python reference checks, about half the time of
    building a rank module of a 70B-shaped model)."""
    if piece.device.type == "meta":
        return torch.empty(piece.shape, dtype=piece.dtype, device="meta")
    return piece.clone()


class _Owners:
    """The submodule of ``root`` that holds each dotted name, made (plain nn.Module) once."""

    def __init__(self, root: nn.Module):
        self.mods = {"": root}

    def of(self, fqn: str) -> tuple[nn.Module, str]:
        path, _, leaf = fqn.rpartition(".")
        return self._module(path), leaf

    def _module(self, path: str) -> nn.Module:
        if path not in self.mods:
            parent, _, name = path.rpartition(".")
            mod = nn.Module()
            self._module(parent).add_module(name, mod)
            self.mods[path] = mod
        return self.mods[path]


class Plan:
    """Made by planner.make_plan (ap.plan, ap.load_plan); ``layouts`` is planner.Layouts
    (seeds, every node's layout, gradient flow), ``options`` an ap.PlanOptions."""

    def __init__(self, model, mesh, traced, layouts, options):
        self.model, self.mesh, self.traced = model, mesh, traced
        self.layouts, self.options = layouts, options
        self.seeds, self.ctx, self.flow = layouts.seeds, layouts.ctx, layouts.flow
        dp = options.data_parallel
        self.dp_axis = mesh.axis_index(dp.axis) if dp is not None else None
        self.built: dict[str, object] = {}  # technique name -> what its after_plan built
        self._modules: dict[int, fx.GraphModule] = {}
        self._comms: list | None = None

    @property
    def stage_layout(self):
        """The pipeline's StageLayout (parallel/pipeline/split.py), None without a pipeline."""
        return self.built.get("pipeline")

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
    def input_specs(self) -> list[tuple | None]:
        nodes = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        return [layout_of(nodes[name]).spec for name in self.traced.user_inputs]

    def output_target(self, spec: tuple) -> tuple:
        """How an output leaves a rank: reduced to R, gathered on every axis but data parallel."""
        out = []
        for axis, p in enumerate(spec):
            if isinstance(p, Partial) or (isinstance(p, Shard) and axis != self.dp_axis):
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
        """Parameter name -> mesh axes its gradient is summed over by the gradient sync."""
        canonical = {n: names[0] for names in self.traced.tied.values() for n in names}
        out: dict[str, tuple] = {}
        for ph, axes in self.flow.param_sync_axes.items():
            fqn = self.traced.param_fqn[ph]
            key = canonical.get(fqn, fqn)
            out[key] = tuple(sorted(set(out.get(key, ())) | set(axes)))
        return out

    # ------------------------------------------------------------------- data parallel
    @property
    def data_parallel(self):
        """The ap.DataParallel options of the dp axis (None without data parallelism)."""
        return self.options.data_parallel

    def with_data_parallel(self, data_parallel) -> "Plan":
        """The same plan (same trace and layouts) with other DataParallel options on the same axis.

        Example: ``plan.with_data_parallel(ap.DataParallel("dp", zero=2)).module(rank)``
        """
        from autopar.planner import with_options

        return with_options(self, self.options.replace(data_parallel=data_parallel))

    def grad_buckets(self, rank: int = 0) -> list:
        """The fused gradient buckets of ``rank``, in the order every rank of its group launches them."""
        return dpplan.grad_buckets(self, rank)

    def memory_per_rank(self, rank: int = 0, state_slots: int = 2) -> dict:
        """Bytes of parameters, gradients and optimizer state on ``rank`` (ZeRO shards counted)."""
        return dpplan.memory_per_rank(self, rank, state_slots)

    def zero_optimizer(self, module, optimizer_class, **kwargs):
        """ap.ZeroOptimizer(module, optimizer_class, **kwargs) for a module of this plan (zero=1|2)."""
        from autopar.parallel.zero import ZeroOptimizer

        return ZeroOptimizer(module, optimizer_class, **kwargs)

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
            return self._build_module(rank, state)

    def _build_module(self, rank: int, state: dict | None) -> fx.GraphModule:
        gm = self.program.instance(f"Rank{rank}Module")
        self._fill_attrs(gm, rank, state)
        for name, value in rank_attrs(self.mesh, rank).items():  # what the program reads per rank
            setattr(gm, name, value)
        from autopar.runtime.grad_clip import ParamPlacements  # for whole-model quantities (ap.clip_grad_norm_)

        gm.autopar_placements = ParamPlacements(self.mesh, rank, self.param_specs)
        attach_state(gm, self)  # the dropout generator (rng.py)
        if self.grad_sync_axes:
            dpplan.attach(self, gm, rank)  # gradient buckets (gradient contract; dp options shape them)
        for technique in self.options.techniques:
            technique.attach(self, gm, rank)
        gm.train(self.model.training)  # starts in the model's mode, as a copy of it would
        gm.autopar_plan, gm.autopar_rank = self, rank  # what ap.get_state_dict reads
        mark_pieces(gm, self)  # a whole-tensor torch.optim class stepping pieces is refused (ap.Optimizer)
        guard.install(gm, self)  # a plain state_dict() given to DCP fails loudly
        return gm

    @cached_property
    def program(self) -> Program:
        """The emitted program every rank runs, its Python code generated once."""
        graph = emit_graph(self)
        for technique in self.options.techniques:
            technique.rewrite_program(self, graph)
        graph.lint()
        t = self.traced
        graph._codegen = _get_codegen(t.in_spec, t.out_spec, t.forward_arg_names or None)
        return Program(graph)

    def _fill_attrs(self, root, rank, state):
        """Every parameter, buffer and constant of the model, as ``rank``'s piece, on ``root``
        (unused ones too, so that state_dict() has the serial model's keys)."""
        made: dict[int, nn.Parameter] = {}
        owners = _Owners(root)
        specs, default = self.param_specs, (R,) * self.mesh.ndim
        for fqn, p in self._model_tensors["params"]:
            if id(p) not in made:
                value = state[fqn] if state is not None and fqn in state else p
                local = _own(shard_tensor(value.detach(), specs.get(fqn, default), self.mesh, rank))
                local = materialize(local, self._materialize_on)
                for technique in self.options.techniques:
                    local = technique.stored(self, rank, fqn, local)
                made[id(p)] = nn.Parameter(local, requires_grad=p.requires_grad)
            owner, leaf = owners.of(fqn)
            owner.register_parameter(leaf, made[id(p)])
        persistent = self._model_tensors["persistent"]
        for fqn, b in self._model_tensors["buffers"]:
            owner, leaf = owners.of(fqn)
            local = materialize(_own(shard_tensor(b, specs.get(fqn, default), self.mesh, rank)), self._materialize_on)
            owner.register_buffer(leaf, local, persistent=fqn in persistent)
        for fqn, c in self.traced.constants.items():
            set_attr(root, fqn, c.clone(), None)

    @property
    def _materialize_on(self):
        """Where the empty pieces of a meta-device model go (None: they stay meta; see checkpoint/meta.py)."""
        return self.traced.materialize_device

    @cached_property
    def _model_tensors(self) -> dict:
        """The model's parameters (tied names included), buffers and persistent names, in order."""
        return {
            "params": list(self.model.named_parameters(remove_duplicate=False)),
            "buffers": list(self.model.named_buffers()),
            "persistent": set(self.model.state_dict().keys()),
        }

    # -------------------------------------------------------------------------- inputs
    def local_inputs(self, rank: int, *args, **kwargs) -> tuple[tuple, dict]:
        """This rank's slice of a global batch, in the model's (args, kwargs) structure."""
        self.mesh.check_rank(rank)
        flat, spec = pytree.tree_flatten((args, kwargs))
        names = self.traced.user_inputs
        if len(flat) != len(names):
            raise InputError(
                f"The plan was traced with {len(names)} inputs ({', '.join(names)}) but "
                f"{len(flat)} were given; pass the same structure as the example inputs."
            )
        local = []
        for name, value, ispec in zip(names, flat, self.input_specs):
            if isinstance(value, torch.Tensor) and ispec is not None:
                self._check_input(name, value, ispec)
                value = shard_tensor(value, ispec, self.mesh, rank)
            local.append(value)
        return pytree.tree_unflatten(local, spec)

    def _check_input(self, name, value, ispec):
        for axis, p in enumerate(ispec):
            if isinstance(p, Shard):
                n = self.mesh.shape[axis]
                if p.dim >= value.dim() or value.shape[p.dim] % n:
                    raise InputError(
                        f"Input {name!r} has shape {tuple(value.shape)}; its dim {p.dim} is split over "
                        f"mesh axis {self.mesh.axis_names[axis]!r} of size {n} and must divide by it. "
                        f"Use a batch size that is a multiple of {n}."
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
        ``rtol``/``atol`` default to the model's dtype (check.TOLERANCES: fp32 1e-5/1e-6).
        """
        from autopar.runtime.serial_check import check_plan, default_tolerances

        return check_plan(self, args, kwargs, loss, *default_tolerances(self.model, rtol, atol))

    # --------------------------------------------------------------------------- display
    def collectives(self) -> list:
        """Every collective one training step runs (forward, backward, gradient sync), per rank."""
        from autopar.explore.step_collectives import collectives

        if self._comms is None:  # a plan does not change once made; str(plan) asks twice
            self._comms = collectives(self)
        return list(self._comms)

    def __str__(self) -> str:
        text = display.plan_table(self)
        if self.stage_layout is not None:
            from autopar.parallel.pipeline.split import describe

            text += "\n\n" + describe(self.stage_layout, self.graph)
        return text

    # ------------------------------------------------------------------------ pipeline
    def with_pipeline(self, pipeline, split_before=()) -> "Plan":
        """The same plan (same trace and layouts) with other pipeline options."""
        from autopar.parallel.pipeline.api import with_pipeline

        return with_pipeline(self, pipeline, split_before)

    def pipeline_runner(self, rank: int, **kwargs):
        """This rank's PipelineRunner (see autopar/parallel/pipeline/runner.py): ``runner.step(batch, labels)``."""
        from autopar.parallel.pipeline.api import pipeline_runner

        return pipeline_runner(self, rank, **kwargs)

    def schedule_table(self, rank: int | None = None) -> str:
        """Which micro-batch each pipeline rank runs at each slot (F forward, B backward)."""
        from autopar.parallel.pipeline.api import require_pipeline
        from autopar.parallel.pipeline.timeline import schedule_table

        return schedule_table(require_pipeline(self), rank)

    def timeline_figure(self, events_per_rank=None, title: str | None = None):
        """A matplotlib Figure of the schedule (unit slots), or of measured runner timelines."""
        from autopar.parallel.pipeline.api import require_pipeline
        from autopar.parallel.pipeline.timeline import timeline_figure

        return timeline_figure(events_per_rank, require_pipeline(self), title)

    def __repr__(self) -> str:
        return (
            f"<autopar.Plan {type(self.model).__name__} on {self.mesh}: "
            f"{sum(1 for _ in self.graph.nodes)} nodes, {len(self.collectives())} collectives/step>"
        )

    def summary(self) -> str:
        return display.summary(self)

    # ---------------------------------------------------- exploring (display, costs, files)
    def _repr_html_(self) -> str:
        from autopar.explore.html import plan_html

        return plan_html(self)

    def explain(self, name: str) -> str:
        """Why ``name`` (node, parameter, input or module path) got its layout and collectives."""
        from autopar.explore.explain import explain

        return explain(self, name)

    def cost(self, sizes: dict | None = None, names: dict | None = None, optimizer_states: int = 2):
        """Bytes moved per step per axis, memory per rank and FLOPs as sympy formulas (ap.Cost)."""
        from autopar.explore.cost import Cost

        return Cost(self, sizes, names, optimizer_states)

    def plot_memory(self, **kw):
        """matplotlib Figure: memory per rank (params, grads, optimizer, activations)."""
        from autopar.explore.plots import plot_memory

        return plot_memory(self, **kw)

    def plot_comm(self, **kw):
        """matplotlib Figure: bytes per step and rank, per layer and mesh axis."""
        from autopar.explore.plots import plot_comm

        return plot_comm(self, **kw)

    def draw(self, rank: int = 0, **kw):
        """This rank's graph, collectives coloured: SVG with Graphviz ``dot``, DOT text otherwise."""
        from autopar.explore.draw import draw

        return draw(self, rank, **kw)

    def save(self, path) -> None:
        """Write the plan (mesh, annotations' seeds, every node's layout and strategies) as JSON."""
        from autopar.explore.save_load import save_plan

        save_plan(self, path)

    def diff(self, other: "Plan"):
        """Nodes whose layout or collectives differ between two plans of one model."""
        from autopar.explore.diff import diff_plans

        return diff_plans(self, other)
