"""plan.diff(other): the nodes whose layout or collectives differ between two plans.

Nodes are matched by name (two plans of one model trace to the same graph). Each
difference is a row: node, module, layout here and there, collectives here and there; the
parameters whose placements differ and the bytes per axis of both plans follow.

Example:
    >>> d = plan_tp.diff(plan_dp)
    >>> print(d)          # 'linear_default: (R, S(2)) -> (S(0), R); all_reduce(tp, bwd) -> -'
    >>> len(d), bool(d)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from html import escape

from autopar.explore.diff_fold import fold_node_lines, fold_param_lines
from autopar.explore.display import comm_label, comm_totals, fmt_bytes
from autopar.placement import fmt_spec
from autopar.sharding.propagate import layout_of
from autopar.trace.module_paths import module_path


@dataclass(frozen=True)
class NodeDiff:
    node: str
    module: str
    layout: tuple[str, str]
    comms: tuple[str, str]


class PlanDiff:
    def __init__(self, a, b):
        self.a, self.b = a, b
        ca, cb = a.collectives(), b.collectives()
        self.nodes = _node_diffs(a, b, ca, cb)
        self.params = {
            n: (fmt_spec(s), fmt_spec(b.param_specs.get(n, ())))
            for n, s in a.param_specs.items()
            if b.param_specs.get(n) != s
        }
        self.totals = (comm_totals(ca), comm_totals(cb))

    def __len__(self) -> int:
        return len(self.nodes) + len(self.params)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __str__(self) -> str:
        if not self:
            return "plans agree: same layouts and collectives"
        lines = [f"{len(self.nodes)} nodes and {len(self.params)} parameters differ ({self.a.mesh} vs {self.b.mesh})"]
        lines += fold_node_lines(self.nodes) + fold_param_lines(self.params)  # repeated blocks once
        for axis in sorted(set(self.totals[0]) | set(self.totals[1])):
            x, y = (t.get(axis, {}).get("bytes", 0.0) for t in self.totals)
            lines.append(f"  bytes per step on {axis}: {fmt_bytes(x)} -> {fmt_bytes(y)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{escape(d.node)}</td><td>{escape(d.module)}</td><td>{escape(d.layout[0])}</td>"
            f"<td>{escape(d.layout[1])}</td><td>{escape(d.comms[0])}</td><td>{escape(d.comms[1])}</td></tr>"
            for d in self.nodes
        )
        head = "<tr><th>node</th><th>module</th><th>layout</th><th>other</th><th>collectives</th><th>other</th></tr>"
        return f"<pre>{escape(str(self).splitlines()[0])}</pre><table>{head}{rows}</table>"


def _labels(comms) -> dict:
    out = defaultdict(list)
    for c in comms:
        out[c.node].append(comm_label(c))
    return {k: ", ".join(v) for k, v in out.items()}


def _node_diffs(a, b, ca, cb) -> list[NodeDiff]:
    other = {n.name: n for n in b.graph.nodes if "autopar" in n.meta}
    la, lb = _labels(ca), _labels(cb)
    out = []
    for n in a.graph.nodes:
        if "autopar" not in n.meta or (n.op == "placeholder" and a.attr_name(n.name)):
            continue  # parameters are listed by name in PlanDiff.params
        m = other.get(n.name)
        x = " ".join(fmt_spec(s) for s in layout_of(n).outputs)
        y = "(missing)" if m is None else " ".join(fmt_spec(s) for s in layout_of(m).outputs)
        if x != y or la.get(n.name, "") != lb.get(n.name, ""):
            out.append(NodeDiff(n.name, module_path(n), (x, y), (la.get(n.name, ""), lb.get(n.name, ""))))
    return out


def diff_plans(a, b) -> PlanDiff:
    return PlanDiff(a, b)
