"""The automatic plan's alternatives side by side: each option the search weighed (its best
component choices) as predicted step time against memory per rank, the budget as a line.

``plan.plot_search()`` is the matplotlib Figure; ``plan.search_view()`` shows it (a PNG, so it
reads in static HTML without a kernel) above a table of the options, the chosen one marked,
the chosen plan's and the runner-up's ``explain("auto")`` one click away, and (with a kernel) a
dropdown that plans any option and shows its explain (``view.explain(i)`` anywhere). The options come from the search's
record (``plan.built["auto"]``: the 12 fastest, and the fastest one the budget refused).

Example:
    >>> plan = ap.plan(model, mesh, args=args, auto=ap.Auto(device="h100", memory_budget=40e9))
    >>> plan.search_view()            # in a notebook cell
    >>> print(plan.search_view().explain(1))   # the runner-up, planned and explained
    >>> plan.plot_search().savefig("search.png")
"""

from __future__ import annotations

import base64
import warnings
from html import escape

from autopar.errors import PlanError
from autopar.explore.auto_explain import search_text
from autopar.explore.display import fmt_bytes
from autopar.explore.plots import _figure, _unit


def search_record(plan) -> dict:
    rec = plan.built.get("auto")
    if not rec:
        raise PlanError(
            "This plan was not searched: plan with ap.plan(..., auto=ap.Auto(device=...)) to see the options "
            "the search weighed."
        )
    return rec


def options(rec: dict) -> list[dict]:
    """The options weighed, fastest first: the runners-up, then the one the budget refused."""
    out = [dict(r) for r in rec["runners_up"]]
    if rec.get("binding"):
        fast = rec["binding"]["faster"]
        out.append({"option": fast["option"], "time_s": fast["time_s"], "memory": fast["memory"], "fits": False})
    for r in out:
        r["chosen"] = r["option"] == rec.get("chosen_option", rec["chosen"])
    return out


def plot_search(plan):
    """Time against memory per rank: fitting options as dots, refused ones as crosses, the
    chosen one as a star; the memory budget as a vertical line."""
    rec = search_record(plan)
    opts = [o for o in options(rec) if o["time_s"] is not None]
    scale, unit = _unit([o["memory"] for o in opts] + [rec["budget"] or 0.0])
    fig = _figure(7.0, 4.0)
    ax = fig.add_subplot()
    for fits, marker, color, label in ((True, "o", "#4c72b0", "fits"), (False, "x", "#c44e52", "over budget")):
        pts = [o for o in opts if o["fits"] == fits and not o["chosen"]]
        if pts:
            xs, ys = [o["memory"] / scale for o in pts], [o["time_s"] * 1e3 for o in pts]
            ax.scatter(xs, ys, marker=marker, color=color, label=label)
    # the chosen option where the search put it (the others' basis), and the plan's own count of it
    mine = next((o for o in opts if o["chosen"]), {"memory": rec["memory"], "time_s": rec["time_s"]})
    at = (mine["memory"] / scale, mine["time_s"] * 1e3)
    ax.scatter([at[0]], [at[1]], marker="*", s=220, color="#dd8452", label="chosen")
    ax.annotate(rec["chosen"], at, fontsize=8, xytext=(6, 6), textcoords="offset points")
    if abs(rec["memory"] - mine["memory"]) > 0.01 * mine["memory"]:
        ax.scatter(
            [rec["memory"] / scale],
            [at[1]],
            marker="D",
            facecolors="none",
            color="#dd8452",
            label="chosen, the plan's own memory count",
        )
    if rec["budget"] is not None:
        ax.axvline(rec["budget"] / scale, color="#c44e52", linestyle="--", label=f"budget {fmt_bytes(rec['budget'])}")
    ax.set_xlabel(f"memory per rank ({unit})")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"options weighed on {plan.mesh} ({rec['profile']['name']})", fontsize=10)
    ax.legend(fontsize=8)
    return fig


