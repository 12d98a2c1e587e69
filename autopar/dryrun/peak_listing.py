"""What is alive at a dry run's peak: the storages, each with the op that made it and where.

``PeakListing`` is a MemoryCounter that also notes, for each storage it counts, the op, shape,
dtype and a label of the moment (``moment``: e.g. the pipeline action running), and keeps the
live set each time the total reaches a new peak. ``listing()`` groups what was alive at the peak,
largest first: how the 405B last stage's 1.19x was broken down (docs/dry_run.md). Used through
``listing_peak``, which makes ``plan.dry_run`` count with it.

Example:
    >>> with listing_peak() as found:
    ...     plan.dry_run(rank=56, steps=2)
    >>> for nbytes, count, (kind, op, shape, dtype, moment) in found[0].listing()[:10]:
    ...     print(f"{nbytes / 2**30:7.3f} GiB x{count} {kind} {op} {shape} {dtype} {moment}")
"""

from __future__ import annotations

import contextlib

import torch

from autopar.dryrun import run as _run
from autopar.dryrun.memory import MemoryCounter


class PeakListing(MemoryCounter):
    def __init__(self, device=None):
        super().__init__(device)
        self.made: dict[int, tuple] = {}  # storage key -> (op, shape, dtype, moment) of the live one
        self.at_peak: list[tuple] = []  # (key, bytes, kind, made) alive at the peak
        self.moment = "-"  # set by the caller (a pipeline action's name, a phase)
        self._op = "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = str(func)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def track(self, t: torch.Tensor, kind: str) -> None:
        if self.device is not None and t.device != self.device:
            return
        key = t.untyped_storage()._cdata
        if key not in self.live:  # keys are reused once a storage dies: noted while it is alive
            self.made[key] = (self._op, tuple(t.shape), str(t.dtype), self.moment)
        super().track(t, kind)
        if self.total == self.peak and self.total:
            self.at_peak = [(k, v[1], v[2], self.made.get(k)) for k, v in self.live.items()]

    def reset_peak(self) -> None:
        super().reset_peak()
        self.at_peak = [(k, v[1], v[2], self.made.get(k)) for k, v in self.live.items()]

    def listing(self) -> list[tuple]:
        """(bytes, count, (kind, op, shape, dtype, moment)) of what was alive at the peak, by
        group, largest first."""
        groups: dict = {}
        for _key, nbytes, kind, made in self.at_peak:
            g = groups.setdefault((kind, *(made or ("?", (), "?", "?"))), [0, 0])
            g[0] += nbytes
            g[1] += 1
        return sorted(((b, n, k) for k, (b, n) in groups.items()), key=lambda r: -r[0])


@contextlib.contextmanager
def listing_peak():
    """``plan.dry_run`` inside counts with a PeakListing; the list it yields gets one per rank run."""
    made: list[PeakListing] = []

    def counter(device=None):
        made.append(PeakListing(device))
        return made[-1]

    saved = _run.MemoryCounter
    _run.MemoryCounter = counter
    try:
        yield made
    finally:
        _run.MemoryCounter = saved
