"""ap.plan(..., auto=...): probe plans on the one trace, cost them by component, solve, annotate.

1. the context (context.py): the model's components (candidates.py: the Megatron pairs, the
   vocabulary, the experts), its facts, the user's techniques and annotations.
2. structures: every {mesh axis: role} the registered techniques' roles allow (candidates.py),
   less those the user's techniques rule out and the context-parallel ones that cannot win.
3. probes (probes.py): for each structure, the plan with every free component split on the tp
   axis (and, once per dp axis, the plan with none split); each is an ordinary propagation on
   a copy of the trace, costed by evaluate.plan_terms, node by node attributed to components.
4. options (weigh.py): each structure x each technique's choices on it (Technique.search_space:
   data parallel's storages, the pipeline's schedules and cuts, the checkpointing modes), and
   the MILP (solver.py) over them, under the budget.
5. the annotations and the chosen techniques go back to ap.plan, which plans them as if the
   user had written them; the reasons and the runners-up go in plan.built["auto"] (record.py).

The search names no technique: it asks the registry's techniques for their roles, choices and
labels (parallel/protocols/search.py). Constraints: a user's technique fixes what it names (data
parallel its axis, its ZeRO level when not 0, its folded axes; a pipeline its axis and schedule;
context parallel its axis, method and order; checkpointing its mode); annotations are kept as
written, the components they touch are not searched, and an axis they name is the tp axis.

Example:
    >>> plan = ap.plan(model, mesh, kwargs=batch, auto=ap.Auto(memory_budget=2**30))
    >>> print(plan.explain("auto"))
"""

from __future__ import annotations

import time

from autopar.errors import PlanError
from autopar.parallel.registry import TECHNIQUES
from autopar.search.candidates import sp_annotations, structures
from autopar.search.context import SearchContext, batch_size, job_device, state_floor
from autopar.search.probes import Probes
from autopar.search.record import duplicated_axes, named, record_of, settle_memory
from autopar.search.solver import solve
from autopar.search.weigh import label_of, least_memory, weigh

__all__ = ["NoPlanError", "batch_size", "job_device", "search", "settle_memory"]


class NoPlanError(PlanError):
    """No plan the search may choose fits: the memory budget is too small, or constraints clash."""


def search(model, mesh, traced, annotations, options, plan_probe, precision=None):
    """(annotations, {technique name: its value}, record) of the best plan under ``options.auto``:
    the annotations and the techniques to plan with. ``plan_probe(traced, options, annotations)``
    plans one probe on a trace (the planner's stages after tracing: the search decides, the
    planner plans); ``options``: the user's ap.PlanOptions, whose techniques are kept (the
    user's checkpointing is costed as its mode on every block, the user's context parallel fixes
    its axis, method and order; ``split_before``: the user's stage boundaries); ``precision``: a
    precision policy's dtypes (``param_dtype``, ...) for the data parallel it picks where the
    user gave none (its gathered blocks estimated in ``param_dtype``, as the plan will gather them)."""
    t0 = time.perf_counter()
    ctx = SearchContext.of(model, mesh, traced, annotations, options, plan_probe, precision)
    structs = candidate_structures(ctx)
    modes = ctx.space(ctx.variant_technique()) if ctx.variant_technique() is not None else [None]
    probes = Probes(ctx, modes)
    weighed = weigh(ctx, structs, probes, modes)
    if not weighed:
        raise NoPlanError(
            f"ap.plan(auto=...): no axis assignment of mesh {mesh} could be planned "
            "(batch or layer sizes not divisible by the axes?). Plan by hand."
        )
    best, record = _choose(ctx, weighed, len(probes))
    ann, chosen = _planned(ctx, best, record, weighed)
    record["search_s"] = time.perf_counter() - t0
    return ann, chosen, record


