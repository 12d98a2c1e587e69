"""The planning pipeline, in one place: trace -> seed -> propagate -> gradient flow -> Plan ->
techniques. ap.plan and ap.load_plan go through here (the plan variants, other technique options
on the same layouts, are Plan.with_options), so a stage added to planning is added once.

Example:
    >>> plan = make_plan(model, mesh, PlanOptions(data_parallel="dp"), args=(x,),
    ...                  annotations={"fc1": ap.colwise("tp")})
    >>> zero2 = plan.with_options(plan.options.replace(data_parallel=ap.DataParallel("dp", zero=2)))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from contextlib import ExitStack
from typing import Callable

import torch
import torch.utils._pytree as pytree

from autopar.trace.meta_device import input_device, meta_names, retarget_meta_device
from autopar.dryrun.verify import verified
from autopar.errors import AnnotationError, MeshError, TraceError
from autopar.explore.plan_file import read_plan_file
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.parallel import TECHNIQUES
from autopar.plan import Plan
from autopar.search.auto import search, settle_memory
from autopar.search.options import Auto
from autopar.search.quiet_gc import quiet_gc
from autopar.sharding.annotations import Seeds, data_parallel_inputs, replicated, resolve
from autopar.sharding.gradient_flow import analyse
from autopar.sharding.propagate import propagate
from autopar.trace.dtype_kernels import check_kernels, export_refusal
from autopar.trace.export import trace
from autopar.sharding.written_views import keep_written_layouts
from autopar.trace.in_dtype import inputs_in_dtype, kept_in_fp32, materialized, params_in_dtype, skeleton
from autopar.trace.model_members import held
from autopar.trace.opaque import keep_opaque, opaque, opaque_paths


@dataclass(frozen=True)
class Layouts:
    """What propagation decided: the seeds it started from, every node's layout (ctx), and
    the gradient flow derived from them. Shared by the plans that differ only in options."""

    seeds: Seeds
    ctx: object
    flow: object


def make_plan(
    model: torch.nn.Module,
    mesh: Mesh,
    options: PlanOptions,
    *,
    args=(),
    kwargs=None,
    annotations: dict | None = None,
    seeds: Seeds | None = None,
    enforce: Callable | None = None,
) -> Plan:
    """Trace ``model`` and plan it. ``seeds`` (a plan file's) replace the annotations;
    ``enforce(graph)`` runs right after propagation (a plan file's recorded choices)."""
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be an ap.Mesh, got {type(mesh).__name__}.")
    args = args if isinstance(args, tuple) else (args,)
    annotations = dict(annotations or {})
    options = _implied(model, options)
    asked = (mesh, options, dict(annotations))  # as given: a searched plan's runner-up is planned from them
    mesh, options = _reshape_mesh(mesh, options)
    _validate(mesh, options, annotations)
    keep = opaque_paths(annotations, model)  # ap.opaque(): traced as one replicated op each
    annotations = {p: (replicated() if isinstance(a, opaque) else a) for p, a in annotations.items()}

    def traced_for(options: PlanOptions):
        traced = _trace(model, options, args, kwargs, keep)
        traced.replan = lambda again, seeds: make_plan(  # Plan.with_options under another compute dtype
            model, mesh, again, **_example(traced), annotations={p: opaque() for p in keep}, seeds=seeds
        )
        if meta_names(model):  # a meta-device model: its rank modules run where the inputs are
            traced.materialize_device = input_device(args, kwargs)
            if traced.materialize_device is not None:
                retarget_meta_device(traced.gm.graph, traced.materialize_device)
        return traced

    traced = traced_for(options)
    ndims = _input_ndims(traced, args, kwargs)
    record, searched = None, options.auto
    if options.auto is not None:  # the search plans many probes on this trace, then seeds as a user would
        resolved: dict = {}  # the probes' seeds by resolve's arguments (_resolved)

        policy = _policy(options)

        def plan_probe(probe_traced, probe_options, probe_annotations):
            if policy is not None:  # the probes compute as the plan will, on its trace in the policy's dtype
                probe_options = probe_options.replace(**{type(policy).name: policy})
            probe_mesh, probe_options = _reshape_mesh(mesh, probe_options)  # data parallel over two axes
            return plan_traced(
                model,
                probe_mesh,
                probe_traced,
                probe_options,
                annotations=probe_annotations,
                ndims=ndims,
                resolved=resolved,
            )

        # the probes change no module: its parameters walked once; the trace and the model left
        # out of the collector's passes (quiet_gc.py)
        with held(model), quiet_gc():
            precision = (
                None if policy is None else {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
            )
            annotations, chosen, record = search(model, mesh, traced, annotations, options, plan_probe, precision)
        mesh, options = _reshape_mesh(mesh, options.replace(**chosen, auto=None))
        _validate(mesh, options, annotations)
        # a pipeline chosen under dynamic=False traces its batch dim dynamic (_trace_dynamic): the
        # search's trace, static at the whole batch, counted each micro-batch's activations at the
        # whole batch (16x on the 70B) and its stages would fail on their first reshape
        if _trace_dynamic(options) != _trace_dynamic(asked[1]):
            traced = traced_for(options)
    plan = plan_traced(model, mesh, traced, options, annotations=annotations, ndims=ndims, seeds=seeds, enforce=enforce)
    if record is not None:  # JSON: the search's choice, its reasons and the runners-up
        plan.built["auto"] = settle_memory(plan, record, Auto.of(searched).optimizer_states)
        plan_option = _option_planner(model, asked, traced)
        if Auto.of(searched).verify:  # dry-run at full size; over the budget, the next option (dryrun/verify.py)
            plan = verified(plan, Auto.of(searched).optimizer_states, plan_option)
        plan.plan_option = plan_option
    return plan


def _option_planner(model, asked: tuple, traced) -> Callable:
    """``plan_option(label)``: the same call planned with ap.Auto(option=label), one of the
    options the search weighed (explore/search_view.py explains the runners-up with it)."""
    mesh, options, annotations = asked

    def plan_option(label: str) -> Plan:
        auto = dataclasses.replace(Auto.of(options.auto), option=label, verify=False)
        return make_plan(model, mesh, options.replace(auto=auto), **_example(traced), annotations=annotations)

    return plan_option


def _policy(options: PlanOptions):
    """The options' precision policy as one technique (ap.MixedPrecision, or a DataParallel's own
    dtypes: ``Technique.precision_policy``, the last technique's that carries one, a policy given
    on its own coming after the data parallel it gives its dtypes to): the search's probes, each
    with a data parallel of its own, plan under it. Without it
    a probe's options named no compute dtype while its trace was in one, and each checkpointed
    variant (Plan.with_options) traced the model again in fp32: the probes priced the fp32
    program, and the saves shared between variants named the other trace's nodes (a KeyError
    on the 8B with ``mixed_precision=`` and ``auto=``)."""
    policies = [p for p in (t.precision_policy() for t in options.techniques) if p is not None]
    return policies[-1] if policies else None


def _trace(model, options: PlanOptions, args: tuple, kwargs, keep: list):
    """``model`` traced as it computes under the options' precision policy: its floating parameters
    and inputs in ``param_dtype`` (trace/in_dtype.py; the model's own dtype without a policy)."""
    dtype = options.compute_dtype
    low_args, low_kwargs = inputs_in_dtype(args, kwargs or {}, dtype)
    kept = kept_in_fp32(model, dtype)  # HF's _keep_in_fp32_modules(_strict): traced and read in fp32
    try:
        with params_in_dtype(model, dtype, kept), keep_opaque(model, keep, low_args, low_kwargs), ExitStack() as stack:
            for technique in options.techniques:  # modules traced as what they compute (Float8Linear)
                stack.enter_context(technique.tracing(model))
            traced = trace(
                model, low_args, low_kwargs, dynamic=_trace_dynamic(options), repeat_blocks=options.repeat_blocks
            )
    except TraceError as e:  # export refused the dtype (fft, linalg.inv): say which module and what to write
        refusal = export_refusal(e, dtype, model)
        if refusal is None:
            raise
        raise refusal from e.__cause__
    # before anything is planned: an op without a kernel for the dtype here fails now, not at step 1
    check_kernels(traced.gm.graph, dtype, _run_device(model, args, kwargs), model)
    traced.example, traced.opaque = skeleton(args, kwargs), tuple(keep)
    traced.example_device, traced.dtype, traced.kept_fp32 = input_device(args, kwargs), dtype, kept
    return traced


def _implied(model, options: PlanOptions) -> PlanOptions:
    """The options with the techniques the model asks for by its modules and was not given
    (a torchao-converted model: ap.Float8 with its recipe)."""
    for name, cls in TECHNIQUES.items():
        if getattr(options, name) is None:
            found = cls.implied(model)
            if found is not None:
                options = options.replace(**{name: found})
    return options


def _run_device(model, args, kwargs):
    """Where the rank modules will run: the parameters' device, or the inputs' for a meta model."""
    real = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    return real or input_device(args, kwargs)


def _example(traced) -> tuple:
    """The example inputs to trace again with: zeros of their shapes where they were, as keywords."""
    args, kwargs = materialized(traced.example, traced.example_device)
    return {"args": args, "kwargs": kwargs}


def _resolved(cache: dict | None, annotations, model, mesh, inputs, data_axis, ndims) -> Seeds:
    """resolve's seeds, kept in ``cache`` by its arguments (the model is the search's one): the
    search's ~35 probes resolve a few annotation sets, each over every layer of the model (900 on
    a 405B, 7% of a 512-rank search). What the annotations give is kept without the batch split
    of the data-parallel axis, which resolve adds last (the probes differ in that axis more than
    in their annotations), and added to each copy. Each call gets its own copy: the techniques,
    the tied weights and the expert blocks add to the seeds."""
    if cache is None:
        return resolve(annotations, model, mesh, inputs, data_axis, ndims)
    key = (tuple((annotations or {}).items()), mesh, mesh.parts, tuple(inputs))
    try:
        hash(key)
    except TypeError:  # an annotation that cannot be a key: resolved each time
        return resolve(annotations, model, mesh, inputs, data_axis, ndims)
    if key not in cache:
        cache[key] = resolve(annotations, model, mesh, inputs, None, ndims)
    held = cache[key]
    seeds = Seeds(**{f.name: _copied(getattr(held, f.name)) for f in dataclasses.fields(Seeds)})
    if data_axis is not None:  # resolve's last step
        data_parallel_inputs(seeds, mesh, data_axis, inputs, ndims or {})
    return seeds


def _copied(table: dict) -> dict:
    """A copy of a Seeds table, its inner tables too (module outputs: path -> {axis: placement})."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}


def _trace_dynamic(options: PlanOptions) -> bool | str:
    """How the model is exported: ``options.dynamic``, except that a pipelined plan's batch dim is
    dynamic even with ``dynamic=False`` ("batch"). Why: its runner cuts the batch into micro-batches
    along dim 0 and runs each stage on one, so a stage traced at the whole batch failed on its
    first reshape (shape '[8, 16, ...]' is invalid for input of size 3072), and the activations it
    holds, sized by dividing the batch symbol by the micro-batch count, were counted at the whole
    batch. The other dims stay static, as asked.

    Example:
        >>> _trace_dynamic(PlanOptions(dynamic=False, pipeline=ap.Pipeline("pp", microbatches=4)))
        'batch'
    """
    if options.dynamic or options.pipeline is None:
        return options.dynamic
    return "batch"


def load_plan(path, model: torch.nn.Module, *, mesh: Mesh | None = None, args=None, kwargs=None) -> Plan:
    """The plan saved at ``path`` (plan.save) for ``model``, which must have the same parameters:
    traced again, propagated from the recorded seeds, the recorded strategies restored and checked
    node by node (explore/plan_file.py). ``mesh``, if given, must be the saved one; ``args``/
    ``kwargs``: example inputs to trace with (default: the saved shapes, zeros/ones).

    Example:
        >>> plan.save("gpt.json"); again = ap.load_plan("gpt.json", model)
    """
    saved = read_plan_file(path, model, mesh=mesh, args=args, kwargs=kwargs)
    plan = make_plan(
        model,
        saved["mesh"],
        saved["options"],
        args=saved["args"],
        kwargs=saved["kwargs"],
        seeds=saved["seeds"],
        enforce=saved["enforce"],
    )
    if saved["auto"] is not None:
        plan.built["auto"] = saved["auto"]
    return plan


def plan_traced(
    model: torch.nn.Module,
    mesh: Mesh,
    traced,
    options: PlanOptions,
    *,
    annotations=None,
    ndims: dict | None = None,
    seeds: Seeds | None = None,
    enforce: Callable | None = None,
    resolved: dict | None = None,
) -> Plan:
    """The stages after tracing: seed -> propagate -> gradient flow -> Plan -> techniques (the
    search plans its probes on one trace with this; ``resolved``: its cache of resolve's seeds)."""
    data_axis = next((t.data_axis() for t in options.techniques if t.data_axis()), None)
    if seeds is None:
        for technique in options.techniques:  # layouts a technique stands for (expert parallel's annotations)
            annotations = technique.annotate(model, traced, annotations or {})
        seeds = _resolved(resolved, annotations, model, mesh, traced.user_inputs, data_axis, ndims)
        for technique in options.techniques:  # inputs a technique splits (context parallel: sequences)
            technique.seed_inputs(seeds, mesh, _input_values(traced))
    _unify_tied(seeds, traced)
    for technique in options.techniques:
        technique.prepare_graph(traced)
    for cls in TECHNIQUES.values():  # asked for or not (a MoE model's experts modules as one op each)
        cls.prepare_seeded_graph(traced, seeds, mesh, data_axis)
    ctx = propagate(traced, mesh, seeds, options.strict)
    # a tensor written in place through a view keeps its layout up to the write (else it writes a copy)
    ctx = keep_written_layouts(traced, mesh, seeds, options.strict, ctx)
    if enforce is not None:
        enforce(traced.gm.graph)
    flow = analyse(traced.gm.graph, mesh, ctx.needs_grad, ctx.param_derived, ctx.param_nodes)
    return Plan(model, mesh, traced, Layouts(seeds, ctx, flow), options).finish()


def _reshape_mesh(mesh: Mesh, options: PlanOptions) -> tuple[Mesh, PlanOptions]:
    """The mesh the techniques plan on (technique.reshape_mesh: e.g. two-axis HSDP's one axis)."""
    techniques = []
    for technique in options.techniques:
        mesh, technique = technique.reshape_mesh(mesh)
        techniques.append(technique)
    return mesh, options.replace(techniques=tuple(techniques))


def _validate(mesh: Mesh, options: PlanOptions, annotations: dict) -> None:
    for technique in options.techniques:
        technique.validate(mesh, options, annotations)
    for ann in annotations.values():
        if hasattr(ann, "axis"):
            mesh.sub_axis(ann.axis)  # a mesh axis, or one of two merged into one (an expert split)


def _input_ndims(traced, args, kwargs) -> dict:
    flat = pytree.tree_leaves((args, kwargs or {}))
    return {name: (v.dim() if isinstance(v, torch.Tensor) else 0) for name, v in zip(traced.user_inputs, flat)}


def _input_values(traced) -> dict:
    """The user inputs' example values by placeholder name."""
    return {n.name: n.meta.get("val") for n in traced.gm.graph.nodes if n.name in traced.user_inputs}


def _unify_tied(seeds, traced) -> None:
    """Tied parameters are one tensor: they get one layout, whichever name was annotated."""
    for names in traced.tied.values():
        given = {n: seeds.params[n] for n in names if n in seeds.params}
        if len(set(given.values())) > 1:
            raise AnnotationError(
                f"Tied parameters {names} share one tensor but were annotated "
                f"differently: {given}. Annotate them alike (or only one of them)."
            )
        if given:
            spec = next(iter(given.values()))
            for n in names:
                seeds.params[n] = spec