class SearchView:
    """``plan.search_view()``: the plot and the options' table (see the module docstring).

    ``explain(i)`` plans row ``i`` of the table (an option's label works too; no argument: the
    runner-up, the fastest other option that fits) with ``ap.Auto(option=...)`` and returns its
    ``explain("auto")``; ``widget()`` is a
    dropdown of the options that shows the chosen one's explain (ipywidgets); the static HTML
    carries the chosen plan's and the runner-up's explains behind a click.
    """

    def __init__(self, plan):
        self.plan, self.rec = plan, search_record(plan)
        self._plans: dict[str, object] = {}  # label -> the plan of that option, made once

    def option_plan(self, which):
        """The plan of option ``which`` (an index into the table, or a label), planned once."""
        label = self._label(which)
        if label in (self.rec["chosen"], self.rec.get("chosen_option")):
            return self.plan
        if label not in self._plans:
            planner = getattr(self.plan, "plan_option", None)
            if planner is None:
                raise PlanError(
                    "This plan cannot plan its other options: it was loaded from a plan file (or made by "
                    "Plan.with_options), which keeps the search's record but not the model it planned. Plan "
                    f"again with ap.plan(..., auto=ap.Auto(..., option={label!r})) to explain that option."
                )
            with warnings.catch_warnings():  # an option over the budget says so in its explain
                warnings.simplefilter("ignore")
                self._plans[label] = planner(label)
        return self._plans[label]

    def explain(self, which=None) -> str:
        """``explain("auto")`` of option ``which`` (a table row or a label; None: the runner-up)."""
        return self.option_plan(which).explain("auto")

    def runner_up(self) -> str | None:
        """The fastest option that fits other than the chosen one (None: there is none)."""
        r = self.rec.get("runner_up")
        if r is not None:
            return r["option"]
        return next((o["option"] for o in options(self.rec) if not o["chosen"]), None)

    def _label(self, which) -> str:
        opts = options(self.rec)
        if which is None:
            which = self.runner_up()
            if which is None:
                raise PlanError("search_view().explain(): the search weighed no option but the chosen one.")
        if isinstance(which, str):
            if which not in [o["option"] for o in opts] + [self.rec["chosen"]]:
                raise PlanError(
                    f"search_view().explain({which!r}): no such option; the options are "
                    + "; ".join(o["option"] for o in opts)
                )
            return which
        if not -len(opts) <= which < len(opts):
            raise PlanError(f"search_view().explain({which}): there are {len(opts)} options (0 to {len(opts) - 1}).")
        return opts[which]["option"]

    def widget(self):
        """A dropdown of the options above the chosen one's explain; choosing one plans it
        (a few seconds at model size on meta, once) and shows its explain."""
        import ipywidgets as w  # optional: only the widget needs it

        labels = [o["option"] for o in options(self.rec)]
        chosen_label = next((o["option"] for o in options(self.rec) if o["chosen"]), None)
        box = w.Dropdown(
            options=labels,
            value=chosen_label if chosen_label in labels else None,
            description="option",
            layout=w.Layout(width="90%"),
        )
        shown = w.HTML(f"<pre>{escape(search_text(self.rec))}</pre>")

        def chosen(change):
            shown.value = "<p><i>planning...</i></p>"
            shown.value = f"<pre>{escape(self.explain(change['new']))}</pre>"

        box.observe(chosen, names="value")
        return w.VBox([w.HTML(self._repr_html_()), box, shown])

    def __str__(self) -> str:
        lines = [f"{'option':56} {'step':>11} {'memory/rank':>12}"]
        for o in options(self.rec):
            mark = "  <- chosen" if o["chosen"] else ("" if o["fits"] else "  (over budget)")
            lines.append(f"{o['option'][:56]:56} {_ms(o['time_s']):>11} {fmt_bytes(o['memory']):>12}{mark}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        png = base64.b64encode(plot_search(self.plan)._repr_png_()).decode()
        rows = []
        for o in options(self.rec):
            style = ' style="font-weight:bold; background:#fff4e0"' if o["chosen"] else ""
            fits = "chosen" if o["chosen"] else ("fits" if o["fits"] else "over budget")
            rows.append(
                f"<tr{style}><td style='text-align:left'>{escape(o['option'])}</td><td>{_ms(o['time_s'])}</td>"
                f"<td>{fmt_bytes(o['memory'])}</td><td>{fits}</td></tr>"
            )
        why = escape(search_text(self.rec))
        return (
            f'<div class="autopar-search"><img src="data:image/png;base64,{png}">'
            "<table style='font-family:monospace; font-size:12px'><tr><th style='text-align:left'>option</th>"
            f"<th>step</th><th>memory per rank</th><th></th></tr>{''.join(rows)}</table>"
            f'<details><summary>why: explain("auto")</summary><pre>{why}</pre></details>'
            f"{self._runner_up_html()}</div>"
        )

    def _runner_up_html(self) -> str:
        """The runner-up's explain behind a click, where the plan can plan it (not a loaded one)."""
        label = self.runner_up()
        if label is None or getattr(self.plan, "plan_option", None) is None:
            return ""
        return (
            f"<details><summary>the runner-up: {escape(label)}: explain</summary>"
            f"<pre>{escape(self.explain(label))}</pre></details>"
        )

    def _repr_mimebundle_(self, include=None, exclude=None):
        """The widget where a kernel runs it, the static HTML (plot, table, two explains) where none does."""
        bundle = {}
        try:
            bundle.update(self.widget()._repr_mimebundle_())
        except ImportError:
            pass
        return {**bundle, "text/plain": str(self), "text/html": self._repr_html_()}  # ours, not the VBox's


def _ms(t) -> str:
    return "-" if t is None else f"{t * 1e3:.3f} ms"
