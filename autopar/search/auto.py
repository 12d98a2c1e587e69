"""ap.plan(..., auto=...): probe plans on the one trace, cost them by component, solve, annotate.

1. components (candidates.py): the Megatron pairs and the vocabulary, found from the graph.
2. probes: for each axis-role structure, the plan with every free component split on the tp
   axis (and, once per dp axis, the plan with none split); each is an ordinary propagation on
   the same traced graph, costed by evaluate.plan_terms, node by node attributed to components.
3. the MILP (solver.py) over structures x ZeRO levels x component choices, under the budget.
4. the annotations and ap.DataParallel of the solution go back to ap.plan, which plans them
   as if the user had written them; the reasons and the runners-up go in plan.built["auto"].

Constraints: ``data_parallel=`` fixes the dp axis (its ZeRO level too when it is not 0);
annotations are kept as written, the components they touch are not searched, and an axis
they name is the tp axis.

Example:
    >>> plan = ap.plan(model, mesh, kwargs=batch, auto=ap.Auto(memory_budget=2**30))
    >>> print(plan.explain("auto"))
"""

from __future__ import annotations

import dataclasses
import fnmatch
import time
import warnings

import torch

from autopar.cost.activation_memory import saved_activations, share_saved_activations
from autopar.cost.float8 import lm_heads
from autopar.options import PlanOptions
from autopar.parallel.data_parallel.technique import DataParallel
from autopar.parallel.activation_checkpoint.technique import ActivationCheckpoint
from autopar.parallel.float8 import Float8
from autopar.parallel.pipeline.options import Pipeline
from autopar.parallel.pipeline.schedules import V_SHAPED
from autopar.errors import PlanError
from autopar.search.candidates import components, sp_annotations, structures
from autopar.search.evaluate import Terms, plan_terms
from autopar.search.options import Auto
from autopar.search.short import copied, reweighed, shortened
from autopar.search.solver import Option, solve
from autopar.trace.module_paths import module_path
from autopar.trace.model_members import named_modules


class NoPlanError(PlanError):
    """No plan the search may choose fits: the memory budget is too small, or constraints clash."""


