"""Counting communication: bytes the simulator moves per axis and kind (ring algorithm), the
plan's formulas at example sizes, collectives a backend is asked for, and what ran (ap.comm_stats)
against what the plan lists (Plan.collectives).

    >>> assert runtime_bytes(plan, args, loss_of) == pytest.approx(planned_bytes(plan))
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

import autopar as ap
from autopar.runtime.simulator import SimBackend, run_ranks

RING = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


class ByteCounter:
    """A minimal stand-in for ap.comm_stats() on SimBackend.stats / DistBackend.stats: records
    every collective's input tensor (kind, group, bytes)."""

    def __init__(self):
        self.rows = []

    def record(self, kind, group, tensor):
        self.rows.append((kind, tuple(group), tensor.numel() * tensor.element_size()))


def runtime_bytes(plan, args, loss_of, rank=0) -> dict:
    """(axis, kind) -> bytes rank ``rank`` sends in one forward+backward (with gradient sync)."""
    backend = SimBackend(plan.mesh.size)
    backend.stats = ByteCounter()
    inputs = [plan.local_inputs(r, *args) for r in plan.mesh.ranks()]
    modules = [plan.build_module(r) for r in plan.mesh.ranks()]

    def step(r):
        a, k = inputs[r]
        loss_of(modules[r](*a, **k)).backward()

    run_ranks(plan.mesh.size, step, backend=backend)
    axis_of = {g: plan.mesh.axis_names[a] for a in range(plan.mesh.ndim) for g in plan.mesh.groups(a)}
    got = defaultdict(float)
    for kind, group, nbytes in backend.stats.rows:
        if rank in group:
            got[(axis_of[group], kind)] += RING[kind](len(group)) * nbytes
    return dict(got)


def planned_bytes(plan, **dims) -> dict:
    """(axis, kind) -> bytes per rank and step from plan.cost()'s formulas (at ``dims``, else the example)."""
    cost = plan.cost()
    out = defaultdict(float)
    for c in cost.comms:
        assert c.formula is not None, f"{c} has no formula"
        out[(c.axis, c.kind)] += cost.sy.value(c.formula, **dims)
    return {k: v for k, v in out.items() if v}


class Recorder:
    """Wraps a collective backend and records, per rank, every collective it is asked for."""

    KINDS = (
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "broadcast",
        "all_reduce_async",
        "reduce_scatter_async",
        "all_gather_async",
    )

    def __init__(self, inner, events=None):
        self.inner, self.calls, self.events = inner, {}, events

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.KINDS:
            return attr

        def call(*args):
            i = next(k for k, a in enumerate(args) if isinstance(a, tuple))
            group, rank = args[i], args[i + 1]
            numel = next(a for a in args if isinstance(a, torch.Tensor)).numel()
            self.calls.setdefault(rank, []).append((name, group, numel))
            if self.events is not None:
                self.events.append(("launch", rank, name))
            return attr(*args)

        return call


def sync_calls(calls):
    """The recorded calls launched asynchronously: the gradient-sync buckets."""
    return [c for c in calls if c[0].endswith("_async")]


def runtime_matches_static(plan, kw=None, args=(), loss=lambda out: out["loss"]):
    """ap.comm_stats over one simulated step (forward, ``loss`` backward) equals Plan.collectives
    on every rank. ``loss`` picks the loss from the output (HF models: ``out["loss"]``)."""

    def step(module, *a, **k):
        loss(module(*a, **k)).backward()

    with ap.comm_stats() as stats:
        plan.simulate(step, *args, **(kw or {}))
    static = Counter((c.kind, c.axis, round(c.bytes, 3)) for c in plan.collectives())
    for rank in plan.mesh.ranks():
        ran = Counter((r.kind, _axis(plan, r.group), round(r.bytes, 3)) for r in stats.for_rank(rank))
        assert ran == static, f"rank {rank}: ran {ran - static} more, {static - ran} fewer than planned"


def _axis(plan, group):
    return next(plan.mesh.axis_names[a] for a in range(plan.mesh.ndim) if group in map(tuple, plan.mesh.groups(a)))
