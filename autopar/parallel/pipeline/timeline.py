"""Schedule tables, measured timelines, idle fractions and the timeline plot.

Two views of one step: the schedule on unit slots (``slots``: what each rank runs at
each slot when every action takes one slot), and what the runners measured
(``Event`` lists, perf_counter seconds). ``measured_idle`` is the wall-clock idle fraction
of each rank (1 - busy / step span); ``replayed_idle`` puts the measured durations back on
the schedule's dependencies (as if messages were free and each rank had its own core),
which is what the bubble formula predicts and what an oversubscribed CPU cannot show.

Example:
    >>> print(schedule_table(plan, rank=0))
    >>> fig = timeline_figure(events_per_rank)      # a matplotlib Figure
"""

from __future__ import annotations

from autopar.parallel.pipeline import schedules


def plan_schedule(plan, forward_only: bool = False):
    lay = plan.stage_layout
    o = lay.options
    return schedules.build(o.kind, lay.pp, o.microbatches, o.chunks, forward_only=forward_only)


def slots(plan, forward_only: bool = False):
    """The schedule on unit slots, per pipeline rank."""
    return schedules.replay(plan_schedule(plan, forward_only), plan.stage_layout.n_stages)


def schedule_table(plan, rank: int | None = None) -> str:
    """Which micro-batch (F = forward, B = backward; /s = stage with chunks > 1) each pipeline
    rank runs at each slot; ``rank`` (a mesh rank) picks that rank's pipeline row."""
    rows = None
    if rank is not None:
        rows = [plan.mesh.coords(rank)[plan.stage_layout.axis]]
    return schedules.table(slots(plan), rows)


def _span(events_per_rank):
    t0 = min(e.start for evs in events_per_rank for e in evs)
    t1 = max(e.end for evs in events_per_rank for e in evs)
    return t0, t1


def measured_idle(events_per_rank) -> list[float]:
    """Wall-clock idle fraction per rank: 1 - its compute time / the whole step's span."""
    t0, t1 = _span(events_per_rank)
    span = (t1 - t0) or 1e-12
    return [1.0 - sum(e.end - e.start for e in evs) / span for evs in events_per_rank]


def replayed_idle(plan, events_per_rank, cpu: bool = True) -> list[float]:
    """Idle fraction per pipeline rank with measured durations replayed on the schedule's
    dependencies (each rank on its own core, messages free).

    Each stage's forward (and backward) takes its mean CPU time (wall-clock with
    ``cpu=False``) over the micro-batches of one step, and with several steps' timelines
    concatenated, the smallest of those step means: a shared machine only ever adds time.
    """
    per_step: dict = {}  # (kind, stage) -> {step: [durations]}
    seen: dict = {}
    for evs in events_per_rank:
        for e in evs:
            key = (e.kind, e.microbatch, e.stage)
            step = seen[key] = seen.get(key, -1) + 1  # the k-th time an action appears: step k
            per_step.setdefault((e.kind, e.stage), {}).setdefault(step, []).append(e.cpu if cpu else e.end - e.start)
    dur = {k: min(sum(v) / len(v) for v in steps.values()) for k, steps in per_step.items()}
    sched = plan_schedule(plan, forward_only=not any(e.kind == "B" for evs in events_per_rank for e in evs))
    played = schedules.replay(sched, plan.stage_layout.n_stages, lambda a: dur[(a.kind, a.stage)])
    return schedules.idle_fraction(played)


def timeline_figure(events_per_rank=None, plan=None, title: str | None = None):
    """A matplotlib Figure (shown inline in Jupyter): one row per rank, a bar per action
    (forward blue, backward orange) labelled with its micro-batch, and with its stage (``F3/1``:
    micro-batch 3 of stage 1) where a rank runs several stages (interleaved schedules). Pass
    measured ``events_per_rank`` (runner.timeline of each rank) or a ``plan`` for its schedule
    on unit slots."""
    from autopar.explore.plots import _figure  # no pyplot: no GUI backend is chosen or needed

    if events_per_rank is None:
        rows = [
            [(s.action.kind, s.action.microbatch, s.action.stage, s.start, s.end) for s in rs] for rs in slots(plan)
        ]
        unit = "slot"
    else:
        t0, _ = _span(events_per_rank)
        rows = [
            [(e.kind, e.microbatch, e.stage, (e.start - t0) * 1e3, (e.end - t0) * 1e3) for e in evs]
            for evs in events_per_rank
        ]
        unit = "ms"
    fig = _figure(10, 0.6 * len(rows) + 1.2)
    ax = fig.add_subplot(1, 1, 1)
    colors = {"F": "#4C72B0", "B": "#DD8452"}
    chunks = any(len({a[2] for a in acts}) > 1 for acts in rows)
    for r, acts in enumerate(rows):
        for kind, mb, stage, start, end in acts:
            ax.barh(r, end - start, left=start, color=colors[kind], edgecolor="white", height=0.8)
            label = f"{kind}{mb}/{stage}" if chunks else f"{kind}{mb}"
            ax.text((start + end) / 2, r, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title or "pipeline timeline (blue: forward, orange: backward)")
    return fig