def search(
    model,
    mesh,
    traced,
    annotations,
    dp,
    auto,
    ndims,
    strict,
    plan_probe,
    pipeline=None,
    checkpoint=None,
    context=None,
    split_before=(),
    precision=None,
):
    """(annotations, {technique name: its value}, record) of the best plan under ``auto``: the
    annotations, ``data_parallel``, ``pipeline``, ``activation_checkpoint`` and
    ``context_parallel`` to plan with. ``plan_probe(traced, options, annotations)`` plans one
    probe on a trace (the planner's stages after tracing: the search decides, the planner
    plans); ``dp`` / ``pipeline`` / ``checkpoint`` / ``context``: the user's, kept (the user's
    checkpointing is costed as its mode on every block, the user's context parallel fixes its
    axis, method and order; ``split_before``: the user's stage boundaries); ``precision``: a
    precision policy's dtypes (``param_dtype``, ...) for the data parallel it picks where the user
    gave none (its gathered blocks estimated in ``param_dtype``, as the plan will gather them)."""
    t0 = time.perf_counter()
    auto = Auto.of(auto)
    profile = auto.profile(job_device(traced))
    user = dict(annotations or {})
    comps, norms = components(model, traced)
    touched = {c.key for c in comps if _touched(c, user, model)}
    free = [c for c in comps if c.key not in touched]
    if not auto.expert_parallel:
        free = [c for c in free if c.kind != "experts"]
    dense = [c for c in free if c.kind != "experts"]  # decided on the tp axis
    experts = [c for c in free if c.kind == "experts"]  # decided on the dp axis
    comp_of = {n: c.key for c in free for n in c.nodes}
    param_comp = {p: c.key for c in free for p in c.params}
    user_axes = {a.axis for a in user.values() if getattr(a, "axis", None) is not None}
    if len(user_axes) > 1:
        raise PlanError(
            f"ap.plan(auto=...): the annotations name the axes {sorted(user_axes)}; the search "
            "uses one tensor-parallel axis. Annotate one axis, or plan without auto."
        )
    fixed_tp = mesh.axis_index(user_axes.pop()) if user_axes else None
    fixed_dp = mesh.axis_index(dp.axis) if dp is not None and dp.axis is not None else None
    if context is not None and not isinstance(context.method, str):
        raise PlanError(
            f"ap.plan(auto=...) with the hybrid {context}: the search does not take a user's hybrid context "
            "parallel (its two axes are planned as one); plan it by hand, or leave context_parallel= out: "
            "the search offers hybrid itself where two adjacent axes are free (docs/auto.md)."
        )
    cp_methods, balanced = _context_options(traced, comps, auto, context)
    structs = structures(
        mesh, auto.sequence_parallel and bool(norms), fixed_dp, fixed_tp, True, auto.pipeline, cp_methods, balanced
    )
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
    batch = batch_size(traced)
    if context is None:
        folding = any(z for z, _, fold in _storages(None, mesh, dp, auto) if fold)
        structs = _undominated(structs, mesh, batch, _state_floor(model, auto), auto.memory_budget, folding)
    modes = (checkpoint,) if checkpoint is not None else (tuple(auto.activation_checkpoint) or (None,))
    if dp is not None:  # the user's data parallel: over their axes only
        fixed_rep = mesh.axis_index(dp.replicate_axis) if dp.replicate_axis is not None else None
        structs = [s for s in structs if s.rep == fixed_rep]
    base_dp = dp or DataParallel(mesh.axis_names[0], **(precision or {}))
    probes: dict = {}
    planned: dict = {}  # probe plans by layout (a context-parallel method is an option of the same layouts)
    short = shortened(traced)  # probes plan two blocks of a repeated stack, weighted (short.py)
    graph_for, weights = (short[0], short[1:]) if short is not None else (copied(traced), ({}, {}))
    blocks = getattr(getattr(traced, "repeated", None), "count", 0)  # a repeated stack's blocks
    rewritten: dict = {}  # context parallel's probes: the graph its prepare_graph rewrote, and weights

    def graph_of(cp):
        """The probe graph and weights for the context-parallel technique ``cp`` (or none): cp
        rewrites eager attention into SDPA before planning (prepare_graph), on its own copy,
        whose new nodes in a shortened stack's block 1 stand for n - 1 blocks too."""
        if cp is None:
            return graph_for, weights
        if not rewritten:
            g = copied(graph_for)
            cp.prepare_graph(g)
            rewritten["graph"] = (g, reweighed(g, weights))
        return rewritten["graph"]

    def probe(s, tp_axis, sp, ep=False):
        key = (s.dp, s.rep, tp_axis, sp, ep, s.cp, s.cp_inner, s.cp_method)
        if key not in probes:
            ann = dict(user)
            if tp_axis is not None:
                name = mesh.axis_names[tp_axis]
                for c in dense:
                    if c.kind != "vocab" or auto.vocab_parallel or sp:
                        ann.update(c.annotations(name, sp))
                if sp:
                    ann.update({k: v for k, v in sp_annotations(norms, name).items() if k not in user})
            if ep:  # True: expert parallel on dp; "tp": and each expert split over the tp axis
                expert_tp = mesh.axis_names[tp_axis] if ep == "tp" else None
                for c in experts:
                    ann.update(c.annotations(mesh.axis_names[s.dp], False, tp=expert_tp))
            cp = s.context_parallel(mesh)
            graph, w = graph_of(cp)
            probes[key] = _probe(
                plan_probe,
                mesh,
                graph,
                ann,
                s.data_parallel(mesh, DataParallel(mesh.axis_names[0]), 0, None),
                strict,
                comp_of,
                param_comp,
                profile,
                auto.optimizer_states,
                w,
                modes,
                [c.module for c in experts],
                cp,
                (planned, key[:-1]),
            )
        return probes[key]

    cuts: dict = {}  # the stages ap.plan would cut, per stage count and balance
    share_of: dict = {}  # each pipeline's step shares, its stages costed each from their own nodes

    def stage_cut(pipe, balance):
        # by sizes: the cut is the same whichever axis of that size holds the stages
        key = (mesh.axis_size(pipe.axis), pipe.chunks, balance, pipe.microbatches if balance == "memory" else None)
        key += (pipe.kind in V_SHAPED,)  # a V places the stages on other ranks (the cut's rank_of_stage)
        if key not in cuts:
            try:
                cuts[key] = pipe.cut(traced, mesh, split_before, balance)
            except PlanError:
                cuts[key] = None
        return cuts[key]

    def pipe_variants(pipe):
        """[(split_before paths or () for ap.plan's own cut, the pipeline's step shares)]: the
        runtime's cut (time-balanced), and for 1F1B the memory-balanced one where it differs
        (stage s holds min(m, pp - s) micro-batches: fewer layers on the first stages)."""
        out = []
        for balance in ("time",) + (("memory",) if pipe.kind == "1f1b" and not split_before else ()):
            lay = stage_cut(pipe, balance)
            if lay is None:
                continue
            paths = () if balance == "time" else lay.cut_paths
            if balance == "memory" and (
                not all(paths) or len(set(paths)) != len(paths) or out and lay.cut_paths == out[0][2]
            ):
                continue  # the same cut, or one split_before cannot name
            key = (mesh.axis_size(pipe.axis), pipe.chunks, pipe.microbatches, pipe.kind, paths)  # by sizes
            if key not in share_of:
                share_of[key] = {k: v for k, v in pipe.step_shares(mesh, lay).items() if k != "sends"}
            shares = {**share_of[key], "sends": pipe.step_shares(mesh)["sends"]}  # the sends on its own axis
            out.append((paths, shares, lay.cut_paths))
        return [(paths, shares) for paths, shares, _ in out]

    options = []
    for s in structs:
        ep = _expert_parallel_ok(s, mesh, experts)
        split_by = probe(s, s.tp, s.sp, ep) if s.tp is not None or ep else None
        if split_by is None and ep:  # experts the dispatch cannot run (refused): the rest still searched
            ep = False
            split_by = probe(s, s.tp, s.sp) if s.tp is not None else None
        rep_by = probe(s, None, False) if not s.sp else None
        if (s.tp is not None and split_by is None) or (rep_by is None and split_by is None):
            continue
        # expert tensor parallelism: the experts dispatched on dp and each split over tp (a probe
        # of its own: the rest of the plan as the split probe's; what it changes outside the
        # experts' region, as the layouts after their partial sum, is charged to the choice: _moved)
        ept = ep and s.tp is not None and auto.expert_tensor_parallel
        ept_by = probe(s, s.tp, s.sp, "tp") if ept else None
        pipes = _pipelines(s, mesh, batch, pipeline, blocks, auto.pipeline_schedules)
        if s.pp is not None and not pipes:
            continue  # fewer rows per data-parallel rank than one micro-batch per stage
        for mode in modes:
            split, rep, ept = (split_by or {}).get(mode), (rep_by or {}).get(mode), (ept_by or {}).get(mode)
            if (split_by is not None and split is None) or (rep_by is not None and rep is None):
                continue  # no block to checkpoint
            base = (split or rep).get("base", Terms())
            if split is not None and rep is not None and "base" in rep and rep["base"].peak > base.peak:
                # a block's recompute (and a workspace) at the step's peak: a component the solver leaves
                # whole recomputes its block whole, so the larger of the two probes' (an upper bound
                # where every block is split); the split probe's alone read 545 KB against the
                # plan's 662 KB on a tiny GPT under full checkpointing, its blocks left whole
                base = dataclasses.replace(base, peak=rep["base"].peak)
            for z in _storages(s, mesh, dp, auto):
                for pipe in pipes or [None]:
                    # each way of cutting the stages (none where the graph cannot be cut)
                    for paths, shares in pipe_variants(pipe) if pipe is not None else [((), None)]:
                        label = (s, z, mode, pipe, paths)
                        options.append(_option(label, base_dp, base, free, split, rep, mesh, profile, ep, shares, ept))
    if not options:
        raise NoPlanError(
            f"ap.plan(auto=...): no axis assignment of mesh {mesh} could be planned "
            "(batch or layer sizes not divisible by the axes?). Plan by hand."
        )
    fastest = solve(options, auto.memory_budget, profile.overlap)
    best = fastest if auto.option is None else _named(options, auto, mesh, profile)
    if best is None:
        least = min(_least_memory(o) for o in options)
        raise NoPlanError(
            f"ap.plan(auto=ap.Auto(memory_budget={auto.memory_budget:.4g})): no plan fits; the "
            f"least memory per rank any option needs is {least:.4g} B. Raise the budget, "
            "use a larger mesh or a smaller batch."
        )
    record = _record(mesh, auto, profile, best, options, free, touched, 0.0, len(probes))
    if auto.option is not None:  # a runner-up planned on request: what the search itself would choose
        record["asked"] = auto.option
        record["search_choice"] = None if fastest is None else _label(mesh, fastest.option)
    s, storage, mode, pipe, paths = best.option
    uses_tp = [best.choices.get(c.key) == "split" for c in dense] + [
        best.choices.get(c.key) == "ep+tp" for c in experts
    ]
    if s.tp is not None and fixed_tp is None and not any(uses_tp):
        s = dataclasses.replace(s, tp=None, sp=False)  # nothing split on it: the axis is replicated
        record["chosen"] = _label(mesh, (s, storage, mode, pipe, paths)) + " (the tp axis split nothing)"
    record["duplicated"] = _duplicated_axes(mesh, s, options, auto, profile)
    ann = dict(user)
    if s.tp is not None:
        name = mesh.axis_names[s.tp]
        for c in dense:
            if best.choices.get(c.key) == "split":
                ann.update(c.annotations(name, s.sp))
        if s.sp:
            ann.update({k: v for k, v in sp_annotations(norms, name).items() if k not in user})
    for c in experts:
        if best.choices.get(c.key) in ("ep", "ep+tp"):
            expert_tp = mesh.axis_names[s.tp] if best.choices[c.key] == "ep+tp" else None
            ann.update(c.annotations(mesh.axis_names[s.dp], False, tp=expert_tp))
    chosen = {
        "data_parallel": s.data_parallel(mesh, base_dp, *storage),
        "pipeline": pipe,
        "activation_checkpoint": checkpoint if checkpoint is not None else _checkpointing(mode),
        "context_parallel": context if context is not None else s.context_parallel(mesh),
        "split_before": paths or tuple(split_before),
    }
    if auto.float8:  # priced with the Linears in float8 (cost/float8.py): the plan runs them so,
        # and a zero=3 plan gathers their weights in fp8, as it was priced (evaluate.Terms._fp8_share)
        gathers = chosen["data_parallel"] is not None and chosen["data_parallel"].storage.gathers_params
        chosen["float8"] = Float8("tensorwise", skip=lm_heads(model), fp8_all_gather=gathers)
    record["search_s"] = time.perf_counter() - t0
    return ann, chosen, record


