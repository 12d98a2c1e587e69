"""Text views of a plan: the per-node table and a summary.

Example:
    >>> print(plan)            # one row per op: module, op, output layout, collectives inserted
    >>> print(plan.summary())
"""
from __future__ import annotations

from collections import defaultdict

from .placement import fmt_spec
from .propagate import layout_of, module_path


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _op_name(node) -> str:
    t = node.target
    name = getattr(t, "__name__", str(t))
    return name.replace(".default", "")


def plan_table(plan) -> str:
    comms = defaultdict(list)
    for c in plan.collectives():
        comms[c.node].append(c)
    rows = [("node", "module", "op", "layout", "collectives")]
    for node in plan.graph.nodes:
        if node.op not in ("call_function", "output") or "autopar" not in node.meta and node.op != "output":
            continue
        if node.op == "call_function" and not layout_of(node).outputs:
            continue
        spec = "-" if node.op == "output" else " ".join(fmt_spec(s) for s in layout_of(node).outputs)
        cs = ", ".join(f"{c.kind}({c.axis}{', bwd' if c.phase == 'backward' else ''})" for c in comms[node.name])
        if node.op == "output" and not cs:
            continue
        rows.append((node.name, module_path(node), _op_name(node), spec, cs))
    widths = [min(max(len(r[i]) for r in rows), 40) for i in range(4)]
    lines = [summary(plan), ""]
    for r in rows:
        lines.append("  ".join(r[i][:40].ljust(widths[i]) for i in range(4)) + "  " + r[4])
    return "\n".join(lines)


def summary(plan) -> str:
    mesh = plan.mesh
    by_axis = defaultdict(float)
    counts = defaultdict(int)
    for c in plan.collectives():
        by_axis[c.axis] += c.bytes
        counts[c.axis] += 1
    params = dict(plan.model.named_parameters())
    serial = sum(p.numel() * p.element_size() for p in params.values())
    local = 0
    for n, p in params.items():
        spec = plan.param_specs.get(n)
        f = 1
        for a, pl in enumerate(spec or ()):
            if pl.is_shard():
                f *= mesh.shape[a]
        local += p.numel() * p.element_size() / f
    comm = ", ".join(f"{a}: {counts[a]} collectives, {_fmt_bytes(b)}" for a, b in by_axis.items()) or "none"
    return (f"autopar plan for {type(plan.model).__name__} on {mesh} ({mesh.size} ranks)\n"
            f"  parameters per rank: {_fmt_bytes(local)} (serial {_fmt_bytes(serial)})\n"
            f"  communication per step and rank: {comm}")
