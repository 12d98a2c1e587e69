"""The Jupyter view of a plan (``Plan._repr_html_``): a summary header and a table grouped by module.

The header names the mesh and ranks, memory per rank (parameters, gradients, optimizer
state, activations) and the bytes each rank communicates per step, by axis and phase. The
table has one group per layer (``blocks.0``; a module path without an index is its own
group), in graph order, with the sub-module, node, op, layout, collectives and bytes of each
op; rows with collectives are highlighted, each collective coloured by kind (hover: its
bytes formula).

Example:
    >>> plan            # in a notebook cell
    >>> from autopar.explore.html import plan_html; open("plan.html", "w").write(plan_html(plan))
"""

from __future__ import annotations

from html import escape
from itertools import groupby

from autopar.explore.display import comm_label, comm_totals, fmt_bytes, memory_numbers, plan_rows
from autopar.cost.plan_cost import layer_of

COLORS = {
    "all_reduce": "#f4a3a3",
    "all_gather": "#a3c8f4",
    "reduce_scatter": "#f4d28a",
    "all_to_all": "#c6a3f4",
    "ring_pass": "#a3f4c6",
    "ring_shift": "#a3f4c6",
}

STYLE = """<style>
.autopar-plan table {border-collapse: collapse; font-family: monospace; font-size: 12px;}
.autopar-plan th {text-align: left; border-bottom: 2px solid #888; padding: 2px 8px; cursor: pointer;}
.autopar-plan td {padding: 1px 8px; border-bottom: 1px solid #eee;}
.autopar-plan tr.group td {background: #f0f0f0; font-weight: bold;}
.autopar-plan tr.comm td {background: #fff4e0;}
.autopar-plan span.c {border-radius: 3px; padding: 0 4px; margin-right: 3px;}
.autopar-plan td.num {text-align: right;}
</style>"""


def _badge(c) -> str:
    color = COLORS.get(c.kind, "#ddd")
    title = escape(f"{c.phase}: {c.formula} bytes" if c.formula is not None else c.phase)
    return f'<span class="c" style="background:{color}" title="{title}">{escape(comm_label(c))}</span>'


def summary_html(plan, comms) -> str:
    mem = memory_numbers(plan)
    mesh = plan.mesh
    items = [
        f"<b>{escape(type(plan.model).__name__)}</b> on mesh "
        f"{escape(', '.join(f'{a}={n}' for a, n in zip(mesh.axis_names, mesh.shape)))}"
        f" ({mesh.size} ranks)",
        "memory per rank: "
        + ", ".join(
            f"{k} {fmt_bytes(mem[k])}" for k in ("params", "grads", "optimizer", "activations", "gathered") if k in mem
        )
        + f" (serial params {fmt_bytes(mem['serial params'])})",
    ]
    for axis, t in comm_totals(comms).items():
        parts = ", ".join(f"{k} {fmt_bytes(t[k])}" for k in ("forward", "backward", "grad sync") if t[k])
        items.append(
            f"communication on <b>{escape(axis)}</b>: {t['count']} collectives, "
            f"{fmt_bytes(t['bytes'])} per step and rank ({parts})"
        )
    return "<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>"


def plan_html(plan) -> str:
    comms = plan.collectives()
    rows = plan_rows(plan, comms)
    out = [
        STYLE,
        '<div class="autopar-plan">',
        summary_html(plan, comms),
        "<table>",
        "<tr>"
        + "".join(f"<th>{h} &#x25BE;</th>" for h in ("module", "node", "op", "layout", "collectives", "bytes"))
        + "</tr>",
    ]
    for layer, group in groupby(rows, key=lambda r: layer_of(r.module)):
        group = list(group)
        total = sum(r.bytes for r in group)
        out.append(
            f'<tr class="group"><td colspan="5">{escape(layer)}</td>'
            f'<td class="num">{fmt_bytes(total) if total else ""}</td></tr>'
        )
        for r in group:
            cls = ' class="comm"' if r.comms else ""
            sub = r.module[len(layer) + 1 :] if r.module.startswith(layer + ".") else ""
            out.append(
                f"<tr{cls}><td>{escape(sub)}</td><td>{escape(r.node)}</td><td>{escape(r.op)}</td>"
                f"<td>{escape(r.layout)}</td><td>{''.join(_badge(c) for c in r.comms)}</td>"
                f'<td class="num">{fmt_bytes(r.bytes) if r.comms else ""}</td></tr>'
            )
    out += ["</table>", "</div>"]
    return "\n".join(out)