def _touched(comp, user, model) -> bool:
    pats = comp.patterns
    paths = [p for p, _ in named_modules(model) if any(fnmatch.fnmatchcase(p, q) for q in pats)]
    return any(fnmatch.fnmatchcase(p, u) for p in paths for u in user) or any(
        fnmatch.fnmatchcase(n, u) for n in comp.params for u in user
    )


def _storages(s, mesh, dp, auto) -> list[tuple]:
    """(zero, shard_size, fold) the search may pick for structure ``s`` (None: any structure
    that can fold): the allowed ZeRO levels (the user's when given); zero=3 over two axes both
    as HSDP (sharded on the inner axis, replicated on the outer) and sharded over both; and,
    where ``s`` has a cp axis ZeRO may fold in (Structure.can_fold), each level >= 1 also over
    dp x cp (over cp alone without a dp axis): the state sharded over more ranks, its sync one
    group over both instead of dp's and cp's apart. The user's ``shard_axes`` folds only; a
    user's level without them does not fold (the user chose the storage)."""
    zeros = (dp.zero,) if dp is not None and dp.zero else (tuple(auto.zero) or (0,))
    user_fold = dp is not None and dp.shard_axes is not None
    folds = (True,) if user_fold else (False, True) if dp is None or not dp.zero else (False,)
    can_fold = s is None or s.can_fold()
    out = []
    for fold in folds:
        if fold and not can_fold:
            continue
        if s is not None and s.dp is None:  # no data parallel: ZeRO only folded over cp
            out += [(z, None, True) for z in zeros if z and fold] if fold else [(0, None, False)]
            continue
        for z in zeros:
            if fold and not z:
                continue  # folding shards ZeRO's state: no level, nothing to fold
            if z == 3 and s is not None and s.rep is not None:
                shards = (
                    (dp.shard_size,)
                    if dp is not None and dp.shard_size
                    else (mesh.shape[s.dp], mesh.shape[s.dp] * mesh.shape[s.rep])
                )
                out += [(3, k, fold) for k in shards]
            else:
                out.append((z, dp.shard_size if dp is not None and z == 3 else None, fold))
    return out


