"""All ranks of a plan in one process: one thread per rank, collectives met in memory.

Each rank runs the user's ``step`` (forward, backward, optimizer) in its own thread, as it
would in its own process; a collective waits until every rank of its group has arrived
and then computes the same result a real backend would (sums in rank order). A rank that
raises stops the others at their next collective instead of leaving them waiting, and a
collective that waits longer than ``timeout`` seconds fails naming the missing ranks.

Example:
    >>> results = run_ranks(world_size=4, fn=lambda rank: modules[rank](*inputs[rank]))
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch
from torch.utils._python_dispatch import _disable_current_modes

from autopar.runtime.backend import use_backend
from autopar.runtime.pieces import _pos, all_to_all_local, chunk_of


class SimulationError(RuntimeError):
    """A simulated rank failed, or a collective timed out waiting for ranks."""


class _Round:
    __slots__ = ("pieces", "taken")

    def __init__(self):
        self.pieces: dict[int, torch.Tensor] = {}
        self.taken = 0


def _transport_copy(x):
    """The simulator's own copy of a rank's contribution, made outside the rank's dispatch modes:
    it is transport (a real backend sends from the rank's buffer), and a memory observer such as
    LiveBytes must not count it. It lives until every group member has taken the round, which
    under load can be after the rank's next ops: counted, it made held bytes depend on timing."""
    if not isinstance(x, torch.Tensor):
        return x
    with _disable_current_modes():
        return x.detach().clone()


class SimBackend:
    """In-memory collectives for ranks running as threads of one process."""

    def __init__(self, world_size: int, timeout: float = 60.0):
        self.world_size = world_size
        self.timeout = timeout
        self.cv = threading.Condition()
        self.rounds: dict[tuple, _Round] = {}
        self.calls: dict[tuple, int] = defaultdict(int)  # (group, rank) -> calls so far
        self.failed: dict[int, BaseException] = {}
        self.stats = None
        self.supports_in_place = False  # ranks exchange their tensors: no reduction in place

    def fail(self, rank: int, error: BaseException) -> None:
        with self.cv:
            self.failed[rank] = error
            self.cv.notify_all()

    def _exchange(self, kind: str, group: tuple, rank: int, x, record: bool = True) -> list:
        """Hand in this rank's tensor; get every group member's, in group order."""
        key = (group, rank)
        with self.cv:
            seq = self.calls[key]
            self.calls[key] += 1
            rnd = self.rounds.setdefault((group, seq), _Round())
            # the caller may reuse its buffer (a list: all_to_all_v's row counts, kept as they are)
            rnd.pieces[rank] = _transport_copy(x)
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: len(rnd.pieces) == len(group) or self.failed, self.timeout):
                missing = sorted(set(group) - set(rnd.pieces))
                raise SimulationError(
                    f"rank {rank}: {kind} on group {list(group)} waited "
                    f"{self.timeout:.0f} s for ranks {missing}, which never arrived."
                )
            if len(rnd.pieces) < len(group):
                r, err = next(iter(self.failed.items()))
                raise SimulationError(
                    f"rank {rank}: stopped at {kind} because rank {r} failed: {type(err).__name__}: {err}"
                )
            rnd.taken += 1
            if rnd.taken == len(group):
                del self.rounds[(group, seq)]
            if record and self.stats is not None and _pos(group, rank) == 0:
                self.stats.record(kind, group, x)
            return [rnd.pieces[r] for r in group]

    def _sum(self, pieces):
        total = pieces[0].clone()
        for p in pieces[1:]:
            total += p
        return total

    def all_reduce(self, x, group, rank, op):
        if op == "max":  # float8's amax: the largest magnitude over the group (parallel/float8/)
            return torch.stack(self._exchange("all_reduce", group, rank, x)).amax(0)
        total = self._sum(self._exchange("all_reduce", group, rank, x))
        return total / len(group) if op == "avg" else total

    def all_gather(self, x, dim, group, rank):
        return torch.cat(self._exchange("all_gather", group, rank, x), dim=dim)

    def reduce_scatter(self, x, dim, group, rank, op):
        total = self._sum(self._exchange("reduce_scatter", group, rank, x))
        if op == "avg":
            total = total / len(group)
        return chunk_of(total, dim, len(group), _pos(group, rank)).clone()

    def all_to_all(self, x, src_dim, dst_dim, group, rank):
        pieces = self._exchange("all_to_all", group, rank, x)
        return all_to_all_local(pieces, src_dim, dst_dim, _pos(group, rank)).contiguous()

    def all_to_all_v(self, x, send, recv, group, rank):
        """Rows in variable numbers: every rank hands in its rows and its send counts."""
        counts = self._exchange("all_to_all_v counts", group, rank, list(send), record=False)
        pieces = self._exchange("all_to_all", group, rank, x)
        pos = _pos(group, rank)
        mine = []
        for piece, sent in zip(pieces, counts):
            start = sum(sent[:pos])
            mine.append(piece.narrow(0, start, sent[pos]))
        got = [m.shape[0] for m in mine]
        if got != list(recv):
            raise SimulationError(f"rank {rank}: all_to_all_v expected rows {list(recv)} from {list(group)}, got {got}")
        return torch.cat(mine, dim=0) if mine else x.new_empty((0, *x.shape[1:]))

    def ring_shift(self, x, group, rank, offset):
        """Send ``x`` to the rank ``offset`` places later in the group; get the one ``offset`` earlier's."""
        pieces = self._exchange("ring_shift", group, rank, x)
        return pieces[(_pos(group, rank) - offset) % len(group)]

    def all_reduce_async(self, flat, group, rank):
        return _SimWork(self, flat, group, rank)

    def broadcast(self, x, group, rank):
        pieces = self._exchange("broadcast", group, rank, x)
        x.copy_(pieces[0])

    def reduce_scatter_async(self, flat, group, rank):
        """wait() gives this rank's chunk of the sum (exchanged at wait, like all_reduce_async)."""
        return _SimWork(self, flat, group, rank, "reduce_scatter")

    def all_gather_async(self, out, chunk, group, rank):
        return _SimWork(self, chunk, group, rank, "all_gather", out)


