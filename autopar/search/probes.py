"""The search's probes: for a structure, the plan with every free component split on the tp axis
(or none split), planned on a copy of the trace, and its terms per component under each choice of
the technique whose choices are options of the same layouts (checkpointing).

A repeated stack's probe graph holds two blocks, block 1 weighted for the rest (short.py). A
context-parallel probe plans the graph its technique rewrote (prepare_graph: eager attention as
one SDPA) on a copy of its own; another attention method of the same layouts is the planned plan
under other options (no propagation).

Example:
    >>> probes = Probes(ctx)
    >>> by_choice = probes.get(structure, tp_axis=1, sp=False)   # {checkpointing: {component: Terms}}
"""

from __future__ import annotations

import fnmatch

from autopar.cost.activation_memory import saved_activations, share_saved_activations
from autopar.errors import PlanError
from autopar.options import PlanOptions
from autopar.search.candidates import sp_annotations
from autopar.search.evaluate import plan_terms
from autopar.search.short import copied, reweighed, shortened
from autopar.trace.module_paths import module_path


class Probes:
    """The probes of one search, each planned once (by its layouts' key) and kept as its terms."""

    def __init__(self, ctx, modes: list):
        self.ctx = ctx
        self.modes = modes  # the variant technique's choices (checkpointing), each costed per probe
        self.found: dict = {}  # key -> {mode: {component: Terms}} or None (refused)
        self.planned: dict = {}  # context parallel's plans by layouts (another method: other options)
        short = shortened(ctx.traced)  # probes plan two blocks of a repeated stack, weighted (short.py)
        self.graph, self.weights = (short[0], short[1:]) if short is not None else (copied(ctx.traced), ({}, {}))
        self.rewritten: dict = {}  # context parallel's probe graph (prepare_graph's) and its weights
        free = ctx.free
        self.comp_of = {n: c.key for c in free for n in c.nodes}
        self.param_comp = {p: c.key for c in free for p in c.params}

    def __len__(self) -> int:
        return len(self.found)

    def get(self, s, tp_axis, sp, ep=False) -> dict | None:
        """Structure ``s``'s probe: its components split on ``tp_axis`` (None: none split), with
        sequence parallel (``sp``); the experts expert-parallel on dp (``ep``: True, or "tp": each
        expert split over the tp axis too). None where it cannot be planned."""
        key = (s.dp, s.rep, tp_axis, sp, ep, s.cp, s.cp_inner, s.cp_method)
        if key not in self.found:
            cp = s.context_parallel(self.ctx.mesh)
            graph, weights = self._graph_of(cp)
            probe_dp = self.ctx.technique("dp").search_probe(self.ctx.mesh, s)
            plan = self._plan(graph, self._annotations(s, tp_axis, sp, ep), probe_dp, cp, key[:-1])
            self.found[key] = None if plan is None else self._terms(plan, weights)
        return self.found[key]

    def _annotations(self, s, tp_axis, sp, ep) -> dict:
        ctx, mesh = self.ctx, self.ctx.mesh
        ann = dict(ctx.annotations)
        if tp_axis is not None:
            name = mesh.axis_names[tp_axis]
            for c in ctx.dense:
                if c.kind != "vocab" or ctx.auto.vocab_parallel or sp:
                    ann.update(c.annotations(name, sp))
            if sp:
                ann.update({k: v for k, v in sp_annotations(ctx.norms, name).items() if k not in ctx.annotations})
        if ep:  # True: expert parallel on dp; "tp": and each expert split over the tp axis
            expert_tp = mesh.axis_names[tp_axis] if ep == "tp" else None
            for c in ctx.experts:
                ann.update(c.annotations(mesh.axis_names[s.dp], False, tp=expert_tp))
        return ann

    def _graph_of(self, cp) -> tuple:
        """The probe graph and weights for the context-parallel technique ``cp`` (or none): cp
        rewrites eager attention into SDPA before planning (prepare_graph), on its own copy,
        whose new nodes in a shortened stack's block 1 stand for n - 1 blocks too."""
        if cp is None:
            return self.graph, self.weights
        if not self.rewritten:
            g = copied(self.graph)
            cp.prepare_graph(g)
            self.rewritten["graph"] = (g, reweighed(g, self.weights))
        return self.rewritten["graph"]

    def _plan(self, graph, ann: dict, dp, cp, key):
        """The probe's plan (None where it cannot be planned). ``cp``: the context parallel to plan
        with; a plan of the same layouts by another attention method is planned once (``key``)
        and seen under this one's options."""
        cache = self.planned
        options = {t.name: t for t in (dp, cp) if t is not None}
        try:
            if cp is not None and key in cache:
                plan = cache[key]
            else:
                plan = self.ctx.plan_probe(graph, PlanOptions(strict=self.ctx.options.strict, **options), ann)
                if cp is not None:  # kept for the other attention method (no other probe is kept: memory)
                    if not plan.built.get(cp.name):
                        plan = None  # no attention met the split sequence: not context parallel, only a split
                    cache[key] = plan
            if plan is None:
                return None
            if cp is not None and getattr(plan.options, cp.name) != cp:
                saves = saved_activations(plan)
                plan = plan.with_options(plan.options.replace(**{cp.name: cp}))
                share_saved_activations(plan, saves)  # same graph and layouts: the same saved tensors
            return plan
        except PlanError:
            if cp is not None:
                cache.setdefault(key, None)  # refused layouts (another method of planned ones may still be)
            return None

    def _terms(self, plan, weights) -> dict:
        """{mode: the plan's Terms per component} (a mode missing when the plan has no block to
        checkpoint). The modes are the same layouts under other options (Plan.with_options: no
        propagation). Experts modules became one moe_experts node each in planning: those nodes
        are attributed to their component by module path."""
        comp_of = self._experts_nodes(plan)
        out, shared = {}, {}  # shared: what the checkpointing variants have in common (plan_terms)
        saves = saved_activations(plan)
        for mode in self.modes:
            variant = plan
            if mode is not None:
                try:
                    # the plan's own options: data parallel over two axes is planned on their merged axis
                    # (with the probe's options the axes differ, and every checkpointed variant of
                    # such a probe was refused: two-axis data parallel was only searched without it)
                    variant = plan.with_options(plan.options.replace(**{mode.name: mode}))
                except PlanError:
                    continue
                share_saved_activations(variant, saves)  # same graph and layouts: the same saved tensors
            out[mode] = plan_terms(
                variant,
                comp_of,
                self.ctx.profile,
                self.ctx.auto.optimizer_states,
                weights[0],
                weights[1],
                param_comp=self.param_comp,
                shared=shared,
            )
        return out

    def _experts_nodes(self, plan) -> dict:
        moe = [c.module for c in self.ctx.experts]
        if not moe:
            return self.comp_of
        comp_of = dict(self.comp_of)
        for node in plan.graph.nodes:
            path = module_path(node)
            key = next((m for m in moe if path and fnmatch.fnmatchcase(path, m)), None)
            if key is not None and node.name not in comp_of:
                comp_of[node.name] = key
        return comp_of