def _probe(
    plan_probe,
    mesh,
    traced,
    ann,
    dp,
    strict,
    comp_of,
    param_comp,
    profile,
    states,
    weights,
    modes,
    moe=(),
    cp=None,
    planned=({}, None),
):
    """{checkpointing mode: the probe plan's Terms per component} (None when it cannot be
    planned; a mode missing when the plan has no block to checkpoint). The checkpointed
    variants are the same layouts under other options (Plan.with_options: no propagation).
    ``moe``: the experts components' module patterns, whose nodes planning made anew (each
    experts module became one moe_experts node): attributed to them by module path. ``cp``:
    the context parallel to plan with; ``planned``: (plans by layout key, this probe's key):
    another attention method of the same layouts is the planned plan under other options."""
    cache, key = planned
    try:
        if cp is not None and key in cache:
            plan = cache[key]
        else:
            plan = plan_probe(traced, PlanOptions(data_parallel=dp, strict=strict, context_parallel=cp), ann)
            if cp is not None:  # kept for the other attention method (no other probe is kept: memory)
                if not plan.built.get("context_parallel"):
                    plan = None  # no attention met the split sequence: not context parallel, only a split
                cache[key] = plan
        if plan is None:
            return None
        if plan.options.context_parallel != cp:
            saves = saved_activations(plan)
            plan = plan.with_options(plan.options.replace(context_parallel=cp))
            share_saved_activations(plan, saves)  # same graph and layouts: the same saved tensors
    except PlanError:
        if cp is not None:
            cache.setdefault(key, None)  # refused layouts (another method of planned ones may still be)
        return None
    if moe:
        comp_of = dict(comp_of)
        for node in plan.graph.nodes:
            path = module_path(node)
            key = next((m for m in moe if path and fnmatch.fnmatchcase(path, m)), None)
            if key is not None and node.name not in comp_of:
                comp_of[node.name] = key
    out, shared = {}, {}  # shared: what the checkpointing variants have in common (plan_terms)
    saves = saved_activations(plan)
    for mode in modes:
        variant = plan
        if mode is not None:
            try:
                # the plan's own options: data parallel over two axes is planned on their merged axis
                # (with the probe's options the axes differ, and every checkpointed variant of
                # such a probe was refused: two-axis data parallel was only searched without it)
                variant = plan.with_options(plan.options.replace(activation_checkpoint=_checkpointing(mode)))
            except PlanError:
                continue
            share_saved_activations(variant, saves)  # same graph and layouts: the same saved tensors
        out[mode] = plan_terms(
            variant, comp_of, profile, states, weights[0], weights[1], param_comp=param_comp, shared=shared
        )
    return out


