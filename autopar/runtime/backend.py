"""The collective backend: what executes the collective ops, and which one is active.

A backend implements the ``Backend`` protocol below. Two do: ``DistBackend``
(runtime/dist_backend.py: torch.distributed, gloo or NCCL) and ``SimBackend``
(runtime/simulator.py: every rank in one process). The ops in runtime/collectives.py call
``current_backend()``; ``use_backend`` scopes one (the simulator), ``install_backend`` makes one
the process-wide default (ap.parallelize).

Example:
    >>> with use_backend(SimBackend(world_size=4)):
    ...     y = torch.ops.autopar.all_reduce(x, "tp", [0, 1], 0, "sum")
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol

import torch


class Backend(Protocol):
    """Collectives over the ranks of ``group`` (a tuple of global ranks) for the calling ``rank``.

    ``supports_in_place``: the backend has ``all_reduce_``, which reduces into its input (the
    emitted program uses it in plain eager mode, for a tensor nobody else reads). ``stats``: an ap.comm_stats() sink or None.
    The ``*_async`` forms return a work object with ``wait()`` (the gradient buckets overlap them
    with the backward pass)."""

    supports_in_place: bool
    stats: object

    def all_reduce(self, x: torch.Tensor, group: tuple, rank: int, op: str) -> torch.Tensor: ...
    def all_reduce_(
        self, x: torch.Tensor, group: tuple, rank: int, op: str
    ) -> torch.Tensor: ...  # if supports_in_place
    def all_gather(self, x: torch.Tensor, dim: int, group: tuple, rank: int) -> torch.Tensor: ...
    def reduce_scatter(self, x: torch.Tensor, dim: int, group: tuple, rank: int, op: str) -> torch.Tensor: ...
    def all_to_all(self, x: torch.Tensor, src_dim: int, dst_dim: int, group: tuple, rank: int) -> torch.Tensor: ...
    def all_to_all_v(self, x: torch.Tensor, send: list, recv: list, group: tuple, rank: int) -> torch.Tensor: ...
    def broadcast(self, x: torch.Tensor, group: tuple, rank: int) -> None: ...
    def ring_shift(self, x: torch.Tensor, group: tuple, rank: int, offset: int) -> torch.Tensor: ...
    def all_reduce_async(self, flat: torch.Tensor, group: tuple, rank: int): ...
    def reduce_scatter_async(self, flat: torch.Tensor, group: tuple, rank: int): ...
    def all_gather_async(self, out: torch.Tensor, chunk: torch.Tensor, group: tuple, rank: int): ...


_state = threading.local()
_GLOBAL: list = []  # the process-wide backend stack (the simulator's threads share it)
STATS_SINKS: list = []  # open ap.comm_stats() blocks: backends started inside report to the last


def current_backend():
    if not _GLOBAL:
        raise RuntimeError(
            "No autopar collective backend is active: run a rank's module through "
            "plan.simulate(...), or build it with ap.parallelize(...) in a torch.distributed job."
        )
    return _GLOBAL[-1]


@contextlib.contextmanager
def use_backend(backend):
    _GLOBAL.append(backend)
    attach = STATS_SINKS and getattr(backend, "stats", None) is None
    if attach:
        backend.stats = STATS_SINKS[-1]
    try:
        yield backend
    finally:
        _GLOBAL.remove(backend)
        if attach:
            backend.stats = None


def install_backend(backend) -> None:
    """Make ``backend`` the process-wide default (used by ap.parallelize for real runs).

    It replaces an earlier default of the same kind (a second ap.parallelize in one process)."""
    _GLOBAL[:] = [b for b in _GLOBAL if type(b) is not type(backend)]
    _GLOBAL.insert(0, backend)
