"""The default view of a plan: the summary, then the module tree with repeated blocks folded,
one line per module (its output layout, its parameters' placements, the collectives of its
subtree and their bytes), and under each module the ops that run a collective. ``ops=True``
lists every op (of one block per fold) too.

Example:
    >>> print(plan)                        # summary + tree: 'layers.0-31 x 32, identical plan'
    >>> plan.tree(ops=True)                # in Jupyter: folded <details>, every op one click away
    >>> print(plan.tree(ops=True))         # the text with every op
"""

from __future__ import annotations

from autopar.explore.display import Text, fmt_bytes, summary
from autopar.explore.html import tree_html
from autopar.explore.module_tree import ModuleNode, count_labels, module_tree, op_cell

HEAD = ("module", "layout", "parameters", "collectives", "bytes")
WIDTHS = (56, 16, 34, 64)  # the widest module, layout, parameters and collectives cells kept whole
QUIET = ("(grad sync)",)
NOTE = object()  # a line that is one sentence, not columns (how a block differs)  # its rows are many buckets of one kind: one line says them unless ops=True


def tree_lines(node: ModuleNode, ops: bool = False, depth: int = 0) -> list[tuple]:
    """(indent, module cell, layout, parameters, collectives, bytes) per line, depth first."""
    out = []
    for item in node.items:
        pad = "  " * depth
        if isinstance(item, ModuleNode):
            params = ", ".join(f"{k} {v}" for k, v in item.params)
            out.append((pad + item.title(), item.layout(), params, item.comm_summary(), item.bytes_text()))
            if item.differs:
                out.append((NOTE, f"{pad}  ({item.differs})"))
            out += tree_lines(item, ops, depth + 1)
        elif ops or (item.comms and node.name not in QUIET):
            comms = count_labels(item.comms)
            out.append((pad + op_cell(item), item.layout, "", comms, fmt_bytes(item.bytes) if item.comms else ""))
    return out


def tree_text(plan, ops: bool = False, comms=None) -> str:
    """The summary, a blank line, then the tree as aligned columns."""
    comms = plan.collectives() if comms is None else comms
    lines = [HEAD] + tree_lines(module_tree(plan, comms), ops)
    widths = [min(max(len(r[i]) for r in lines if r[0] is not NOTE), WIDTHS[i]) for i in range(4)]
    out = [summary(plan, comms), ""]
    for r in lines:
        if r[0] is NOTE:
            out.append(r[1])
            continue
        cells = [_cut(r[i], widths[i]).ljust(widths[i]) for i in range(4)]
        out.append(("  ".join(cells) + "  " + r[4]).rstrip())
    return "\n".join(out)


def _cut(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


class PlanTree:
    """``plan.tree(ops=...)``: the folded module tree, as text (str) and as HTML (Jupyter)."""

    def __init__(self, plan, ops: bool = False):
        self.plan, self.ops = plan, ops

    def __str__(self) -> str:
        return tree_text(self.plan, self.ops)

    def __repr__(self) -> str:
        return str(Text(str(self)))

    def _repr_html_(self) -> str:
        return tree_html(self.plan, self.ops)
