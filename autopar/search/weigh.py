"""The solver's options: each structure x the techniques' choices on it, costed from its probes.

An option's label is ``(structure, data parallel, checkpointing, pipeline, stage paths)``: the
structure's roles and the choice of each technique on it (the data-parallel and pipeline
techniques' ``search_space`` for the structure, the variant technique's modes, the pipeline's
ways of cutting the stages). Its coefficients, per component choice, are (time, sync, hide,
memory at each moment of the step) of evaluate.Terms under that data parallel and pipeline rank's
share (solver.py).

Example:
    >>> options = weigh(ctx, structs, Probes(ctx, modes), modes)
    >>> label_of(mesh, options[0].label)          # 'a=dp, b=tp, ZeRO-1'
"""

from __future__ import annotations

import dataclasses
import itertools

from autopar.search.evaluate import PEAKS, Terms
from autopar.search.solver import Option, memory_rows


def weigh(ctx, structs: list, probes, modes: list) -> list[Option]:
    """Every option of ``structs`` that its probes could plan."""
    options = []
    cuts: dict = {}  # the pipeline technique's cuts and step shares, kept across structures (by sizes)
    for s in structs:
        found = _probed(ctx, s, probes)
        if found is None:
            continue
        split_by, rep_by, ept_by, ep = found
        pipes = ctx.space(ctx.technique("pp"), s)
        if s.pp is not None and not pipes:
            continue  # fewer rows per data-parallel rank than one micro-batch per stage
        storages = ctx.space(ctx.technique("dp"), s)
        for mode in modes:
            split, rep, ept = (split_by or {}).get(mode), (rep_by or {}).get(mode), (ept_by or {}).get(mode)
            if (split_by is not None and split is None) or (rep_by is not None and rep is None):
                continue  # no block to checkpoint
            base = _base(split, rep)
            for dp in storages:
                for pipe in pipes or [None]:
                    if not _pair(mode, pipe):
                        continue  # a pair the cost model cannot price (Technique.pairs_with)
                    # each way of cutting the stages (none where the graph cannot be cut)
                    for paths, shares in _variants(ctx, pipe, cuts):
                        label = (s, dp, mode, pipe, paths)
                        options.append(_option(ctx, label, base, split, rep, ep, shares, ept))
    return options


def _pair(a, b) -> bool:
    """Whether two techniques' choices may share an option (each may refuse the other)."""
    return a is None or b is None or (a.pairs_with(b) and b.pairs_with(a))


def _probed(ctx, s, probes) -> tuple | None:
    """(split probe, replicated probe, expert-tensor-parallel probe, experts on dp) of ``s``, or
    None where its probes could not be planned."""
    ep = _expert_parallel_ok(s, ctx.mesh, ctx.experts)
    split_by = probes.get(s, s.tp, s.sp, ep) if s.tp is not None or ep else None
    if split_by is None and ep:  # experts the dispatch cannot run (refused): the rest still searched
        ep = False
        split_by = probes.get(s, s.tp, s.sp) if s.tp is not None else None
    rep_by = probes.get(s, None, False) if not s.sp else None
    if (s.tp is not None and split_by is None) or (rep_by is None and split_by is None):
        return None
    # expert tensor parallelism: the experts dispatched on dp and each split over tp (a probe
    # of its own: the rest of the plan as the split probe's; what it changes outside the
    # experts' region, as the layouts after their partial sum, is charged to the choice: _moved)
    ept = ep and s.tp is not None and ctx.auto.expert_tensor_parallel
    ept_by = probes.get(s, s.tp, s.sp, "tp") if ept else None
    return split_by, rep_by, ept_by, ep


def _base(split, rep) -> Terms:
    base = (split or rep).get("base", Terms())
    if split is not None and rep is not None and "base" in rep and _transient(rep["base"]) > _transient(base):
        # a block's recompute (and a workspace) at the step's peak: a component the solver leaves
        # whole recomputes its block whole, so the larger of the two probes' (an upper bound
        # where every block is split); the split probe's alone read 545 KB against the
        # plan's 662 KB on a tiny GPT under full checkpointing, its blocks left whole
        base = dataclasses.replace(base, **{k: getattr(rep["base"], k) for k in PEAKS})
    return base