def candidate_structures(ctx) -> list:
    """The structures the search weighs: every role assignment the constraints allow, less what the
    user's techniques rule out and the context-parallel ones that cannot win (_undominated)."""
    mesh, auto = ctx.mesh, ctx.auto
    dp_t, pp_t, cp_t = ctx.technique("dp"), ctx.technique("pp"), ctx.technique("cp")
    dp, pipeline, context = ctx.user("dp"), ctx.user("pp"), ctx.user("cp")
    fixed_dp = mesh.axis_index(dp.data_axis()) if dp is not None and dp.data_axis() is not None else None
    if context is not None and not isinstance(context.method, str):
        raise PlanError(
            f"ap.plan(auto=...) with the hybrid {context}: the search does not take a user's hybrid context "
            "parallel (its two axes are planned as one); plan it by hand, or leave context_parallel= out: "
            "the search offers hybrid itself where two adjacent axes are free (docs/auto.md)."
        )
    cp_methods, balanced = cp_t.search_methods(ctx.facts, auto)
    allow_sp = auto.sequence_parallel and bool(ctx.norms)
    allow_pp = pp_t.search_offered(auto)
    structs = structures(mesh, allow_sp, fixed_dp, ctx.fixed_tp, True, allow_pp, cp_methods, balanced)
    if pipeline is not None:  # the user's pipeline axis
        structs = [s for s in structs if s.pp == mesh.axis_index(pipeline.axis)]
    if context is not None:  # the user's context-parallel axis
        structs = [s for s in structs if s.cp == mesh.axis_index(context.axis) and s.cp_inner is None]
    if dp is not None and dp.shard_axes is not None:  # the user's fold: its cp axis (and no dp axis without one)
        folds = dp.fold_axes(mesh)
        structs = [s for s in structs if s.cp in folds and s.can_fold() and (dp.axis is not None or s.dp is None)]
        if not structs:
            raise NoPlanError(
                f"ap.plan(auto=...) with {dp}: no structure puts context parallel on the folded axes "
                f"{[mesh.axis_names[a] for a in folds]} (the search's ap.Auto(context_parallel=...) methods, and "
                "the model's sequence inputs, decide where it may): allow context parallel there, or leave shard_axes out."
            )
    if context is None:
        folding = dp_t.search_may_fold(mesh, ctx.facts, auto)
        floor = state_floor(ctx.model, auto)
        structs = _undominated(structs, mesh, ctx.facts.batch, floor, auto.memory_budget, folding)
    if dp is not None:  # the user's data parallel: over their axes only
        fixed_rep = mesh.axis_index(dp.replicate_axis) if dp.replicate_axis is not None else None
        structs = [s for s in structs if s.rep == fixed_rep]
    return structs


def _choose(ctx, options: list, n_probes: int) -> tuple:
    """(the solution planned, its record): the fastest option that fits, or the one
    ``ap.Auto(option=...)`` names."""
    auto, mesh, profile = ctx.auto, ctx.mesh, ctx.profile
    fastest = solve(options, auto.memory_budget, profile.overlap)
    best = fastest if auto.option is None else named(ctx, options)
    if best is None:
        least = min(least_memory(o) for o in options)
        raise NoPlanError(
            f"ap.plan(auto=ap.Auto(memory_budget={auto.memory_budget:.4g})): no plan fits; the "
            f"least memory per rank any option needs is {least:.4g} B. Raise the budget, "
            "use a larger mesh or a smaller batch."
        )
    record = record_of(ctx, best, options, n_probes)
    if auto.option is not None:  # a runner-up planned on request: what the search itself would choose
        record["asked"] = auto.option
        record["search_choice"] = None if fastest is None else label_of(mesh, fastest.option)
    return best, record


