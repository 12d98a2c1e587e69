"""Pipeline options: the ``pipeline=`` argument of ap.plan and the ``ap.split_before()`` annotation.

Example:
    >>> plan = ap.plan(model, ap.Mesh((2, 2), ("pp", "tp")), args=(idx, tg),
    ...                annotations={"blocks.2": ap.split_before(), **MEGATRON},
    ...                pipeline=ap.Pipeline("pp", microbatches=8, schedule="1f1b"))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from autopar.errors import PipelineError, PlanError
from autopar.parallel.param_names import held_params
from autopar.parallel.pipeline import api, schedules, stage_memory, stage_shares
from autopar.parallel.pipeline.dry_run import PipelineDryRank
from autopar.parallel.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD, V_SHAPED
from autopar.parallel.pipeline.split import describe, split_stages
from autopar.parallel.pipeline.timeline import marked_actions, slot_table, timeline_rows
from autopar.parallel.registry import register_technique
from autopar.parallel.technique import Technique

__all__ = ["Pipeline", "PipelineError", "SplitBefore", "split_before"]


@register_technique
@dataclass(frozen=True)
class Pipeline(Technique):
    """Pipeline parallelism on mesh axis ``axis``.

    ``schedule``: "gpipe" (fill-drain), "1f1b", "interleaved" (1F1B over ``chunks`` model
    chunks per rank: rank r holds stages r, r + pp, ...), or "zb-h1" (zero-bubble: each backward
    split into its input-gradient part and its weight-gradient part, the latter deferred into
    1F1B's bubble), or "zbv" (zero-bubble V: chunks=2, rank r holds stages r and 2pp - 1 - r, B
    and W split as in zb-h1), or "dualpipev" (DualPipeV: ZBV's V and split, DualPipe's order: a
    forward beside another micro-batch's backward; chunks=2, microbatches >= 2pp); "1f1b" with
    chunks > 1 means interleaved. ``checkpoint`` recomputes each stage's activations in backward. ``loss``
    (outputs, labels) -> scalar replaces the model's own loss; ``metric`` (outputs, labels)
    -> scalar is averaged alongside. ``stages`` overrides the number of stages (pp * chunks).
    """

    axis: str = "pp"
    microbatches: int = 4
    schedule: str = "1f1b"
    chunks: int = 1
    checkpoint: bool = False
    loss: Callable | None = None
    metric: Callable | None = None

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise PipelineError(f"Unknown pipeline schedule {self.schedule!r}: use one of {SCHEDULES}.")
        if self.microbatches < 1 or self.chunks < 1:
            raise PipelineError(f"microbatches ({self.microbatches}) and chunks ({self.chunks}) must be >= 1.")
        if self.schedule == "interleaved" and self.chunks < 2:
            raise PipelineError("schedule='interleaved' needs chunks >= 2 (model chunks per rank).")
        if self.schedule == "zb-h1" and self.chunks > 1:
            raise PipelineError("schedule='zb-h1' runs one chunk per rank: use chunks=1, or schedule='zbv'.")
        if self.schedule in V_SHAPED and self.chunks != 2:
            raise PipelineError(f"schedule={self.schedule!r} runs two chunks per rank, in a V: use chunks=2.")
        if self.schedule == "gpipe" and self.chunks > 1:
            raise PipelineError(
                "schedule='gpipe' runs one chunk per rank: use chunks=1, or schedule='interleaved' for several chunks."
            )

    name = "pipeline"
    order = 20  # after data parallel: a stage's parameters are stored as data parallel keeps them
    plan_methods = ("with_pipeline", "pipeline_runner", "schedule_table")

    @property
    def kind(self) -> str:
        return "interleaved" if self.chunks > 1 and self.schedule not in V_SHAPED else self.schedule

    # ------------------------------------------------------- the technique (technique.py)
    @classmethod
    def take_annotations(cls, annotations: dict) -> tuple[dict, dict]:
        """``ap.split_before()`` annotations mark stage boundaries: they become ``split_before``."""
        splits = [k for k, v in annotations.items() if isinstance(v, SplitBefore)]
        rest = {k: v for k, v in annotations.items() if not isinstance(v, SplitBefore)}
        return rest, ({"split_before": tuple(splits)} if splits else {})

    @classmethod
    def check_options(cls, options) -> None:
        if options.split_before and options.pipeline is None:
            raise PipelineError(
                f"split_before annotations ({', '.join(options.split_before)}) need a pipeline: "
                "pass pipeline=ap.Pipeline('pp', microbatches=...) to ap.plan."
            )

    def validate(self, mesh, options, annotations: dict) -> None:
        dp = options.data_parallel
        api.check_options(self, mesh, dp.axis if dp is not None else None, annotations)

    def after_plan(self, plan):
        return api.stage_layout(plan, self, list(plan.options.split_before))

    def batch_pieces(self) -> int:
        """The runner cuts each rank's batch into ``microbatches`` (runner._chunk)."""
        return self.microbatches

    def step_shares(self, mesh, built=None) -> dict:
        """With the stage layout ``built`` (what after_plan made, or ``cut`` for the search): each
        stage costed from its own nodes (stage_shares.py: the schedule replayed with the stages'
        FLOPs, the slowest sets the pace; state and activations per rank). Without: even stages.
        A rank runs 1/pp of the layers on m micro-batches; the schedule adds pp - 1 idle slots
        of one micro-batch's stage work (1/chunks of it interleaved), so the step takes
        (m*v + pp - 1) / (m*v*pp) of the unpipelined one (zero-bubble: the schedule replayed with B
        and W at their measured shares of a backward, stage_shares.split_backward; ZB-H1 with B and W
        half a backward each would be (3m + pp - 1) / (3m*pp), its W's filling two thirds of the
        idle slots). It keeps 1/pp of the parameters. In
        flight at the first stage: 1F1B pp micro-batches of its 1/pp of the layers (1/m of the
        activations; ZB-H1 the same on every rank), GPipe all m (1/pp), interleaved 1F1B ~ (1 + (pp-1)/(pp*v)) x 1F1B's.
        A middle stage sends 2m messages per step (each micro-batch's activation forward, its
        gradient backward; v times interleaved), each 1/m of the batch's boundary activation.
        ``pieces``: m backward passes a step, so what one batch's step holds at once (a block's
        recompute, the loss's backward) is 1/m of it, and gradients accumulate between them.
        Even stages are an approximation: the embedding and the head sit on the end stages."""
        pp, m, v = mesh.axis_size(self.axis), self.microbatches, self.chunks
        sends = self.sends()
        if built is not None:
            return {**stage_shares.shares(built, self), "sends": sends, "pieces": m}
        time = (m * v + pp - 1) / (m * v * pp)
        if self.kind in SPLIT_BACKWARD:  # replayed, B and W at their measured shares of a backward
            time = stage_shares.even_split_time(self.kind, pp, m)
        if self.kind == "gpipe":
            acts = 1 / pp
        elif self.kind == "interleaved":
            acts = min(1.0, (1 + (pp - 1) / (pp * v)) / m)
        elif self.kind == "dualpipev":  # 2pp + 1 micro-batch chunks of 1/(2pp) of the layers at most
            acts = min(1.0, max(map(schedules.max_in_flight, schedules.build(self.kind, pp, m, v))) / (v * pp * m))
        else:
            acts = min(m, pp) / (pp * m)
        return {"time": time, "state": 1 / pp, "acts": acts, "sends": sends, "pieces": m}

    def sends(self) -> tuple:
        """step_shares' ``sends``: (its axis, 2 m v messages a step, each 1/m of the boundary activation)."""
        m = self.microbatches
        return (self.axis, 2 * m * self.chunks, 1 / m)

    def cut(self, traced, mesh, split_before=(), balance: str = "time"):
        """The stage layout ap.plan would cut ``traced`` into (split.py), before any plan exists
        (the search costs each stage from it; the final plan cuts the same graph the same way).
        ``balance="memory"`` (1F1B): each stage's cost weighted by the micro-batches it holds at
        once, min(m, pp - s), so that the first stages, which hold the most, get fewer layers
        (its ``cut_paths`` as split_before give the plan that cut)."""
        pp = mesh.axis_size(self.axis)
        weights = [min(self.microbatches, pp - s) for s in range(pp)] if balance == "memory" else None
        return split_stages(traced, mesh, self, list(split_before), weights)

    def rank_activations(self, plan, symbols, terms: dict, rank: int | None) -> dict:
        """The rank's own stages' activations times the micro-batches its schedule keeps in
        flight, at the micro-batch's size (stage_memory.py)."""
        return stage_memory.rank_terms(plan, self, symbols, terms, rank)

    def restored(self, plan, per_rank: list) -> list:
        """Each rank's dict completed with the other stages' pieces at its other coordinates, tied
        weights under every stage's name for them (api.restored): what merging reads."""
        return api.restored(plan, per_rank)

    def rank_params(self, plan, rank: int, names: set) -> set:
        """The parameters of ``rank``'s stages (a weight tied across stages: on each)."""
        return names & set(held_params(plan, rank))

    def memory_ranks(self, plan) -> tuple:
        """One rank per stage position (the others' coordinates 0)."""
        mesh = plan.mesh
        axis = mesh.axis_index(self.axis)
        return tuple(mesh.rank_of([p if a == axis else 0 for a in range(mesh.ndim)]) for p in range(mesh.shape[axis]))

    def describe(self, plan) -> str:
        """The stages: their nodes, modules, FLOPs and what they send (split.describe)."""
        return describe(plan.stage_layout, plan.graph)

    def timeline(self, plan, events_per_rank=None) -> tuple:
        """The schedule's actions per rank on unit slots, or the runners' measured ones
        (timeline.py), the actions DualPipeV overlaps marked: what plan.timeline_figure() draws."""
        rows, unit = timeline_rows(events_per_rank, plan)
        return rows, unit, marked_actions(plan)

    def process_groups(self, plan) -> list:
        """The groups of ranks that hold one tied weight on several pipeline ranks, and the
        pp x dp groups the step's loss is reduced over."""
        return api.tied_rank_groups(plan) + api.loss_rank_groups(plan)

    def dry_run_rank(self, plan, rank: int, device, stats) -> PipelineDryRank:
        """The rank's runner driven through its schedule, its messages recorded by the fake world
        (dry_run.py)."""
        return PipelineDryRank(plan, rank, device, stats)

    # ------------------------------------------------------- what a Plan offers (plan.<name>)
    @staticmethod
    def with_pipeline(plan, pipeline, split_before=()):
        """The same plan (same trace and layouts) with other pipeline options, without tracing again.

        Example:
            >>> gpipe = plan.with_pipeline(ap.Pipeline("pp", microbatches=8, schedule="gpipe"))
        """
        return api.with_pipeline(plan, pipeline, split_before)

    @staticmethod
    def schedule_table(plan, rank: int | None = None) -> str:
        """Which micro-batch each pipeline rank runs at each slot (F forward, B backward; timeline.py).

        Example:
            >>> print(plan.schedule_table(0))        # rank 0's pipeline row
        """
        return slot_table(api.require_pipeline(plan), rank)

    @staticmethod
    def pipeline_runner(plan, rank: int, **kwargs):
        """This rank's PipelineRunner (parallel/pipeline/runner.py): ``runner.step(batch, labels)``;
        in a torch.distributed job of the mesh's size its process groups are made first."""
        return api.pipeline_runner(plan, rank, **kwargs)

    def fields(self) -> dict:
        raise PipelineError(
            "Saving a pipelined plan is not supported yet (its stages are not recorded). "
            "Save the plan made without pipeline=..., load it with ap.load_plan, then add "
            "the pipeline with plan.with_pipeline(ap.Pipeline(...), split_before=[...])."
        )

    # ------------------------------------------------------- the search's hooks (parallel/protocols/search.py)
    search_roles = ("pp",)  # pipeline stages over the axis (the layouts leave it replicated)
    SEARCH_INTERLEAVE = (2, 4)  # model chunks per pipeline rank the search tries besides 1F1B's one
    SEARCH_LABELS = {"zb-h1": "ZB-H1", "zbv": "ZBV", "dualpipev": "DualPipeV"}

    @classmethod
    def search_offered(cls, auto) -> bool:
        """Whether an axis may hold pipeline stages: ``ap.Auto(pipeline=...)``, or
        ``choices={"pipeline": ...}`` (False or (): none)."""
        value = auto.choices_for(cls.name)
        return bool(auto.pipeline if value is None else value)

    @classmethod
    def search_kinds(cls, auto) -> tuple:
        """The schedules the search may pick: ``ap.Auto(pipeline_schedules=...)``, or
        ``choices={"pipeline": schedules}``."""
        value = auto.choices_for(cls.name)
        return tuple(auto.pipeline_schedules if value is None or value is True else value or ())

    @classmethod
    def search_space(cls, mesh, facts, auto, structure=None) -> list:
        """The pipelines of ``structure``: the user's, or over its pp axis with one micro-batch per
        row of a data-parallel rank's batch (the fewest idle slots, the least in flight), under the
        schedules ``search_kinds``: 1F1B; the interleaved 1F1B with v model chunks per rank (a
        bubble of (pp - 1) / v micro-batch slots instead of pp - 1, v times the point-to-point
        sends, more in flight) where the micro-batches come in groups of pp (the schedule needs
        it); ZB-H1 (1F1B's order, each W deferred into the bubble); ZBV (two chunks in a V, B/W
        split) and DualPipeV (ZBV's V in DualPipe's order, m >= 2pp). Several chunks per rank
        need at least one block per stage (pp x v of them). [] when ``structure`` has no pp axis
        or the rows are too few for one micro-batch per stage.

        Example: pp=2 of a (2, 2) mesh, 8 rows over dp=2, 4 blocks ->
        [Pipeline('b', 4, '1f1b'), Pipeline('b', 4, 'zb-h1'), Pipeline('b', 4, 'interleaved', chunks=2), ...]"""
        pp_axis = structure.axis("pp") if structure is not None else None
        if pp_axis is None:
            return []
        user = facts.user.get(cls.name)
        if user is not None:
            return [user]
        kinds = cls.search_kinds(auto)
        dp_size = math.prod(mesh.shape[a] for a in (structure.dp, structure.rep) if a is not None)
        pp, batch, blocks = mesh.shape[pp_axis], facts.batch, facts.blocks
        if batch is None or batch % dp_size or batch // dp_size < pp:
            return []
        m, axis = batch // dp_size, mesh.axis_names[pp_axis]
        out = [cls(axis, microbatches=m, schedule=k) for k in ("1f1b", "zb-h1") if k in kinds]
        for v in cls.SEARCH_INTERLEAVE if "interleaved" in kinds else ():
            if m % pp == 0 and pp * v <= blocks:
                out.append(cls(axis, microbatches=m, schedule="interleaved", chunks=v))
        for k in V_SHAPED:
            if k in kinds and 2 * pp <= blocks and (k != "dualpipev" or m >= 2 * pp):
                out.append(cls(axis, microbatches=m, schedule=k, chunks=2))
        return out

    def search_variants(self, traced, mesh, split_before, cache: dict) -> list[tuple]:
        """[(split_before paths or () for ap.plan's own cut, the pipeline's step shares)]: the
        runtime's cut (time-balanced), and for 1F1B the memory-balanced one where it differs
        (stage s holds min(m, pp - s) micro-batches: fewer layers on the first stages). ``cache``:
        kept by the search across its structures (the cuts and shares by sizes: the same
        whichever axis of that size holds the stages)."""
        out = []
        for balance in ("time",) + (("memory",) if self.kind == "1f1b" and not split_before else ()):
            lay = self._search_cut(traced, mesh, split_before, balance, cache)
            if lay is None:
                continue
            paths = () if balance == "time" else lay.cut_paths
            if balance == "memory" and (
                not all(paths) or len(set(paths)) != len(paths) or out and lay.cut_paths == out[0][2]
            ):
                continue  # the same cut, or one split_before cannot name
            key = ("shares", mesh.axis_size(self.axis), self.chunks, self.microbatches, self.kind, paths)
            if key not in cache:
                cache[key] = {k: v for k, v in self.step_shares(mesh, lay).items() if k != "sends"}
            shares = {**cache[key], "sends": self.sends()}  # the sends on its own axis
            out.append((paths, shares, lay.cut_paths))
        return [(paths, shares) for paths, shares, _ in out]

    def _search_cut(self, traced, mesh, split_before, balance: str, cache: dict):
        """The stages ap.plan would cut (None where the graph cannot be cut so), kept by sizes."""
        key = ("cut", mesh.axis_size(self.axis), self.chunks, balance)
        key += (self.microbatches if balance == "memory" else None, self.kind in V_SHAPED)  # a V: other ranks
        if key not in cache:
            try:
                cache[key] = self.cut(traced, mesh, split_before, balance)
            except PlanError:
                cache[key] = None
        return cache[key]

    def splits_backward(self) -> bool:
        """Zero-bubble schedules run B (input gradients) and W (weights) as two backward calls."""
        return self.kind in SPLIT_BACKWARD

    def search_label(self, mesh, structure) -> str:
        if self.kind == "interleaved":
            return f", interleaved 1F1B x{self.chunks}"
        return ", " + self.SEARCH_LABELS[self.kind] if self.kind in self.SEARCH_LABELS else ""


@dataclass(frozen=True)
class SplitBefore:
    """Annotation: a new pipeline stage starts at this module's first operation."""

    def __repr__(self) -> str:
        return "split_before()"

    def describe(self) -> str:
        return "pipeline stage boundary before this module"


def split_before() -> SplitBefore:
    """Mark a module path as the start of a pipeline stage: ``{"layers.4": ap.split_before()}``."""
    return SplitBefore()
