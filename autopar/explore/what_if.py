"""What-if in one cell: the same model planned again with another mesh shape, budget or batch,
through a widget that re-plans and redraws on each change.

``what_if(build, **choices)`` takes a function that makes a plan from keyword choices and the
values each may take. In a notebook with ipywidgets it shows one dropdown per choice above a
panel (memory per rank, bytes per axis, the folded module tree); a change re-plans (a plan once
made is kept, so going back is instant) and redraws. Without a kernel (a static HTML page) the
panel of the first choices shows as plain HTML. ``.plan(**choice)`` and ``.table()`` work
anywhere: the second lists every combination planned so far side by side.

Example:
    >>> def build(tp, batch):
    ...     ids = torch.zeros(batch, 2048, dtype=torch.long, device="meta")
    ...     mesh = ap.Mesh((64 // tp, tp), ("dp", "tp"))
    ...     return ap.plan(model, mesh, kwargs={"input_ids": ids, "labels": ids},
    ...                    annotations=ap.presets.megatron(model, "tp", kwargs=...), data_parallel="dp")
    >>> what_if(build, tp=[8, 4, 2], batch=[8, 16])      # in a notebook cell
"""

from __future__ import annotations

import itertools
import time
from html import escape

from autopar.explore.display import comm_totals, fmt_bytes, memory_numbers
from autopar.explore.html import plan_html


class WhatIf:
    """Plans of one model under several choices, kept; shown as a widget (see the module docstring)."""

    def __init__(self, build, **choices):
        if not choices or any(not list(v) for v in choices.values()):
            raise ValueError("what_if needs at least one choice with values, e.g. what_if(build, tp=[8, 4]).")
        self.build, self.choices = build, {k: list(v) for k, v in choices.items()}
        self.plans: dict[tuple, tuple] = {}  # choice values -> (plan, seconds it took)
        self.current = {k: v[0] for k, v in self.choices.items()}

    def plan(self, **choice):
        """The plan for ``choice`` (missing keys: the current ones), made once."""
        choice = {**self.current, **choice}
        key = tuple(choice[k] for k in self.choices)
        if key not in self.plans:
            start = time.perf_counter()
            made = self.build(**choice)
            self.plans[key] = (made, time.perf_counter() - start)
        return self.plans[key][0]

    def figures(self, plan) -> dict:
        mem = memory_numbers(plan)
        out = {"memory per rank": mem["peak"]}  # the step's peak, as ap.predict gives it
        for axis, t in comm_totals(plan.collectives()).items():
            out[f"bytes on {axis}"] = t["bytes"]
        return out

    def table(self) -> str:
        """Every combination planned so far: the choices, memory per rank, bytes per axis, seconds."""
        rows = []
        for key, (plan, seconds) in self.plans.items():
            figs = self.figures(plan)
            cells = [f"{k}={v}" for k, v in zip(self.choices, key)]
            cells += [f"{k} {fmt_bytes(v)}" for k, v in figs.items()] + [f"planned in {seconds:.1f} s"]
            rows.append(", ".join(cells))
        return "\n".join(rows)

    def panel_html(self) -> str:
        plan = self.plan()
        key = tuple(self.current[k] for k in self.choices)
        head = ", ".join(f"{k}={v}" for k, v in self.current.items())
        return f"<p><b>{escape(head)}</b>: planned in {self.plans[key][1]:.1f} s</p>" + plan_html(plan)

    def widget(self):
        """Dropdowns and the panel (ipywidgets); a change re-plans and redraws."""
        import ipywidgets as w  # optional: only the widget needs it

        panel = w.HTML(self.panel_html())
        boxes = []
        for name, values in self.choices.items():
            box = w.Dropdown(options=values, value=self.current[name], description=name)

            def changed(change, name=name):
                self.current[name] = change["new"]
                panel.value = "<p><i>planning...</i></p>" + panel.value
                panel.value = self.panel_html()

            box.observe(changed, names="value")
            boxes.append(box)
        return w.VBox([w.HBox(boxes), panel])

    def _repr_mimebundle_(self, include=None, exclude=None):
        """The widget where a kernel runs it, the current panel as HTML where none does."""
        bundle = {"text/plain": f"what_if({', '.join(self.choices)}): {self.current}", "text/html": self.panel_html()}
        try:
            bundle.update(self.widget()._repr_mimebundle_())
        except ImportError:
            pass
        return bundle


def what_if(build, **choices) -> WhatIf:
    """``build(**choice)`` makes a plan; ``choices`` name the values each keyword may take."""
    return WhatIf(build, **choices)


def every(w: WhatIf) -> list[dict]:
    """Every combination of the choices (to plan them all: ``for c in every(w): w.plan(**c)``)."""
    return [dict(zip(w.choices, values)) for values in itertools.product(*w.choices.values())]