def _transient(t: Terms) -> float:
    return sum(getattr(t, k) for k in PEAKS)


def _variants(ctx, pipe, cuts: dict) -> list[tuple]:
    if pipe is None:
        return [((), None)]
    return pipe.search_variants(ctx.traced, ctx.mesh, ctx.facts.split_before, cuts)


def _expert_parallel_ok(s, mesh, experts) -> bool:
    """Whether structure ``s`` may put the experts on its dp axis: one dp axis (not two: the
    dispatch runs over one axis) whose size divides every experts module's count."""
    return (
        bool(experts) and s.dp is not None and s.rep is None and all(c.experts % mesh.shape[s.dp] == 0 for c in experts)
    )


def _option(ctx, label, base, split, rep, ep=False, shares=None, ept=None) -> Option:
    """An option: a pair's or the vocabulary's choices ``split`` (on the tp axis, from the
    split probe) and ``R``; an experts module's ``ep`` (expert parallel on dp, from the split
    probe when ``ep``), ``ep+tp`` (and each expert split over tp, from the ``ept`` probe) and
    ``local`` (every expert on each rank: the probe without it)."""
    s, dp = label[0], label[1]
    mesh, profile = ctx.mesh, ctx.profile

    def coefs(t, base=False):
        return _coefs(t, mesh, profile, dp, shares, base)

    comps = {}
    for c in ctx.free:
        ch = {}
        if c.kind == "experts":
            if ep and split is not None:
                ch["ep"] = coefs(split.get(c.key, Terms()))
            if ep and ept is not None and split is not None:
                ch["ep+tp"] = coefs(_moved(ept, split, c.key))
            if rep is not None or not ep:
                ch["local"] = coefs((rep if rep is not None else split).get(c.key, Terms()))
            comps[c.key] = ch
            continue
        if split is not None and s.tp is not None:
            ch["split"] = coefs(split.get(c.key, Terms()))
        if rep is not None:
            ch["R"] = coefs(rep.get(c.key, Terms()))
        comps[c.key] = ch
    idle = sum(1 for a, size in enumerate(mesh.shape) if size > 1 and not s.uses(a))
    # a tp axis that splits no component is replicated after all: each unsplit component counts a
    # share of an idle axis, all of them together less than one
    idle_choice = {"R": 1.0 / (sum(c.kind != "experts" for c in ctx.free) + 1)} if s.tp is not None else {}
    wrapped = int(dp is not None and not dp.storage.plain_optimizer)
    return Option(label, coefs(base, base=True), comps, idle, idle_choice, wrapped)


def _coefs(t: Terms, mesh, profile, dp, shares=None, base=False) -> tuple:
    """(time, sync, hide, memory at each moment of a step) of ``t`` under ``dp`` (as a user writes it: two axes are merged
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
    return (t.compute + t.comm + after + step, sync + ahead + rest, hide, *t.memory_rows(mesh, dp_axis, dp))


def prefetches(dp, mesh, dp_axis) -> bool:
    """Whether ``dp``'s storage starts gathers ahead of their use (then the whole step's compute
    hides its communication, not only backward's)."""
    n = mesh.shape[dp_axis] if dp_axis is not None else 1
    return dp is not None and any(c[3] for c in dp.storage.step_comms(dp, n, 1.0, 1.0))


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


def least_memory(o: Option) -> float:
    """The least memory any choice of option ``o``'s components needs (its largest moment's)."""
    return min(max(memory_rows(o, picked)) for picked in itertools.product(*[list(ch) for ch in o.comps.values()]))


def label_of(mesh, option) -> str:
    """An option's label as explain and ap.Auto(option=...) read it: the roles, then each
    technique's choice in its own words (search_label), the stage cut, the checkpointing."""
    s, dp, mode, pipe, paths = option
    label = s.roles(mesh)
    for choice in (dp, s.context, pipe):
        if choice is not None:
            label += choice.search_label(mesh, s)
    if paths:
        label += ", stages balanced for memory"
    return label + (mode.search_label(mesh, s) if mode else "")
