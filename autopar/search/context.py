"""What one search knows before it weighs anything, as one frozen value: the job (model, mesh, trace,
the user's annotations and techniques), ap.Auto and its device profile, the model's components
and facts, and the techniques that lend the search its roles.

The search names no technique: it finds each by what it offers (``Technique.search_roles``: the
technique giving axes the role ``dp``, ``pp``, ``cp``; ``search_variant``: the technique whose
choices are options of the same layouts, checkpointing), through the registry.

Example:
    >>> ctx = SearchContext.of(model, mesh, traced, annotations, options, plan_probe)
    >>> ctx.technique("pp").name, ctx.user("dp")          # ('pipeline', None)
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from functools import cached_property

import torch

from autopar.errors import PlanError
from autopar.parallel.registry import TECHNIQUES
from autopar.parallel.protocols.search import SearchFacts
from autopar.search.candidates import components, technique_of
from autopar.search.options import Auto
from autopar.trace.model_members import named_modules


@dataclass(frozen=True, eq=False)
class SearchContext:
    model: object
    mesh: object
    traced: object
    annotations: dict  # the user's, kept as written
    options: object  # the user's ap.PlanOptions (its techniques fix what they name)
    auto: Auto
    profile: object
    plan_probe: object  # plan_probe(traced, options, annotations): the planner's stages after tracing
    facts: SearchFacts
    comps: list  # every component of the model (candidates.py)
    norms: list  # the norm patterns sequence parallel splits
    touched: frozenset  # components the user's annotations touch: not searched
    free: list  # the components searched
    fixed_tp: int | None  # the axis the user's annotations name: the tp axis

    @classmethod
    def of(cls, model, mesh, traced, annotations, options, plan_probe, precision=None) -> "SearchContext":
        auto = Auto.of(options.auto)
        user = dict(annotations or {})
        comps, norms = components(model, traced)
        touched = frozenset(c.key for c in comps if _touched(c, user, model))
        free = [c for c in comps if c.key not in touched]
        if not auto.expert_parallel:
            free = [c for c in free if c.kind != "experts"]
        user_axes = {a.axis for a in user.values() if getattr(a, "axis", None) is not None}
        if len(user_axes) > 1:
            raise PlanError(
                f"ap.plan(auto=...): the annotations name the axes {sorted(user_axes)}; the search "
                "uses one tensor-parallel axis. Annotate one axis, or plan without auto."
            )
        repeated = getattr(traced, "repeated", None)
        facts = SearchFacts(
            batch=batch_size(traced),
            blocks=getattr(repeated, "count", 0),
            sequence_lengths=tuple(_sequence_lengths(traced)),
            experts=any(c.kind == "experts" for c in comps),
            user={t.name: t for t in options.techniques},
            split_before=tuple(options.split_before),
            precision=dict(precision or {}),
        )
        return cls(
            model,
            mesh,
            traced,
            user,
            options,
            auto,
            auto.profile(job_device(traced)),
            plan_probe,
            facts,
            comps,
            norms,
            touched,
            free,
            mesh.axis_index(user_axes.pop()) if user_axes else None,
        )

    @cached_property
    def dense(self) -> list:
        """The free components decided on the tp axis (pairs, the vocabulary)."""
        return [c for c in self.free if c.kind != "experts"]

    @cached_property
    def experts(self) -> list:
        """The free experts modules, decided on the dp axis."""
        return [c for c in self.free if c.kind == "experts"]

    def technique(self, role: str):
        """The registered technique giving axes ``role`` (Technique.search_roles)."""
        found = technique_of(role)
        if found is None:
            raise PlanError(f"the search needs a technique giving mesh axes the role {role!r}; none is registered.")
        return found

    def variant_technique(self):
        """The technique whose choices are options of the same layouts (checkpointing), or None."""
        return next((cls for cls in TECHNIQUES.values() if cls.search_variant), None)

    def user(self, role: str):
        """The user's technique of ``role`` (None where not given)."""
        return self.facts.user.get(self.technique(role).name)

    def space(self, technique, structure=None) -> list:
        """``technique``'s choices on this job (its search_space hook)."""
        return technique.search_space(self.mesh, self.facts, self.auto, structure)


def _touched(comp, user, model) -> bool:
    pats = comp.patterns
    paths = [p for p, _ in named_modules(model) if any(fnmatch.fnmatchcase(p, q) for q in pats)]
    return any(fnmatch.fnmatchcase(p, u) for p in paths for u in user) or any(
        fnmatch.fnmatchcase(n, u) for n in comp.params for u in user
    )


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


def _sequence_lengths(traced, seq_dim: int = 1) -> list[int]:
    """Dim ``seq_dim`` of every user input of more dims (what ap.ContextParallel splits); [] where
    one is symbolic without a hint (it cannot be checked: context parallel not searched)."""
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


def state_floor(model, auto) -> float:
    """Bytes of the whole model's training state as the search counts it (evaluate.py):
    parameters, their gradients and ``optimizer_states`` copies of each trained one (its dtype)."""
    total = 0.0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        if p.requires_grad:
            total += p.numel() * p.element_size() * (1 + auto.optimizer_states)
    return total
