"""The Jupyter view of a plan (``Plan._repr_html_``): a summary header and the module tree.

The header names the mesh and ranks, memory per rank (parameters, gradients, optimizer
state, activations) and the bytes each rank communicates per step, by axis and phase. The
tree (``module_tree``: repeated blocks folded) is nested HTML ``<details>``: one line per
module with its output layout, parameters' placements, collectives and bytes, opened on
click; under it the ops that run a collective, and the others behind one more click
("12 ops without collectives"). Plain HTML and CSS, no script: it reads the same in
JupyterLab, VS Code and a static nbconvert page. Each collective is coloured by kind (hover:
its bytes formula).

Example:
    >>> plan            # in a notebook cell
    >>> from autopar.explore.html import plan_html; open("plan.html", "w").write(plan_html(plan))
"""

from __future__ import annotations

from html import escape

from autopar.explore.display import comm_label, comm_totals, fmt_bytes, memory_numbers
from autopar.explore.module_tree import ModuleNode, module_tree, op_cell

COLORS = {
    "all_reduce": "#f4a3a3",
    "all_gather": "#a3c8f4",
    "reduce_scatter": "#f4d28a",
    "all_to_all": "#c6a3f4",
    "ring_pass": "#a3f4c6",
    "ring_shift": "#a3f4c6",
}

GRID = "grid-template-columns: minmax(24em, 34em) 9em minmax(8em, 20em) minmax(14em, 1fr) 15em"
STYLE = f"""<style>
.autopar-plan {{font-family: monospace; font-size: 12px; text-align: left;}}
.autopar-plan ul {{margin: 0 0 6px 0;}}
.autopar-plan .g {{display: grid; {GRID}; column-gap: 8px; padding: 1px 4px; border-bottom: 1px solid #eee;}}
.autopar-plan .g > span {{overflow: hidden; text-overflow: ellipsis; white-space: nowrap; text-align: left;}}
.autopar-plan .head {{font-weight: bold; border-bottom: 2px solid #888;}}
.autopar-plan summary {{list-style: none; cursor: pointer;}}
.autopar-plan summary::-webkit-details-marker {{display: none;}}
.autopar-plan summary.g:hover {{background: #eef4ff;}}
.autopar-plan details > summary .n::before {{content: "\\25B8  "; color: #666;}}
.autopar-plan details[open] > summary .n::before {{content: "\\25BE  "; color: #666;}}
.autopar-plan .fold {{font-weight: bold;}}
.autopar-plan .fold .x {{background: #e2e8f0; border-radius: 3px; padding: 0 4px;}}
.autopar-plan .differs {{color: #b45309;}}
.autopar-plan .note {{padding: 1px 4px; white-space: nowrap;}}
.autopar-plan .op {{color: #444;}}
.autopar-plan .op.comm {{background: #fff4e0;}}
.autopar-plan .quiet {{color: #888;}}
.autopar-plan span.c {{border-radius: 3px; padding: 0 4px; margin-right: 3px;}}
.autopar-plan .num {{text-align: right !important;}}
</style>"""


def _badge(c, n: int = 1) -> str:
    """A collective coloured by kind ('x n': n of them, one per folded block or op); hover: its bytes formula."""
    color = COLORS.get(c.kind, "#ddd")
    title = escape(f"{c.phase}: {c.formula} bytes" if c.formula is not None else c.phase)
    label = comm_label(c) + (f" x{n}" if n > 1 else "")
    return f'<span class="c" style="background:{color}" title="{title}">{escape(label)}</span>'