def _planned(ctx, best, record: dict, options: list) -> tuple[dict, dict]:
    """(annotations, {technique name: value}) of solution ``best``: its components' annotations on
    the tp axis (sequence parallel's norms too), the experts', and each technique's choice."""
    mesh = ctx.mesh
    s, dp, mode, pipe, paths = best.option
    uses_tp = [best.choices.get(c.key) == "split" for c in ctx.dense] + [
        best.choices.get(c.key) == "ep+tp" for c in ctx.experts
    ]
    if s.tp is not None and ctx.fixed_tp is None and not any(uses_tp):
        s = s.without_tp()  # nothing split on it: the axis is replicated
        record["chosen"] = label_of(mesh, (s, dp, mode, pipe, paths)) + " (the tp axis split nothing)"
    record["duplicated"] = duplicated_axes(ctx, s, options)
    ann = dict(ctx.annotations)
    if s.tp is not None:
        name = mesh.axis_names[s.tp]
        for c in ctx.dense:
            if best.choices.get(c.key) == "split":
                ann.update(c.annotations(name, s.sp))
        if s.sp:
            ann.update({k: v for k, v in sp_annotations(ctx.norms, name).items() if k not in ctx.annotations})
    for c in ctx.experts:
        if best.choices.get(c.key) in ("ep", "ep+tp"):
            expert_tp = mesh.axis_names[s.tp] if best.choices[c.key] == "ep+tp" else None
            ann.update(c.annotations(mesh.axis_names[s.dp], False, tp=expert_tp))
    context = ctx.user("cp")
    chosen = {
        ctx.technique("dp").name: dp,
        ctx.technique("pp").name: pipe,
        ctx.technique("cp").name: context if context is not None else s.context_parallel(mesh),
        "split_before": paths or tuple(ctx.facts.split_before),
    }
    variant = ctx.variant_technique()
    if variant is not None:
        chosen[variant.name] = mode
    for cls in TECHNIQUES.values():  # what the pricing needs beside them (float8's Linears)
        added = cls.search_adds(ctx.model, chosen, ctx.auto)
        if added is not None:
            chosen[cls.name] = added
    return ann, chosen


def _undominated(structs: list, mesh, batch, floor: float = 0.0, budget=None, folding: bool = False) -> list:
    """``structs`` without the context-parallel ones that cannot win, left out unprobed (at 512
    ranks most cp structures are such):
    - data parallel on the same axis beats it where the batch rows also divide over that axis as
      data parallel (the axis alone, or joined to the dp axis next to it) and such a structure is
      among ``structs``: it splits the same compute and activations, its gradient sync is the one
      cp runs too (the parameters are replicated on a cp axis), it can shard the state (ZeRO),
      and it has no K/V to move;
    - it cannot fit: the training state (``floor`` bytes: parameters, gradients, optimizer
      state) spread over every rank of its dp, tp and pp axes (the most any option shards it:
      ZeRO-3 over dp; a cp axis keeps it whole unless ZeRO may fold it in, ``folding``) is more
      than ``budget`` per rank."""
    plain = {(s.dp, s.rep, s.tp, s.sp, s.pp) for s in structs if s.cp is None}

    def size(*axes):
        n = 1
        for a in axes:
            n *= mesh.shape[a] if a is not None else 1
        return n

    out = []
    for s in structs:
        if s.cp is not None and s.cp_inner is None and batch is not None:  # (hybrid splits over two axes)
            a = s.cp
            alternatives = []
            if s.dp is None:
                alternatives.append((a, None, s.tp, s.sp, None))
            elif s.rep is None and a == s.dp - 1:
                alternatives.append((s.dp, a, s.tp, s.sp, None))
            elif s.rep is None and a == s.dp + 1:
                alternatives.append((a, s.dp, s.tp, s.sp, None))
            if any(alt in plain and batch % size(alt[0], alt[1]) == 0 for alt in alternatives):
                continue
        shards = size(s.dp, s.rep, s.tp, s.pp, s.cp if folding and s.can_fold() else None)
        if s.cp is not None and budget is not None and floor / shards > budget:
            continue
        out.append(s)
    return out
