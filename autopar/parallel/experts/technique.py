"""Expert parallel: ``ap.ExpertParallel(axis, tp=None, modules=None)`` as ``expert_parallel=`` of
ap.plan / ap.parallelize. A mixture-of-experts model's experts split by expert over ``axis``.

The technique is the whole-model form of the ``ap.expert_parallel`` annotation (annotation.py):
it gives that annotation to every experts module of the model (``modules``: the module patterns
to give it to instead), so both ways make the same layouts. Where ``axis`` splits the batch
(``data_parallel=`` on it) the tokens go to their experts' ranks and back by all-to-all
(dispatch.py); elsewhere each rank runs the rows routed to its own experts (a partial sum).
``tp``: each expert split over that axis too (expert tensor parallelism, tensor_parallel.py).

What the folder holds besides: the collapse of every experts module into one ``moe_experts``
op before propagation (blocks.py, lists.py; ``prepare_seeded_graph`` below runs it for every
plan, asked for or not: plain data parallelism keeps the tokens split through it), the op's
rule and its FLOPs (moe_rule.py), its lowering (dispatch.py, with the run-time steps of
moe_dispatch.py), the grouped matmul's own rule and lowering (grouped_mm_rule.py,
local_experts.py) and the modules' finder (find.py, for presets.megatron and the search).

Example:
    >>> plan = ap.plan(model, ap.Mesh((4,), ("dp",)), kwargs=kw, data_parallel="dp",
    ...                expert_parallel=ap.ExpertParallel("dp"))
    >>> # the same layouts as annotations={"model.layers.*.mlp.experts": ap.expert_parallel("dp")}
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.errors import PlanError
from autopar.parallel.experts.annotation import expert_parallel
from autopar.parallel.experts.blocks import BLOCKS, MOE_EXPERTS, collapse_expert_blocks
from autopar.parallel.experts.dispatch import axis_modes
from autopar.parallel.experts.find import expert_modules
from autopar.parallel.registry import register_technique
from autopar.parallel.technique import Technique


@register_technique
@dataclass(frozen=True)
class ExpertParallel(Technique):
    """``axis``: the mesh axis the experts are split over (with the batch over two merged axes,
    ``DataParallel("b", replicate_axis="a")``: "b", "a" or ("a", "b"), docs/experts.md);
    ``tp``: an axis each expert is split over too; ``modules``: module path patterns of the
    experts modules (None: every one the model has: the owners of stacked 3-D weights feeding
    a grouped expert matmul, and per-expert ModuleLists)."""

    axis: str | tuple
    tp: str | None = None
    modules: tuple | None = None

    name = "expert_parallel"
    order = 14  # after data parallel (whose axis it may dispatch on), before context parallel and the pipeline

    def __post_init__(self):
        for name in ("axis", "modules"):  # a plan file's JSON lists back as tuples
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        axes = (self.axis,) if isinstance(self.axis, str) else self.axis
        if not isinstance(axes, tuple) or not axes or not all(isinstance(a, str) for a in axes):
            raise PlanError(f"ExpertParallel axis must be a mesh axis name (or a tuple of them), got {self.axis!r}.")
        if self.tp is not None and (not isinstance(self.tp, str) or self.tp in axes):
            raise PlanError(
                f"ExpertParallel({self.axis!r}, tp={self.tp!r}): tp is another mesh axis, the one each expert's "
                "matmuls are split over (expert tensor parallelism)."
            )
        if self.modules is not None and not (
            isinstance(self.modules, tuple) and self.modules and all(isinstance(m, str) for m in self.modules)
        ):
            raise PlanError(
                f"ExpertParallel(modules={self.modules!r}): module path patterns, e.g. ('model.layers.*.mlp.experts',); "
                "None for every experts module of the model."
            )

    @classmethod
    def of(cls, value):
        """``expert_parallel="dp"`` (an axis name, or a tuple of them) or an ap.ExpertParallel."""
        if value is None or isinstance(value, ExpertParallel):
            return value
        if isinstance(value, (str, tuple)):
            return cls(value)
        raise PlanError(f"expert_parallel={value!r}: give a mesh axis name ('dp') or ap.ExpertParallel('dp', ...).")

    def validate(self, mesh, options, annotations: dict) -> None:
        if options.auto is not None:
            raise PlanError(
                "expert_parallel= with auto=: the search decides where the experts go itself "
                "(ap.Auto(expert_parallel=True/False, expert_tensor_parallel=...)); give one or the other."
            )
        mesh.sub_axis(self.axis)  # a mesh axis, or one of two merged into one (HSDP's)
        if self.tp is not None:
            mesh.axis_index(self.tp)

    @classmethod
    def modules_of(cls, model, traced) -> dict[str, int]:
        """{module path: number of experts} of every experts module of ``model`` (traced as
        ``traced``): what the technique splits when not given ``modules``, and what the search
        weighs as its experts components."""
        return expert_modules(model, traced)

    @classmethod
    def annotation(cls, axis, tp: str | None = None):
        """The per-module form: ``ap.expert_parallel(axis, tp=tp)`` (the search's probes write it)."""
        return expert_parallel(axis, tp=tp)

    def annotate(self, model, traced, annotations: dict) -> dict:
        """``annotations`` with ``ap.expert_parallel(axis, tp=tp)`` on every experts module (or on
        ``modules``). The same module annotated otherwise is an error here; another pattern that
        places the same tensors otherwise is the conflict resolve reports."""
        if self.modules is not None:
            patterns = list(self.modules)
        else:
            patterns = list(self.modules_of(model, traced))
            if not patterns:
                raise PlanError(
                    f"{self!r}: the model has no mixture-of-experts experts module (a module whose stacked "
                    "3-D weights feed a grouped expert matmul, or a per-expert ModuleList; docs/experts.md). "
                    "Give modules=('pattern',) for the module holding the expert weights, or drop expert_parallel=."
                )
        ann = self.annotation(self.axis, self.tp)
        differ = {p: annotations[p] for p in patterns if p in annotations and annotations[p] != ann}
        if differ:
            raise PlanError(
                f"{self!r} puts {ann!r} on {sorted(differ)}, annotated {sorted(set(map(repr, differ.values())))}: "
                "drop those annotations (presets.megatron(..., experts=False) leaves the experts out) or expert_parallel=."
            )
        return {**annotations, **{p: ann for p in patterns}}

    @classmethod
    def prepare_seeded_graph(cls, traced, seeds, mesh, data_axis: str | None) -> None:
        """Every experts module as one moe_experts op (blocks.py), the ones annotated
        ``expert_parallel`` and the others alike: for every plan, with expert parallel or not."""
        collapse_expert_blocks(traced, seeds, None if data_axis is None else mesh.axis_index(data_axis), mesh)

    def describe(self, plan) -> str:
        """How many experts modules are split, and how their tokens meet their experts."""
        nodes = [n for n in plan.graph.nodes if n.target is MOE_EXPERTS]
        blocks = {n.name: BLOCKS[n.args[4]] for n in nodes}
        counts = sorted({b.experts for b in blocks.values() if b.path in plan.seeds.experts})
        dispatched = any("dispatch" in axis_modes(n.meta["autopar"].strategies, blocks[n.name]).values() for n in nodes)
        how = (
            "tokens dispatched to their experts' ranks by all-to-all"
            if dispatched
            else "each rank runs the rows routed to its experts, the outputs summed over the axis"
        )
        tp = f", each expert split over {self.tp!r}" if self.tp else ""
        return (
            f"expert parallel on {self.axis!r}: {len(plan.seeds.experts)} experts module(s) of "
            f"{'/'.join(map(str, counts))} experts split by expert{tp}; {how}"
        )

    def explain_module(self, plan, path: str) -> list[str]:
        """An experts module the technique split: where its experts are, each rank's share."""
        if path not in plan.seeds.experts:
            return []
        module = plan.model.get_submodule(path)
        stacked = [p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3]
        count = len(module) if isinstance(module, torch.nn.ModuleList) else stacked[0]
        share = f"{count} experts split by expert over {self.axis!r}"
        tp = f", each expert over {self.tp!r}" if path in plan.seeds.expert_tp and self.tp else ""
        return [f"  expert parallel ({self!r}): {share}{tp}"]
