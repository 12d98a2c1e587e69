"""Text views of a plan: the per-op table and the summary.

Rows come from ``plan_rows`` (shared with the HTML view): one per op that produces a tensor,
in graph order, with its module path, output placements and the collectives written on its
input edges (forward, backward and Megatron's "f"), then the gradient-sync buckets.

Example:
    >>> print(plan)            # summary, then: module, node, op, layout, collectives, bytes
    module             node            op         layout        collectives                bytes
    blocks.0.attn.qkv  linear_default  linear     (S(0), S(2))  all_reduce(tp, bwd)      4.0 KiB
    >>> print(plan.summary())
"""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import dataclass, field

from autopar.placement import fmt_spec
from autopar.sharding.propagate import layout_of
from autopar.trace.module_paths import module_path
from autopar.cost.plan_cost import Cost

HIDDEN_OPS = {"getitem", "sym_size", "_assert_scalar", "sym_constrain_range_for_size"}


class Text(str):
    """A str that shows as itself in Jupyter and in the REPL (no quotes, real newlines)."""

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(str(self))}</pre>"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def op_name(node) -> str:
    t = node.target
    name = getattr(t, "__name__", str(t))
    return name.split(".")[0]


def comm_label(c) -> str:
    phase = {
        "forward": "",
        "backward": ", bwd",
        "grad sync": ", grad sync",
        "optimizer": ", after step",
        "recompute": ", recompute",
    }[c.phase]
    return f"{c.kind}({c.axis}{phase})"


@dataclass
class Row:
    node: str
    module: str
    op: str
    layout: str
    comms: list = field(default_factory=list)
    stage: int | None = None  # the pipeline stage running it (None: no pipeline, or not a stage's op)

    @property
    def bytes(self) -> float:
        return sum(c.bytes for c in self.comms)


def plan_rows(plan, comms=None) -> list[Row]:
    """One Row per tensor-producing op (graph order), then one per gradient bucket."""
    comms = plan.collectives() if comms is None else comms
    at = defaultdict(list)
    for c in comms:
        at[c.node].append(c)
    stage_of = {n: st.index for st in plan.stage_layout.stages for n in st.nodes} if plan.stage_layout else {}
    rows = []
    for node in plan.graph.nodes:
        if node.op == "output" and at[node.name]:
            rows.append(Row(node.name, "(outputs)", "output", "-", at[node.name]))
        if node.op != "call_function" or "autopar" not in node.meta or op_name(node) in HIDDEN_OPS:
            continue
        lay = layout_of(node)
        if not lay.outputs:
            continue
        layout = " ".join(fmt_spec(s) for s in lay.outputs)
        rows.append(Row(node.name, module_path(node), op_name(node), layout, at[node.name], stage_of.get(node.name)))
    nodes = {n.name for n in plan.graph.nodes}
    for c in comms:
        if c.phase in ("grad sync", "optimizer"):
            rows.append(Row(c.node, "(grad sync)", "bucket", "-", [c]))
        elif c.node not in nodes:  # a technique's per-bucket collective (zero=3 gathers)
            rows.append(Row(c.node, c.module or "(model)", "gather", "-", [c]))
    return rows


def plan_table(plan, width: int = 32, only_collectives: bool = False) -> str:
    """Summary, then one line per op (``only_collectives``: only the ops with collectives)."""
    comms = plan.collectives()
    head = ("module", "node", "op", "layout", "collectives", "bytes")
    body = [
        (
            r.module,
            r.node,
            r.op,
            r.layout,
            ", ".join(comm_label(c) for c in r.comms),
            fmt_bytes(r.bytes) if r.comms else "",
        )
        for r in plan_rows(plan, comms)
        if r.comms or not only_collectives
    ]
    table = [head] + body
    widths = [min(max(len(r[i]) for r in table), width if i < 4 else 200) for i in range(5)]
    lines = [summary(plan, comms), ""]
    for r in table:
        cells = [_cut(r[i], widths[i]).ljust(widths[i]) for i in range(5)]
        lines.append("  ".join(cells) + "  " + r[5].rjust(9))
    return Text("\n".join(lines))


def _cut(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def comm_totals(comms) -> dict:
    """axis -> {"count": int, "bytes": float, "forward"/"backward"/"grad sync": bytes}."""
    out: dict = {}
    for c in comms:
        t = out.setdefault(
            c.axis,
            {
                "count": 0,
                "bytes": 0.0,
                "forward": 0.0,
                "backward": 0.0,
                "grad sync": 0.0,
                "optimizer": 0.0,
                "recompute": 0.0,
            },
        )
        t["count"] += 1
        t["bytes"] += c.bytes
        t[c.phase] += c.bytes
    return out


def memory_numbers(plan) -> dict:
    """Bytes per rank at the example: params, grads, optimizer, activations, ...; ``peak`` (the
    step's largest phase, ap.predict's figure) and ``phase`` (its name); plus serial params.
    Kept on the plan (it does not change once made): the formulas take seconds on a deep model,
    and the summary heads print(plan), the HTML view and the flat table alike."""
    kept = plan.__dict__.get("_memory_numbers")
    if kept is not None:
        return dict(kept)
    cost = Cost(plan)
    num = cost.at()["memory"]
    num.update({k: float(cost.sy.value(v)) for k, v in cost.host_memory.items()})
    phases = {k: float(cost.sy.value(v)) for k, v in cost.memory_phases.items()}
    num["phase"] = max(phases, key=phases.get)
    num["peak"] = phases[num["phase"]]
    num["serial params"] = float(sum(p.numel() * p.element_size() for p in plan.model.parameters()))
    plan.__dict__["_memory_numbers"] = dict(num)
    return num


def summary(plan, comms=None) -> str:
    """Mesh, ranks, memory per rank, and bytes per step and rank by axis."""
    comms = plan.collectives() if comms is None else comms
    mem = memory_numbers(plan)
    lines = [
        f"autopar plan for {type(plan.model).__name__} on {plan.mesh} ({plan.mesh.size} ranks)",
        f"  memory per rank at the step's peak: {fmt_bytes(mem['peak'])} ({mem['phase']}, the rank that holds the most)",
        f"  parameters per rank: {fmt_bytes(mem['params'])} (serial {fmt_bytes(mem['serial params'])})",
        f"  activations per rank: {fmt_bytes(mem['activations'])} (outputs kept for backward, upper bound)",
    ]
    if "offloaded" in mem:
        lines.append(f"  activations in host memory per rank: {fmt_bytes(mem['offloaded'])} (offloading checkpoints)")
    if "gathered" in mem:
        lines.append(
            f"  gathered per rank (zero=3): {fmt_bytes(mem['gathered'])} (blocks in use and prefetched, reduce buffers)"
        )
    totals = comm_totals(comms)
    if not totals:
        lines.append("  communication per step and rank: none")
    for axis, t in totals.items():
        parts = ", ".join(f"{k} {fmt_bytes(t[k])}" for k in ("forward", "backward", "grad sync", "optimizer") if t[k])
        lines.append(
            f"  communication on {axis}: {t['count']} collectives, {fmt_bytes(t['bytes'])} per step and rank ({parts})"
        )
    return Text("\n".join(lines))