def batch_size(traced) -> int | None:
    """Rows of the first batched input (what data parallel and micro-batches divide), at the
    example. A dynamic size is read off its hint: int() of a SymInt would guard on it, and the
    guard turns the trace's batch symbol into the number in every formula of the final plan (a
    pipeline's micro-batches then counted at the whole batch: m times their activations)."""
    for name in traced.user_inputs:
        val = traced.placeholders()[name].meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            size = val.shape[0]
            if isinstance(size, torch.SymInt):
                hint = size.node.hint
                return int(hint) if hint is not None else None  # None: a symbolic size without a hint
            return int(size)
    return None


INTERLEAVE = (2, 4)  # model chunks per pipeline rank the search tries besides 1F1B's one
SCHEDULE_LABELS = {"zb-h1": "ZB-H1", "zbv": "ZBV", "dualpipev": "DualPipeV"}


def _pipelines(s, mesh, batch, user, blocks: int = 0, kinds=("1f1b", "interleaved")) -> list:
    """The pipelines of structure ``s``: the user's, or over its pp axis with one micro-batch per
    row of a data-parallel rank's batch (the fewest idle slots, the least in flight), under the
    schedules ``kinds`` (ap.Auto's pipeline_schedules): 1F1B; the interleaved 1F1B with v model
    chunks per rank (a bubble of (pp - 1) / v micro-batch slots instead of pp - 1, v times the
    point-to-point sends, more in flight) where the micro-batches come in groups of pp (the
    schedule needs it); ZB-H1 (1F1B's order, each W deferred into the bubble); ZBV (two chunks in
    a V, B/W split) and DualPipeV (ZBV's V in DualPipe's order, m >= 2pp). Several chunks per rank
    need at least one block per stage (pp x v of them). [] when ``s`` has no pp axis or the rows
    are too few for one micro-batch per stage."""
    if s.pp is None:
        return []
    if user is not None:
        return [user]
    dp_size = (mesh.shape[s.dp] if s.dp is not None else 1) * (mesh.shape[s.rep] if s.rep is not None else 1)
    pp = mesh.shape[s.pp]
    if batch is None or batch % dp_size or batch // dp_size < pp:
        return []
    m, axis = batch // dp_size, mesh.axis_names[s.pp]
    out = [Pipeline(axis, microbatches=m, schedule=k) for k in ("1f1b", "zb-h1") if k in kinds]
    for v in INTERLEAVE if "interleaved" in kinds else ():
        if m % pp == 0 and pp * v <= blocks:
            out.append(Pipeline(axis, microbatches=m, schedule="interleaved", chunks=v))
    for k in V_SHAPED:
        if k in kinds and 2 * pp <= blocks and (k != "dualpipev" or m >= 2 * pp):
            out.append(Pipeline(axis, microbatches=m, schedule=k, chunks=2))
    return out


