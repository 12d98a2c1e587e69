"""What a Plan shows of itself: the table, summary and HTML, explain, the collectives and
costs, plots, drawings, the timeline of a technique's schedule (its ``timeline`` display hook),
plan files and diffs. Mixed into Plan, so that plan.py keeps layouts and modules and everything
here reads a plan without deciding anything; a view of one technique's own (the pipeline's
``plan.schedule_table``) is that technique's plan method, in its folder.

Example:
    >>> print(plan); plan.explain("blocks.0.mlp.fc"); plan.cost().at(B=64)
    >>> plan.save("gpt.json"); plan.diff(other)
"""

from __future__ import annotations

from autopar.cost import Cost, collectives
from autopar.errors import PlanError
from autopar.explore import display
from autopar.explore.diff import diff_plans
from autopar.explore.draw import draw
from autopar.explore.explain import explain
from autopar.explore.html import plan_html
from autopar.explore.param_view import ParamOnMesh
from autopar.explore.plan_file import save_plan
from autopar.explore.search_view import SearchView, plot_search
from autopar.explore.tree_view import PlanTree, tree_text
from autopar.explore.plots import plot_comm, plot_memory, plot_timeline


class PlanViews:
    """The display side of Plan (see the module docstring)."""

    def collectives(self) -> list:
        """Every collective one training step runs (forward, backward, gradient sync), per rank."""
        comms = self.__dict__.get("_comms")
        if comms is None:  # a plan does not change once made; str(plan) asks twice
            comms = self.__dict__["_comms"] = collectives(self)
        return list(comms)

    def __str__(self) -> str:
        parts = [tree_text(self)] + [t.describe(self) for t in self.options.techniques]
        return "\n\n".join(p for p in parts if p)

    def tree(self, ops: bool = False) -> PlanTree:
        """The module tree, repeated blocks folded (``print(plan)`` and the notebook view);
        ``ops=True`` lists every op, not only those that run a collective."""
        return PlanTree(self, ops)

    def table(self, only_collectives: bool = False) -> str:
        """The flat table: one line per op, every block written out (for grep and diff)."""
        return display.plan_table(self, only_collectives=only_collectives)

    def param_on_mesh(self, name: str) -> ParamOnMesh:
        """Which piece of parameter ``name`` each rank holds: the mesh as a grid, the piece shaded
        (SVG in Jupyter, index ranges as text)."""
        return ParamOnMesh(self, name)

    def summary(self) -> str:
        return display.summary(self)

    def _repr_html_(self) -> str:
        return plan_html(self)

    def explain(self, name: str) -> str:
        """Why ``name`` (node, parameter, input or module path) got its layout and collectives."""
        return explain(self, name)

    def cost(
        self, sizes: dict | None = None, names: dict | None = None, optimizer_states: int = 2, rank: int | None = None
    ) -> Cost:
        """Bytes moved per step per axis, memory per rank and FLOPs as sympy formulas (ap.Cost).
        The memory is ``rank``'s (None: the rank that holds the most, plan.peak_memory_rank()):
        the parts plan.memory_per_rank(rank) counts, summing to its total at the example; so are
        the FLOPs of a pipelined plan (its stages' ops, every micro-batch)."""
        return Cost(self, sizes, names, optimizer_states, rank)

    def plot_memory(self, **kw):
        """matplotlib Figure: memory per rank (params, grads, optimizer, activations)."""
        return plot_memory(self, **kw)

    def plot_comm(self, **kw):
        """matplotlib Figure: bytes per step and rank, per layer and mesh axis."""
        return plot_comm(self, **kw)

    def plot_search(self):
        """matplotlib Figure of an automatic plan's options: step time against memory per rank, the budget a line."""
        return plot_search(self)

    def search_view(self) -> SearchView:
        """An automatic plan's options side by side: the plot, a table, the chosen one's explain."""
        return SearchView(self)

    def draw(self, rank: int = 0, **kw):
        """This rank's graph, collectives coloured: SVG with Graphviz ``dot``, DOT text otherwise."""
        return draw(self, rank, **kw)

    def timeline_figure(self, events_per_rank=None, title: str | None = None):
        """A matplotlib Figure of the schedule (unit slots), or of measured runner timelines: the
        actions of the technique that runs each rank through a schedule (its ``timeline`` hook)."""
        for technique in self.options.techniques:
            found = technique.timeline(self, events_per_rank)
            if found is not None:
                rows, unit, marked = found
                return plot_timeline(rows, unit, title, marked)
        raise PlanError(
            "plan.timeline_figure(): this plan runs no schedule of actions to draw "
            "(a pipeline does: pass pipeline=ap.Pipeline(...) to ap.plan)."
        )

    def save(self, path) -> None:
        """Write the plan (mesh, annotations' seeds, every node's layout and strategies) as JSON."""
        save_plan(self, path)

    def diff(self, other):
        """Nodes whose layout or collectives differ between two plans of one model."""
        return diff_plans(self, other)