class _SimWork:
    """An asynchronous all-reduce: handed in now, completed at wait()."""

    def __init__(self, backend, flat, group, rank, kind="all_reduce", out=None):
        self.backend, self.flat, self.group, self.rank = backend, flat, group, rank
        self.kind, self.out = kind, out
        self.done = False

    def wait(self):
        if not self.done:
            b, g, r = self.backend, self.group, self.rank
            if self.kind == "all_reduce":
                self.out = self.flat.copy_(b.all_reduce(self.flat, g, r, "sum"))
            elif self.kind == "reduce_scatter":
                self.out = b.reduce_scatter(self.flat, 0, g, r, "sum")
            else:
                self.out.copy_(b.all_gather(self.flat, 0, g, r))
            self.done = True
        return self.out


def run_ranks(world_size: int, fn, timeout: float = 60.0, backend: SimBackend | None = None) -> list:
    """Run ``fn(rank)`` for every rank in its own thread with a SimBackend; return the results.

    The first rank's exception is re-raised (as SimulationError naming the rank) after all
    threads have stopped.
    """
    backend = backend or SimBackend(world_size, timeout)
    results: list = [None] * world_size
    errors: dict[int, BaseException] = {}

    def worker(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - reported below with the rank
            errors[rank] = e
            backend.fail(rank, e)

    threads = [
        threading.Thread(target=worker, args=(r,), name=f"autopar-rank{r}", daemon=True) for r in range(world_size)
    ]
    with use_backend(backend):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        first = (
            min(r for r, e in errors.items() if not isinstance(e, SimulationError))
            if any(not isinstance(e, SimulationError) for e in errors.values())
            else min(errors)
        )
        err = errors[first]
        if isinstance(err, SimulationError):
            raise err
        raise SimulationError(f"rank {first} failed: {type(err).__name__}: {err}") from err
    return results