def _coefs(t: Terms, mesh, profile, dp, shares=None, base=False) -> tuple:
    """(time, sync, hide, memory) of ``t`` under ``dp`` (as a user writes it: two axes are merged
    into the one data-parallel axis the plan has) and a pipeline rank's share (``shares``, its
    step_shares; its point-to-point sends are charged once, to the ``base`` terms)."""
    if shares is not None:
        t = t.scaled(shares, mesh, profile, sends=base)
    dp_axis = None
    if dp is not None:
        mesh, dp = dp.reshape_mesh(mesh)
        dp_axis = mesh.axis_index(dp.axis) if dp.axis is not None else None  # None: ZeRO over cp alone
    sync, ahead, after = t.dp_sync(mesh, profile, dp_axis, dp)
    hide = t.hidden_behind(prefetches(dp, mesh, dp_axis))
    step = t.step_seconds(mesh, profile, dp_axis, dp)
    rest = t.other_sync(mesh, dp)  # folded: the group's reduction replaces cp's all-reduce
    return (t.compute + t.comm + after + step, sync + ahead + rest, hide, t.memory(mesh, dp_axis, dp))


def prefetches(dp, mesh, dp_axis) -> bool:
    """Whether ``dp``'s storage starts gathers ahead of their use (then the whole step's compute
    hides its communication, not only backward's)."""
    n = mesh.shape[dp_axis] if dp_axis is not None else 1
    return dp is not None and any(c[3] for c in dp.storage.step_comms(dp, n, 1.0, 1.0))


def _expert_parallel_ok(s, mesh, experts) -> bool:
    """Whether structure ``s`` may put the experts on its dp axis: one dp axis (not two: the
    dispatch runs over one axis) whose size divides every experts module's count."""
    return (
        bool(experts) and s.dp is not None and s.rep is None and all(c.experts % mesh.shape[s.dp] == 0 for c in experts)
    )


def _option(label, base_dp, base, free, split, rep, mesh, profile, ep=False, shares=None, ept=None) -> Option:
    """An option: a pair's or the vocabulary's choices ``split`` (on the tp axis, from the
    split probe) and ``R``; an experts module's ``ep`` (expert parallel on dp, from the split
    probe when ``ep``), ``ep+tp`` (and each expert split over tp, from the ``ept`` probe) and
    ``local`` (every expert on each rank: the probe without it)."""
    s, storage = label[0], label[1]
    dp = s.data_parallel(mesh, base_dp, *storage)
    comps = {}
    for c in free:
        ch = {}
        if c.kind == "experts":
            if ep and split is not None:
                ch["ep"] = _coefs(split.get(c.key, Terms()), mesh, profile, dp, shares)
            if ep and ept is not None and split is not None:
                ch["ep+tp"] = _coefs(_moved(ept, split, c.key), mesh, profile, dp, shares)
            if rep is not None or not ep:
                ch["local"] = _coefs((rep if rep is not None else split).get(c.key, Terms()), mesh, profile, dp, shares)
            comps[c.key] = ch
            continue
        if split is not None and s.tp is not None:
            ch["split"] = _coefs(split.get(c.key, Terms()), mesh, profile, dp, shares)
        if rep is not None:
            ch["R"] = _coefs(rep.get(c.key, Terms()), mesh, profile, dp, shares)
        comps[c.key] = ch
    idle = sum(1 for a, size in enumerate(mesh.shape) if size > 1 and not s.uses(a))
    # a tp axis that splits no component is replicated after all: each unsplit component counts a
    # share of an idle axis, all of them together less than one
    idle_choice = {"R": 1.0 / (sum(c.kind != "experts" for c in free) + 1)} if s.tp is not None else {}
    wrapped = int(dp is not None and not dp.storage.plain_optimizer)
    return Option(label, _coefs(base, mesh, profile, dp, shares, base=True), comps, idle, idle_choice, wrapped)


