"""Plots of a plan (matplotlib Figures, no pyplot state): memory per rank, communication per
layer and axis. The pipeline timeline is ``plan.timeline_figure()`` (plot_timeline, rows from a
technique's ``timeline`` display hook: the pipeline's, parallel/pipeline/timeline.py).

Example:
    >>> fig = plan.plot_memory()          # stacked bars: params, grads, optimizer, activations
    >>> fig = plan.plot_comm(B=64)        # bytes per step per layer and axis, at batch 64
"""

from __future__ import annotations

import io

KINDS = ("params", "grads", "optimizer", "activations", "gathered")  # gathered: zero=3 only
COLORS = {
    "params": "#4c72b0",
    "grads": "#55a868",
    "optimizer": "#c44e52",
    "activations": "#8172b2",
    "gathered": "#dd8452",
}


def _figure(w=7.0, h=3.5):
    from matplotlib.figure import Figure

    class PlanFigure(Figure):
        """A Figure that shows itself in Jupyter without pyplot (no global figure state)."""

        def _repr_png_(self) -> bytes:
            buf = io.BytesIO()
            self.savefig(buf, format="png", dpi=90)
            return buf.getvalue()

    return PlanFigure(figsize=(w, h), layout="constrained")


def _unit(values) -> tuple[float, str]:
    top = max(values, default=0.0)
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return scale, unit
    return 1.0, "B"


def memory_per_rank(plan, **dims) -> dict[int, dict[str, float]]:
    """rank -> {params, grads, optimizer, activations[, gathered]} bytes (at the example, ``dims``
    override; ``gathered``: zero=3's gathered blocks and reduce buffers)."""
    mem = plan.cost().at(**dims)["memory"]
    return {r: {k: mem[k] for k in KINDS if k in mem} for r in plan.mesh.ranks()}


def plot_memory(plan, **dims):
    """Stacked bars of memory per rank, beside the serial model's parameters+grads+optimizer."""
    per_rank = memory_per_rank(plan, **dims)
    serial = sum(p.numel() * p.element_size() for p in plan.model.parameters())
    scale, unit = _unit([sum(v.values()) for v in per_rank.values()] + [4 * serial])
    fig = _figure()
    ax = fig.add_subplot()
    labels = [f"rank {r}" for r in per_rank]
    bottom = [0.0] * len(labels)
    for k in [k for k in KINDS if k in per_rank[0]]:
        vals = [per_rank[r][k] / scale for r in per_rank]
        ax.bar(labels, vals, bottom=bottom, label=k, color=COLORS[k])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(4 * serial / scale, color="k", ls="--", lw=1, label="serial params+grads+Adam")
    ax.set_ylabel(unit)
    ax.set_title(f"memory per rank: {type(plan.model).__name__} on {plan.mesh}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_comm(plan, **dims):
    """Grouped bars: bytes per step and rank, per layer (and the gradient sync), per mesh axis."""
    cost = plan.cost()
    by = {k: cost.sy.value(v, **dims) for k, v in cost.comm_by_layer.items()}
    layers = list(dict.fromkeys(k[0] for k in by))
    axes = list(dict.fromkeys(k[1] for k in by))
    scale, unit = _unit(list(by.values()))
    fig = _figure(max(6.0, 0.6 * len(layers) + 2))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(axes))
    for j, axis in enumerate(axes):
        xs = [i + (j - (len(axes) - 1) / 2) * width for i in range(len(layers))]
        ax.bar(xs, [by.get((layer, axis), 0.0) / scale for layer in layers], width, label=axis)
    ax.set_xticks(range(len(layers)), layers, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"{unit} per step and rank")
    ax.set_title("communication per layer and mesh axis")
    ax.legend(title="axis")
    return fig


def plot_timeline(rows, unit: str, title: str | None = None, marked=None):
    """A matplotlib Figure (shown inline in Jupyter): one row per rank, a bar per action
    (forward blue, backward orange, a zero-bubble schedule's weight-gradient part W green) labelled with its micro-batch, and with its stage (``F3/1``:
    micro-batch 3 of stage 1) where a rank runs several stages (interleaved schedules); ``rows``
    from a technique's ``timeline`` hook (parallel/pipeline/timeline.py's ``timeline_rows``); ``marked`` (per rank, a set of
    (kind, micro-batch, stage)): actions the schedule overlaps (DualPipeV), hatched."""
    fig = _figure(10, 0.6 * len(rows) + 1.2)
    ax = fig.add_subplot(1, 1, 1)
    colors = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
    chunks = any(len({a[2] for a in acts}) > 1 for acts in rows)
    for r, acts in enumerate(rows):
        for kind, mb, stage, start, end in acts:
            hatch = "//" if marked and (kind, mb, stage) in marked[r] else None
            ax.barh(r, end - start, left=start, color=colors[kind], edgecolor="white", height=0.8, hatch=hatch)
            label = f"{kind}{mb}/{stage}" if chunks else f"{kind}{mb}"
            ax.text((start + end) / 2, r, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    split = any(a[0] == "W" for acts in rows for a in acts)
    legend = (
        "blue: forward, orange: input gradients, green: weight gradients"
        if split
        else "blue: forward, orange: backward"
    )
    if marked and any(marked):
        legend += "; hatched: a forward and a backward overlapped"
    ax.set_title(title or f"pipeline timeline ({legend})")
    return fig