def summary_html(plan, comms) -> str:
    mem = memory_numbers(plan)
    mesh = plan.mesh
    items = [
        f"<b>{escape(type(plan.model).__name__)}</b> on mesh "
        f"{escape(', '.join(f'{a}={n}' for a, n in zip(mesh.axis_names, mesh.shape)))}"
        f" ({mesh.size} ranks)",
        f"memory per rank at the step's peak: {fmt_bytes(mem['peak'])} ({escape(mem['phase'])})",
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
    """The summary and the folded module tree (``Plan._repr_html_``)."""
    return tree_html(plan, ops=False)


def tree_html(plan, ops: bool = False) -> str:
    """The summary and the tree; ``ops``: every op shown, not behind a click."""
    comms = plan.collectives()
    head = _row([f"<span>{h}</span>" for h in ("module", "layout", "parameters", "collectives", "bytes")])
    out = [STYLE, '<div class="autopar-plan">', summary_html(plan, comms), f'<div class="g head">{head}</div>']
    out += _items(module_tree(plan, comms), ops, 0)
    out.append("</div>")
    return "\n".join(out)


def _items(node: ModuleNode, ops: bool, depth: int) -> list[str]:
    out, quiet = [], []
    for item in node.items:
        if isinstance(item, ModuleNode):
            out.append(_module(item, ops, depth))
        elif item.comms and node.name != "(grad sync)":
            out.append(_op(item, depth))
        else:
            quiet.append(_op(item, depth))
    if quiet and ops:
        out += quiet
    elif quiet:
        what = "gradient bucket" if node.name == "(grad sync)" else "op without collectives"
        what = what.replace("bucket", "buckets").replace("op ", "ops ") if len(quiet) > 1 else what
        summary = f'<summary class="g quiet">{_cell(f"{len(quiet)} {what}", depth, "n")}</summary>'
        out.append(f"<details>{summary}{''.join(quiet)}</details>")
    return out


def _module(node: ModuleNode, ops: bool, depth: int) -> str:
    title = escape(node.name)
    cls = "g"
    if node.count > 1:
        cls += " fold"
        title += f' <span class="x">x {node.count}</span> identical plan'
    title += escape(node.stage_text)
    if node.differs:
        title += f' <span class="differs" title="{escape(node.differs)}">differs</span>'
    params = ", ".join(f"{k} {v}" for k, v in node.params)
    cells = [
        _cell(title, depth, "n", raw=True),
        f"<span>{escape(node.layout())}</span>",
        f'<span title="{escape(params)}">{escape(params)}</span>',
        f"<span>{_counted(node.comms())}</span>",
        f'<span class="num">{escape(node.bytes_text())}</span>',
    ]
    inner = _items(node, ops, depth + 1)
    if node.differs:  # the whole sentence, first thing inside
        inner.insert(0, f'<div class="note">{_cell(f"({node.differs})", depth + 1, "differs")}</div>')
    # the top modules open to show the structure; leaves and folded blocks stay one line until clicked
    opened = depth == 0 and node.children() and node.count == 1
    return (
        f'<details{" open" if opened else ""}><summary class="{cls}">{_row(cells)}</summary>{"".join(inner)}</details>'
    )


def _op(row, depth: int) -> str:
    cls = "g op comm" if row.comms else "g op"
    cells = [
        _cell(op_cell(row), depth, "o"),
        f"<span>{escape(row.layout)}</span>",
        "<span></span>",
        f"<span>{_counted(row.comms)}</span>",
        f'<span class="num">{fmt_bytes(row.bytes) if row.comms else ""}</span>',
    ]
    return f'<div class="{cls}">{_row(cells)}</div>'


def _row(cells: list[str]) -> str:
    """The cells with a space between: ignored by the grid, and what keeps a line readable where a
    notebook's HTML is shown without its <style> (an untrusted notebook in JupyterLab)."""
    return " ".join(cells)


def _cell(text: str, depth: int, cls: str, raw: bool = False) -> str:
    return f'<span class="{cls}" style="padding-left: {1.4 * depth:.1f}em">{text if raw else escape(text)}</span>'


def _counted(comms) -> str:
    """One badge per kind of collective (the count in its text when more than one)."""
    seen: dict = {}
    for c in comms:
        seen.setdefault(comm_label(c), []).append(c)
    return " ".join(_badge(cs[0], len(cs)) for cs in seen.values())