def _moved(probe: dict, ref: dict, key: str) -> Terms:
    """Component ``key``'s terms in ``probe`` plus what the rest of ``probe`` costs beyond the
    rest of ``ref`` (the same plan but for that component): expert tensor parallelism leaves the
    experts' output a partial sum over tp, which changes how the nodes after them (the residual
    add, the next norm) are laid out; charged to the choice that causes it, the options stay
    additive."""
    out = Terms().add(probe.get(key, Terms()))
    for k, t in probe.items():
        if k != key:
            out.add(t)
    for k, t in ref.items():
        if k != key:
            out.add(t, -1.0)
    out.largest_unit = out.boundary = 0.0  # maxima, not sums: the base's count
    return out


def _least_memory(o: Option) -> float:
    return o.base[3] + sum(min(v[3] for v in ch.values()) for ch in o.comps.values())


def _duplicated_axes(mesh, s, options, auto, profile) -> list[dict]:
    """The chosen plan's replicated axes (their ranks repeat each other's work), each with the
    fastest option that divides the work over it instead: data parallel on it (which always
    divides the compute), else tensor parallel on it."""
    out = []
    for a, name in enumerate(mesh.axis_names):
        if s.uses(a) or mesh.shape[a] == 1:
            continue
        using = [o for o in options if a in (o.label[0].dp, o.label[0].rep)] or [
            o for o in options if a in (o.label[0].tp, o.label[0].pp, o.label[0].cp)
        ]
        best = None
        for o in using:
            sol = solve([o], auto.memory_budget, profile.overlap)
            fits = sol is not None
            sol = sol or solve([o], None, profile.overlap)
            if sol is not None and (best is None or sol.time < best["time_s"]):
                best = {"option": _label(mesh, o.label), "time_s": sol.time, "fits": fits}
        out.append({"axis": name, "size": mesh.shape[a], "instead": best})
    return out


def job_device(traced):
    """Where the job's tensors live: the first tensor input's device (a meta-device model
    planned with real inputs runs where they are), else the parameters'."""
    for name, node in traced.placeholders().items():
        val = node.meta.get("val")
        if name in traced.user_inputs and isinstance(val, torch.Tensor):
            return val.device
    for node in traced.placeholders().values():
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return None


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


def _state_floor(model, auto) -> float:
    """Bytes of the whole model's training state as the search counts it (evaluate.py):
    parameters, their gradients and ``optimizer_states`` copies of each trained one (its dtype)."""
    total = 0.0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        if p.requires_grad:
            total += p.numel() * p.element_size() * (1 + auto.optimizer_states)
    return total


def _context_options(traced, comps, auto, context) -> tuple:
    """(the attention methods context parallel may use, whether an axis of n ranks takes the
    zig-zag order): the user's ContextParallel, else ``auto.context_parallel``'s methods where the
    model has sequence inputs (2-D or more: dim 1 split) and no experts (the expert dispatch on
    split sequences has not been run against serial); zig-zag (causal work even on every rank)
    where every sequence divides into 2n chunks."""
    if context is not None:
        return (context.method,), lambda n: context.load_balance
    lengths = _sequence_lengths(traced)
    if not lengths or any(c.kind == "experts" for c in comps):
        return (), lambda n: False
    return tuple(auto.context_parallel), lambda n: all(length % (2 * n) == 0 for length in lengths)


def _sequence_lengths(traced, seq_dim: int = 1) -> list[int]:
    """Dim ``seq_dim`` of every user input of more dims (what ap.ContextParallel splits)."""
    out = []
    for name in traced.user_inputs:
        val = traced.placeholders()[name].meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > seq_dim:
            size = val.shape[seq_dim]
            hint = size.node.hint if isinstance(size, torch.SymInt) else size
            if hint is None:
                return []  # a symbolic length without a hint: cannot be checked, not searched
            out.append(int(hint))
    return out


def _named(options: list, auto, mesh, profile):
    """The solution of the option ``auto.option`` names (a runners-up label), within the budget
    where it fits, else without it (a refused option is planned to be explained too)."""
    named = [o for o in options if _label(mesh, o.label) == auto.option]
    if not named:
        labels = sorted({_label(mesh, o.label) for o in options})
        raise PlanError(
            f"ap.Auto(option={auto.option!r}): the search weighed no such option on {mesh}; its "
            f"{len(labels)} options are: {'; '.join(labels)}. Pass one of them (plan.explain('auto') lists "
            "the fastest), or leave option out to plan the fastest."
        )
    return solve(named, auto.memory_budget, profile.overlap) or solve(named, None, profile.overlap)


