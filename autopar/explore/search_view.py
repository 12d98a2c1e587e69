"""The automatic plan's alternatives side by side: each option the search weighed (its best
component choices) as predicted step time against memory per rank, the budget as a line.

``plan.plot_search()`` is the matplotlib Figure; ``plan.search_view()`` shows it (a PNG, so it
reads in static HTML without a kernel) above a table of the options, the chosen one marked,
and the chosen plan's ``explain("auto")`` one click away. The options come from the search's
record (``plan.built["auto"]``: the 12 fastest, and the fastest one the budget refused).

Example:
    >>> plan = ap.plan(model, mesh, args=args, auto=ap.Auto(device="h100", memory_budget=40e9))
    >>> plan.search_view()            # in a notebook cell
    >>> plan.plot_search().savefig("search.png")
"""

from __future__ import annotations

import base64
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
        r["chosen"] = r["option"] == rec["chosen"]
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
    """``plan.search_view()``: the plot and the options' table (see the module docstring)."""

    def __init__(self, plan):
        self.plan, self.rec = plan, search_record(plan)

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
            f'<details><summary>why: explain("auto")</summary><pre>{why}</pre></details></div>'
        )


def _ms(t) -> str:
    return "-" if t is None else f"{t * 1e3:.3f} ms"
