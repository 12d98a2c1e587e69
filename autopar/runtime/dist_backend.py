"""DistBackend: the collectives over torch.distributed process groups (gloo on CPU, NCCL on GPU).

Example:
    >>> backend = DistBackend(groups, rank, timeout=30.0)   # ap.parallelize makes the groups
    >>> install_backend(backend)
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist
import torch

from autopar.runtime.pieces import _pos, all_to_all_local, chunk_of
from autopar.runtime.failures import explain


class DistBackend:
    """Collectives over torch.distributed process groups (gloo on CPU, NCCL on GPU).

    ``groups`` maps each group's tuple of global ranks to its ProcessGroup; ap.parallelize makes
    them all, on every rank in the same order, before the first step.
    """

    def __init__(self, groups: dict, rank: int, timeout: float | None = None, groups_timeout: float | None = None):
        self.groups = groups
        self.rank = rank
        self.stats = None
        self.supports_in_place = True  # all_reduce_ reduces into its input
        self.timeout = timeout  # seconds a collective may wait before failing (None: the group's)
        self.groups_timeout = groups_timeout  # the timeout the process groups were made with

    def _run(self, kind, ranks, collective, /, *args, **kwargs):
        """Run ``collective(*args, **kwargs)`` (a torch.distributed call) blocking; a failure or a
        timeout raises CollectiveError naming the rank that failed (see failures.py), never hangs
        past timeout.

        Why blocking: on gloo, async_op=True plus work.wait() costs about 0.3 ms more per
        collective than the blocking call, and a wait with a timeout another 0.4 ms, which is
        most of a small model's step. Where the groups were made with this timeout (ap.parallelize
        does), the blocking call is bounded by it; otherwise (timeout changed since) the
        collective waits with the timeout explicitly.
        """
        if self.timeout is not None and self.timeout != self.groups_timeout:
            return self._wait(kind, ranks, lambda: collective(*args, async_op=True, **kwargs))
        start = time.monotonic()
        try:
            collective(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised with the failed rank named
            raise explain(kind, ranks, self.rank, self.timeout, e, time.monotonic() - start) from e

    def _wait(self, kind, group, start):
        """Run ``start()`` (an async collective) and wait for it; a failure or a timeout raises
        CollectiveError naming the rank that failed (see failures.py), never hangs past timeout."""
        t0 = time.monotonic()
        try:
            work = start()
            done = work.wait(datetime.timedelta(seconds=self.timeout)) if self.timeout else work.wait()
        except Exception as e:  # noqa: BLE001 - re-raised with the failed rank named
            raise explain(kind, group, self.rank, self.timeout, e, time.monotonic() - t0) from e
        if done is False:
            raise explain(kind, group, self.rank, self.timeout, TimeoutError("timed out"), time.monotonic() - t0)

    def _pg(self, group, rank):
        if rank != self.rank:
            raise RuntimeError(
                f"autopar: a module built for rank {rank} is running on rank {self.rank}; "
                "build it with plan.module(dist.get_rank()) or ap.parallelize."
            )
        return self.groups[group]

    def _note(self, kind, group, t):
        if self.stats is not None:
            self.stats.record(kind, group, t)

    def all_reduce(self, x, group, rank, op, kind="all_reduce"):
        y = x.clone() if x.is_contiguous() else x.contiguous()  # a copy of its own, made once
        if self.stats is not None:
            self.stats.record(kind, group, y)
        if op == "max":  # float8's amax (parallel/float8/): the largest over the group
            self._run(kind, group, dist.all_reduce, y, group=self._pg(group, rank), op=dist.ReduceOp.MAX)
            return y
        self._run(kind, group, dist.all_reduce, y, group=self._pg(group, rank))
        return y / len(group) if op == "avg" else y

    def all_reduce_(self, x, group, rank, op):
        """In place, for inputs nothing else reads (see the ``owned`` hint of autopar::all_reduce)."""
        if not x.is_contiguous() or op == "max":
            return self.all_reduce(x, group, rank, op)
        if self.stats is not None:
            self.stats.record("all_reduce", group, x)
        self._run("all_reduce", group, dist.all_reduce, x, group=self._pg(group, rank))
        return x.div_(len(group)) if op == "avg" else x

    def all_gather(self, x, dim, group, rank, kind="all_gather"):
        x = x.contiguous()
        self._note(kind, group, x)
        out = [torch.empty_like(x) for _ in group]
        self._run(kind, group, dist.all_gather, out, x, group=self._pg(group, rank))
        return torch.cat(out, dim=dim)

    def reduce_scatter(self, x, dim, group, rank, op):
        # gloo has no reduce_scatter: all-reduce, then keep this rank's chunk (noted as what it stands for).
        full = self.all_reduce(x, group, rank, op, kind="reduce_scatter")
        return chunk_of(full, dim, len(group), _pos(group, rank)).contiguous()

    def all_to_all(self, x, src_dim, dst_dim, group, rank):
        pieces = self.all_gather(x, 0, group, rank, kind="all_to_all").chunk(len(group), dim=0) if x.dim() else None
        return all_to_all_local(list(pieces), src_dim, dst_dim, _pos(group, rank)).contiguous()

    def all_to_all_v(self, x, send, recv, group, rank):
        """Rows in variable numbers (``dist.all_to_all_single`` with split sizes; gloo has it)."""
        x = x.contiguous()
        self._note("all_to_all", group, x)
        out = x.new_empty((sum(recv), *x.shape[1:]))
        self._run(
            "all_to_all", group, dist.all_to_all_single, out, x, list(recv), list(send), group=self._pg(group, rank)
        )
        return out

    def ring_shift(self, x, group, rank, offset):
        """Send ``x`` to the rank ``offset`` places later in the group and receive from the one
        ``offset`` places earlier (one batched isend/irecv pair: a ring attention step)."""
        x = x.contiguous()
        self._note("ring_shift", group, x)
        pg, n, pos = self._pg(group, rank), len(group), _pos(group, rank)
        out = torch.empty_like(x)
        if n == 1 or offset % n == 0:
            return x.clone()
        to, frm = group[(pos + offset) % n], group[(pos - offset) % n]
        ops = [dist.P2POp(dist.isend, x, to, group=pg), dist.P2POp(dist.irecv, out, frm, group=pg)]

        def call(async_op=False):  # _run calls it without the flag (blocking), _wait with it
            works = dist.batch_isend_irecv(ops)
            if async_op:
                return _AllWorks(works)
            for w in works:
                w.wait()

        self._run("ring_shift", group, call)
        return out

    def all_reduce_async(self, flat, group, rank):
        self._note("all_reduce", group, flat)
        pg = self._pg(group, rank)
        try:
            work = dist.all_reduce(flat, group=pg, async_op=True)
        except Exception as e:  # noqa: BLE001 - named like the others
            raise explain("all_reduce", group, rank, self.timeout, e) from e
        return _Work(work, flat, lambda: self._wait("all_reduce", group, lambda: work))

    def broadcast(self, x, group, rank):
        self._note("broadcast", group, x)
        self._run("broadcast", group, dist.broadcast, x, src=group[0], group=self._pg(group, rank))

    # -- used by the data-parallel gradient sync and ZeRO ------------------------------------
    def reduce_scatter_async(self, flat, group, rank):
        """Sum ``flat`` (numel divisible by the group size) over the group; wait() gives this
        rank's contiguous chunk. Falls back to all-reduce + slice where the process group has
        no reduce-scatter (older gloo)."""
        n, pos = len(group), _pos(group, rank)
        out = flat.new_empty(flat.numel() // n)
        self._note("reduce_scatter", group, flat)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        try:
            return _Work(rs(out, flat, group=self._pg(group, rank), async_op=True), out)
        except (RuntimeError, NotImplementedError):  # no reduce-scatter in this process group
            work = dist.all_reduce(flat, group=self._pg(group, rank), async_op=True)
            return _Work(work, flat.view(n, -1)[pos])

    def all_gather_async(self, out, chunk, group, rank):
        """Concatenate every rank's ``chunk`` into ``out`` (numel = group size * chunk numel)."""
        self._note("all_gather", group, chunk)
        # torch 2.13 names it all_gather_single (all_gather_into_tensor warns, deprecated); older torch has only the old name
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(out, chunk, group=self._pg(group, rank), async_op=True)
        return _Work(work, out)


class _Work:
    def __init__(self, work, result, wait=None):
        self.work, self.result, self._wait = work, result, wait

    def wait(self):
        if self._wait is not None:
            self._wait()
        else:
            self.work.wait()
        return self.result


class _AllWorks:
    """The works of one batched send/receive as one work (DistBackend._wait waits on it)."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        return all([w.wait(timeout) if timeout is not None else w.wait() for w in self.works])