def _label(mesh, option) -> str:
    s, (zero, shard, fold), mode, pipe, paths = option
    label = s.roles(mesh)
    if s.dp is not None or fold:
        label += f", ZeRO-{zero}"
        if shard is not None and s.rep is not None:
            label += " sharded over both" if shard == mesh.shape[s.dp] * mesh.shape[s.rep] else " HSDP"
        if fold:  # ZeRO's shard group over dp x cp (torchtitan's dp_shard_cp)
            label += " folded over " + "*".join(mesh.axis_names[a] for a in (s.dp, s.cp) if a is not None)
    if s.cp is not None:
        method = s.cp_method if s.cp_inner is None else "+".join(s.cp_method)  # hybrid: "ring+ulysses"
        label += f", cp {method}" + (" zig-zag" if s.cp_balanced else "")
    if pipe is not None and pipe.kind == "interleaved":
        label += f", interleaved 1F1B x{pipe.chunks}"
    elif pipe is not None and pipe.kind in SCHEDULE_LABELS:
        label += ", " + SCHEDULE_LABELS[pipe.kind]
    if paths:
        label += ", stages balanced for memory"
    return label + (f", {_checkpointing(mode).label()} checkpointing" if mode else "")


def _checkpointing(mode) -> ActivationCheckpoint | None:
    """A checkpointing choice of the search (a mode name or an ap.ActivationCheckpoint) as the technique."""
    return mode if mode is None or isinstance(mode, ActivationCheckpoint) else ActivationCheckpoint(mode)


def settle_memory(plan, record: dict, optimizer_states: int = 2) -> dict:
    """The search's record with the chosen plan's memory as the plan holds it: ``memory``, the
    total of the rank that holds the most (plan.memory_per_rank, what plan.cost() and ap.predict
    say), ``memory_estimate``, the figure the search weighed (a pipeline's from its step shares,
    search/evaluate.py). Where the plan holds more than the budget, a warning says by how much."""
    rank = plan.peak_memory_rank(optimizer_states)
    held = float(plan.memory_per_rank(rank, optimizer_states).total)
    out = dict(record, memory=held, memory_rank=rank, memory_estimate=record["memory"])
    budget = record.get("budget")
    if budget is not None and held > budget:
        warnings.warn(
            f"ap.plan(auto=...): the chosen plan ({record['chosen']}) holds {held:.4g} B on rank {rank}, over the "
            f"memory budget of {budget:.4g} B: the search estimated {record['memory']:.4g} B "
            "(plan.memory_per_rank(rank) has the parts). Lower the budget by the difference to plan within it.",
            stacklevel=3,
        )
    return out


def _record(mesh, auto, profile, best, options, free, touched, seconds, n_probes) -> dict:
    """What plan.explain("auto") prints (JSON, saved with the plan)."""
    runners = []
    for o in options:  # each option's own optimum: what choosing it instead would cost
        sol = solve([o], auto.memory_budget, profile.overlap)
        runners.append(
            {
                "option": _label(mesh, o.label),
                "time_s": sol.time if sol else None,
                "memory": sol.memory if sol else _least_memory(o),
                "fits": sol is not None,
            }
        )
    runners.sort(key=lambda r: (r["time_s"] is None, r["time_s"] or 0.0))
    chosen = next(o for o in options if o.label == best.option)
    label = _label(mesh, best.option)
    runner_up = next((r for r in runners if r["fits"] and r["option"] != label), None)
    binding = None  # the budget binds when a faster plan exists that it refuses
    if auto.memory_budget is not None:
        fastest = solve(options, None, profile.overlap)
        if fastest is not None and fastest.time < best.time * (1 - 1e-9):
            over = {"option": _label(mesh, fastest.option), "time_s": fastest.time, "memory": fastest.memory}
            binding = {"constraint": "memory budget", "faster": over}
    comps = []
    for c in free:
        opts = {k: {"time_s": v[0], "sync_s": v[1], "memory": v[3]} for k, v in chosen.comps[c.key].items()}
        pats = sorted(set(c.patterns))
        comps.append(
            {"key": c.key, "what": c.describe(), "choice": best.choices[c.key], "options": opts, "patterns": pats}
        )
    return {
        "chosen": _label(mesh, best.option),
        "chosen_option": _label(mesh, best.option),  # "chosen" may say more (the tp axis split nothing)
        "time_s": best.time,
        "memory": best.memory,
        "budget": auto.memory_budget,
        "profile": dataclasses.asdict(profile),
        "components": comps,
        "constrained": sorted(touched),
        "runners_up": runners[:12],
        "runner_up": runner_up,
        "binding": binding,
        "solver": "scipy.optimize.milp (HiGHS)",
        "search_s": seconds,
        "probes": n_probes,
        "options": len(options),
    }
