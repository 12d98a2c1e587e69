"""Schedule tables, measured timelines, idle fractions and the timeline plot.

Two views of one step: the schedule on unit slots (``slots``: what each rank runs at
each slot when every action takes one slot), and what the runners measured
(``Event`` lists, perf_counter seconds). ``measured_idle`` is the wall-clock idle fraction
of each rank (1 - busy / step span); ``replayed_idle`` puts the measured durations back on
the schedule's dependencies (as if messages were free and each rank had its own core),
which is what the bubble formula predicts and what an oversubscribed CPU cannot show.

Example:
    >>> print(slot_table(plan, rank=0))               # plan.schedule_table(0)
    >>> rows, unit = timeline_rows(events_per_rank)   # Pipeline.timeline: plan.timeline_figure() draws them
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


def slot_table(plan, rank: int | None = None) -> str:
    """Which micro-batch (F = forward, B = backward; /s = stage with chunks > 1) each pipeline
    rank runs at each slot; ``rank`` (a mesh rank) picks that rank's pipeline row."""
    rows = None
    if rank is not None:
        rows = [plan.mesh.coords(rank)[plan.stage_layout.axis]]
    return schedules.table(slots(plan), rows, overlapped(plan))


def overlapped(plan) -> list[set]:
    """Per pipeline rank, the (forward, backward) Action pairs its schedule overlaps (DualPipeV)."""
    lay = plan.stage_layout
    return schedules.overlapped(lay.options.kind, lay.pp, lay.options.microbatches)


def marked_actions(plan) -> list[set]:
    """Per pipeline rank, (kind, micro-batch, stage) of each action run overlapped with another:
    what ``timeline_figure`` hatches."""
    return [{tuple(a) for pair in pairs for a in pair} for pairs in overlapped(plan)]


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
    ``cpu=False``, or where the runner did not measure it) over the micro-batches of one step, and with several steps' timelines
    concatenated, the smallest of those step means: a shared machine only ever adds time.
    """
    per_step: dict = {}  # (kind, stage) -> {step: [durations]}
    seen: dict = {}
    for evs in events_per_rank:
        for e in evs:
            key = (e.kind, e.microbatch, e.stage)
            step = seen[key] = seen.get(key, -1) + 1  # the k-th time an action appears: step k
            took = e.cpu if cpu and e.cpu is not None else e.end - e.start  # cpu None: not measured
            per_step.setdefault((e.kind, e.stage), {}).setdefault(step, []).append(took)
    dur = {k: min(sum(v) / len(v) for v in steps.values()) for k, steps in per_step.items()}
    sched = plan_schedule(plan, forward_only=not any(e.kind == "B" for evs in events_per_rank for e in evs))
    played = schedules.replay(sched, plan.stage_layout.n_stages, lambda a: dur[(a.kind, a.stage)])
    return schedules.idle_fraction(played)


def timeline_rows(events_per_rank=None, plan=None) -> tuple[list, str]:
    """(rows, unit) for a timeline picture (explore/plots.py plot_timeline): per rank, its actions
    as (kind, micro-batch, stage, start, end), from measured ``events_per_rank`` (runner.timeline
    of each rank, in ms) or from a ``plan``'s schedule on unit slots."""
    if events_per_rank is None:
        rows = [
            [(s.action.kind, s.action.microbatch, s.action.stage, s.start, s.end) for s in rs] for rs in slots(plan)
        ]
        return rows, "slot"
    t0, _ = _span(events_per_rank)
    rows = [
        [(e.kind, e.microbatch, e.stage, (e.start - t0) * 1e3, (e.end - t0) * 1e3) for e in evs]
        for evs in events_per_rank
    ]
    return rows, "ms"
