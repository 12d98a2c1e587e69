"""LayoutHooks, the layout hooks of a technique.

What a technique does to the layouts while a plan is made: the mesh it plans on, what it
refuses, how the model is traced, the graph rewrites before propagation, the inputs it
splits, and the structure it builds once the layouts are known.

Called by the planner (planner.py), in the order of technique.py's map, and by the lowerings
and ``plan.local_inputs`` that ask a split axis how its pieces are ordered.

Example:
    >>> from autopar.parallel.protocols.layout import LayoutHooks
    >>> from autopar.parallel.technique import Technique
    >>> issubclass(Technique, LayoutHooks)
    True
"""

from __future__ import annotations

import contextlib


class LayoutHooks:
    """The layout hooks of a technique (all optional: each default changes nothing)."""

    def validate(self, mesh, options, annotations: dict) -> None:
        """Raise a PlanError when the technique cannot work on this mesh with these options."""

    def reshape_mesh(self, mesh):
        """(the mesh to plan on, the technique in its terms): a technique spelled over mesh axes
        the layouts cannot use as they are (HSDP over a replicate and a shard axis becomes one
        data-parallel axis sharded in groups) rewrites both before planning."""
        return mesh, self

    def tracing(self, model):
        """A context manager under which the model is traced (a module torch.export cannot trace
        as it is, seen as what it computes: a Float8Linear as a Linear)."""
        return contextlib.nullcontext()

    def prepare_graph(self, traced) -> None:
        """Rewrite the traced graph before propagation into a value-preserving form the rules place
        better (context parallel: eager attention chains as one SDPA node)."""

    def data_axis(self) -> str | None:
        """The mesh axis that splits the batch (dim 0 of every input), if this technique does."""
        return None

    def token_axes(self) -> tuple:
        """Mesh axes over which the technique splits the tokens a rank computes on (the batch,
        the sequence): parameters stay replicated there and their gradients arrive in parts
        summed over the axis, so ZeRO may shard their state over them too
        (``DataParallel(shard_axes=...)`` folds such an axis into its shard group)."""
        return ()

    def seed_inputs(self, seeds, mesh, inputs: dict) -> None:
        """Place user inputs the technique splits (``inputs``: name -> example value) into
        ``seeds.inputs`` / ``seeds.reasons``, leaving inputs the annotations placed on its axis."""

    def annotate(self, model, traced, annotations: dict) -> dict:
        """The layout annotations the technique stands for, added to ``annotations`` before they
        are resolved into seeds (expert parallel: its per-module annotation on every experts module
        of the traced model): a new dict, ``annotations`` left as given. Not called where the seeds
        are given (a plan file's)."""
        return annotations

    @classmethod
    def prepare_seeded_graph(cls, traced, seeds, mesh, data_axis: str | None) -> None:
        """Rewrite the traced graph once the seeds are known, before propagation: called on every
        registered technique, asked for or not, after ``prepare_graph`` (a MoE model's experts
        modules become one op each, with or without expert parallel: parallel/experts/).
        ``data_axis``: the mesh axis that splits the batch, or None."""

    def attention_method(self, axis: str) -> str | None:
        """How attention split on mesh axis ``axis`` by its sequence meets every key ("ring" or
        "allgather"; the lowering of attention on a split sequence asks), or None when not this
        technique's axis."""
        return None

    def loss_mean_on(self, axis: str) -> str | None:
        """How a mean over rows split on mesh axis ``axis`` divides (the cross-entropy lowering
        asks): "per_rank" (by the rank's own count, DDP's loss) or "global" (by every rank's), None
        when not this technique's axis."""
        return None

    def piece_order(self, axis: str) -> str | None:
        """The order of the pieces of every dim split on mesh axis ``axis``: None (contiguous) or
        one of placement.PIECE_ORDERS ("zigzag": rank r holds chunks r and 2n-1-r). Such splits are
        then ``Shard(dim, order=...)`` layouts (sharding/piece_order.py says which values): the
        emitted program's redistributions and plan.local_inputs follow them."""
        return None

    def after_plan(self, plan):
        """Structure built once the layouts are known (the pipeline cuts the graph into stages);
        what it returns is kept as ``plan.built[self.name]``."""
