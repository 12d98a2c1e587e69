"""Count the collectives that actually run: ``with ap.comm_stats() as stats: ...``.

Every backend (the simulator's and torch.distributed's) reports each collective it runs
to ``backend.stats.record(kind, group, tensor)``; inside ``comm_stats()`` that is a
CommStats, attached to the backends active on entry and to those started inside (a
``plan.simulate`` call). The simulator reports one record per group and collective (the
group's first rank reports it); a real rank reports its own. ``for_rank(r)`` is what
rank ``r`` took part in, comparable with ``plan.collectives()`` (per rank).

Bytes per record are what one rank sends with ring algorithms, the same formulas as
Plan.collectives: all-reduce 2(n-1)/n of the tensor, all-gather (n-1) times the local
piece, reduce-scatter and all-to-all (n-1)/n of the input, broadcast the tensor.

Example:
    >>> with ap.comm_stats() as stats:
    ...     plan.simulate(lambda m, *a, **k: m(*a, **k)[0].backward(), ids, labels)
    >>> stats.counts(rank=0, mesh=plan.mesh)     # {('all_reduce', 'tp'): 4, ...}
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass

from autopar.runtime import backend
from autopar.runtime.ring import COLLECTIVES, ring_bytes


@dataclass(frozen=True)
class Record:
    kind: str
    group: tuple
    numel: int
    itemsize: int

    @property
    def bytes(self) -> float:
        """Bytes one rank of the group sends (ring algorithms)."""
        n, b = len(self.group), self.numel * self.itemsize
        if self.kind == "broadcast":
            return 0.0 if n == 1 else float(b)
        return float(ring_bytes(self.kind, b, n)) if self.kind in COLLECTIVES else 0.0  # the plan's formulas


class CommStats:
    """The collectives recorded while a ``comm_stats()`` block ran."""

    def __init__(self):
        self.records: list[Record] = []
        self._lock = threading.Lock()

    def record(self, kind: str, group, tensor) -> None:
        with self._lock:
            self.records.append(Record(kind, tuple(group), tensor.numel(), tensor.element_size()))

    def for_rank(self, rank: int) -> list[Record]:
        return [r for r in self.records if rank in r.group]

    def counts(self, rank: int | None = None, mesh=None) -> Counter:
        """Counter of (kind, axis name) (or (kind, group) without a mesh)."""
        recs = self.records if rank is None else self.for_rank(rank)
        return Counter((r.kind, _axis(r.group, mesh)) for r in recs)

    def bytes(self, rank: int | None = None) -> float:
        recs = self.records if rank is None else self.for_rank(rank)
        return sum(r.bytes for r in recs)

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return f"<CommStats {len(self.records)} collectives, {self.bytes():.0f} B>"


def _axis(group: tuple, mesh):
    if mesh is None:
        return group
    for a in range(mesh.ndim):
        if group in [tuple(g) for g in mesh.groups(a)]:
            return mesh.axis_names[a]
    return group


def group_label(group, mesh) -> str:
    """The mesh axes a group of ranks spans, as plan.collectives() names them ("pp", "dp*pp")."""
    coords = [mesh.coords(r) for r in group]
    spans = [a for a in range(mesh.ndim) if len({c[a] for c in coords}) > 1]
    if len(spans) == 1:
        return mesh.axis_names[spans[0]]
    return mesh.axis_label(tuple(mesh.axis_names[a] for a in spans)) if spans else str(tuple(group))


@contextlib.contextmanager
def comm_stats():
    """Record every collective run in this block (simulated or real); yields a CommStats."""
    stats = CommStats()
    attached = [b for b in backend._GLOBAL if getattr(b, "stats", None) is None]
    for b in attached:
        b.stats = stats
    backend.STATS_SINKS.append(stats)
    try:
        yield stats
    finally:
        backend.STATS_SINKS.remove(stats)
        for b in attached:
            b.stats = None
