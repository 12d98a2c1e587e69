"""The run-time half of ap.FaultTolerant: one replica group's job, and its gradients through torchft.

``join_replica_group`` runs inside ap.parallelize on every rank of one group's torch.distributed
job (world size: the mesh's size over the number of groups; ``REPLICA_GROUP_ID``: which group).
It makes the process groups of every collective that stays inside the group, on the group's own
ranks, starts torchft's ``Manager`` (one per rank; the group's rank 0 serves it to the lighthouse)
and installs ``ReplicaBackend``: the plan's collectives, in global ranks, run on the group's
process groups, and the one kind that crosses groups, a gradient bucket's all-reduce over a
rank's replica line, goes through ``Manager.allreduce``; so does the broadcast of the buffers a
forward writes (from the first group taking part in the step, job.py). Anything else that would
cross groups (a forward collective) raises FaultToleranceError naming it.

The emitted program folds 1/|dp| of the data-parallel mean into the loss; torchft averages over
the n groups that take part, so the bucket is multiplied by the number of groups the plan has:
the sum over groups becomes (groups/n) x the sum = the mean of the n groups' mean gradients
(a lost group: the survivors' mean; a healing group adds zeros and is not counted).

Example (each group's job; the lighthouse started once, lighthouse.py):
    >>> module = ap.parallelize(model, mesh, args=(x,), fault_tolerant=ap.FaultTolerant("dp"))
    >>> ft = module.autopar_fault_tolerant
    >>> opt = ft.wrap(torch.optim.AdamW(module.parameters(), lr=1e-3))
    >>> for _ in range(steps):
    ...     opt.zero_grad()                 # the quorum of this step starts
    ...     loss = loss_fn(module(batch(ft.step))); loss.backward()
    ...     opt.step()                      # True where the step committed
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from autopar.errors import FaultToleranceError
from autopar.parallel.fault_tolerant.job import LIGHTHOUSE_ENV, ReplicaJob
from autopar.parallel.process_groups import plan_groups
from autopar.runtime.backend import current_backend, install_backend
from autopar.runtime.dist_backend import DistBackend
from autopar.runtime.failures import install_excepthook

REPLICA_ENV = "REPLICA_GROUP_ID"  # torchft's examples name each group's job so


def _torchft():
    try:
        import torchft
    except ImportError as e:  # optional, as torchao
        raise FaultToleranceError(
            "ap.FaultTolerant needs torchft: pip install torchft==0.2.0 (it brings its lighthouse; "
            "its opentelemetry packages are installed beside it)."
        ) from e
    return torchft


def join_replica_group(ft, plan, timeout: float | None) -> tuple[int, tuple]:
    """(this process' rank in the plan, mesh axes parallelize must not broadcast over)."""
    torchft = _torchft()
    mesh, n = plan.mesh, ft.replicas(plan.mesh)
    replica = _replica_id(n)
    size = mesh.size // n
    if dist.get_world_size() != size:
        raise FaultToleranceError(
            f"FaultTolerant({ft.replica_axis!r}): each replica group is its own job of {size} processes "
            f"({mesh} has {n} groups), but this job has {dist.get_world_size()}: launch "
            f"torchrun --nproc-per-node {size} once per group, with {REPLICA_ENV}=0..{n - 1}."
        )
    mine = [r for r in mesh.ranks() if ft.replica_of(mesh, r) == replica]
    local, rank = {g: i for i, g in enumerate(mine)}, mine[dist.get_rank()]
    kw = {"timeout": datetime.timedelta(seconds=timeout)} if timeout is not None else {}
    groups = {}
    for g in plan_groups(plan):  # every rank of the group makes the same ones, in the same order
        if all(r in local for r in g):
            mapped = tuple(local[r] for r in g)
            groups[mapped] = dist.new_group(list(mapped), **kw) if len(g) < size or kw else dist.group.WORLD
    inner = DistBackend(groups, local[rank], timeout, groups_timeout=timeout)
    manager = _manager(torchft, ft, replica, local[rank], size)
    job = ReplicaJob(ft, manager, replica, n)
    install_backend(ReplicaBackend(inner, local, ft.line(mesh, rank), job))
    install_excepthook(rank)
    return rank, (ft.replica_part(mesh)[0],)


def _replica_id(n: int) -> int:
    value = os.environ.get(REPLICA_ENV)
    if value is None or not value.isdigit() or int(value) >= n:
        raise FaultToleranceError(
            f"ap.FaultTolerant: set {REPLICA_ENV} to this replica group's number (0..{n - 1}) in every process "
            f"of its job (got {value!r}); each group is launched as its own torchrun job."
        )
    return int(value)


def _manager(torchft, ft, replica: int, group_rank: int, group_size: int):
    """torchft's Manager for this rank; the group's rank 0 serves the group to the lighthouse."""
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    lighthouse = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not lighthouse:
        raise FaultToleranceError(
            "ap.FaultTolerant: no lighthouse address. Start one (python -m autopar.parallel.fault_tolerant.lighthouse "
            f"--min-replicas 1) and pass FaultTolerant(lighthouse='http://host:port') or set {LIGHTHOUSE_ENV}."
        )
    seconds = datetime.timedelta(seconds=ft.timeout)
    try:
        return Manager(
            pg=ProcessGroupGloo(timeout=seconds),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=ft.min_replicas,
            init_sync=False,  # the first group's weights at step 0: ReplicaJob.sync_start
            rank=group_rank,
            world_size=group_size,
            replica_id=f"autopar_replica_{replica}",  # torchft reads the trailing number
            lighthouse_addr=lighthouse,
            timeout=seconds,
            quorum_timeout=datetime.timedelta(seconds=ft.quorum_timeout),
            connect_timeout=seconds,
        )
    except Exception as e:  # noqa: BLE001 - re-raised saying what to check
        raise FaultToleranceError(
            f"ap.FaultTolerant: torchft's Manager for replica group {replica} did not start ({e}). Check that the "
            f"lighthouse at {lighthouse} runs and that MASTER_ADDR/MASTER_PORT name this group's store."
        ) from e


def _replica_backend():
    """The ReplicaBackend where this process is a replica group's job, else None."""
    try:
        backend = current_backend()
    except RuntimeError:
        return None
    return backend if isinstance(backend, ReplicaBackend) else None


def attach(plan, module) -> None:
    """``module.autopar_fault_tolerant``: the job's ReplicaJob, where a replica group's backend is on."""
    backend = _replica_backend()
    if backend is not None:
        backend.job.attach(plan, module)
        module.autopar_fault_tolerant = backend.job


def group_device_mesh(ft, plan):
    """The DeviceMesh of this replica group's job, for checkpoints (None outside one): the plan's
    mesh with the replica axis reduced to this group's part, on the group's ranks in the plan's
    order, so a piece's DTensor (or Pieces) describes the same box of the global tensor as in
    the plan. Every parameter is replicated across groups: no piece is lost by leaving them out."""
    if _replica_backend() is None:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = plan.mesh
    axis, _ = ft.replica_part(mesh)
    split = sorted(f for f, spec in plan.param_specs.items() if not spec[axis].is_replicate())
    if split:  # a layout across groups would be a forward collective between them: refused when planning
        raise FaultToleranceError(
            f"ap.FaultTolerant: {split[:3]} are split across replica groups on {mesh.axis_names[axis]!r}; "
            "a group's checkpoint cannot hold them. Keep parameters replicated across groups."
        )
    shape = list(mesh.shape)
    shape[axis] //= ft.replicas(mesh)
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=mesh.axis_names)


class ReplicaBackend:
    """The plan's collectives for one rank of a replica group's job (runtime/backend.py's protocol).

    Groups are tuples of the plan's global ranks; those inside this replica group run on its
    DistBackend (``inner``) in the job's own ranks; the gradient all-reduce over ``line`` (the
    ranks holding the same pieces in every group) goes through torchft.
    """

    supports_in_place = True

    def __init__(self, inner: DistBackend, local: dict, line: tuple, job: ReplicaJob):
        self.inner, self.local, self.line, self.job = inner, local, tuple(line), job

    @property
    def stats(self):
        return self.inner.stats

    @stats.setter
    def stats(self, value):
        self.inner.stats = value

    @property
    def timeout(self):
        return self.inner.timeout

    @timeout.setter
    def timeout(self, value):
        self.inner.timeout = value

    def _in(self, kind: str, group: tuple, rank: int) -> tuple:
        """(``group`` and ``rank`` in this job's ranks); a group crossing replica groups is refused."""
        if all(r in self.local for r in group):
            return tuple(self.local[r] for r in group), self.local[rank]
        raise FaultToleranceError(
            f"ap.FaultTolerant: {'an' if kind[0] in 'aeiou' else 'a'} {kind} over ranks {group} crosses replica "
            "groups; only gradient all-reduces and written buffers' broadcasts do (through torchft). A forward collective on the replica axis (a batch "
            "norm synced over it: ap.sync_batch_norm) cannot survive a lost group: keep such layers' statistics "
            "per rank (plain BatchNorm; DataParallel(broadcast_buffers=True) keeps the running ones equal)."
        )

    def all_reduce_async(self, flat, group, rank):
        if tuple(group) == self.line:
            return _TorchftWork(self.job, flat)
        return self.inner.all_reduce_async(flat, *self._in("all_reduce", group, rank))

    def all_reduce(self, x, group, rank, op, kind="all_reduce"):
        return self.inner.all_reduce(x, *self._in(kind, group, rank), op)

    def all_reduce_(self, x, group, rank, op):
        return self.inner.all_reduce_(x, *self._in("all_reduce", group, rank), op)

    def all_gather(self, x, dim, group, rank, kind="all_gather"):
        return self.inner.all_gather(x, dim, *self._in(kind, group, rank))

    def reduce_scatter(self, x, dim, group, rank, op):
        return self.inner.reduce_scatter(x, dim, *self._in("reduce_scatter", group, rank), op)

    def all_to_all(self, x, src_dim, dst_dim, group, rank):
        return self.inner.all_to_all(x, src_dim, dst_dim, *self._in("all_to_all", group, rank))

    def all_to_all_v(self, x, send, recv, group, rank):
        return self.inner.all_to_all_v(x, send, recv, *self._in("all_to_all", group, rank))

    def broadcast(self, x, group, rank):
        """From the group's first rank, as without fault tolerance; a group crossing replica
        groups (buffers kept equal after a forward, buffer_sync.py): from its first rank in this
        replica group, then across groups from the first group taking part in the step."""
        if all(r in self.local for r in group):
            return self.inner.broadcast(x, *self._in("broadcast", group, rank))
        inside = tuple(r for r in group if r in self.local)
        if len(inside) > 1:
            self.inner.broadcast(x, *self._in("broadcast", inside, rank))
        return self.job.broadcast_across(x)

    def ring_shift(self, x, group, rank, offset):
        return self.inner.ring_shift(x, *self._in("ring_shift", group, rank), offset)

    def reduce_scatter_async(self, flat, group, rank):
        return self.inner.reduce_scatter_async(flat, *self._in("reduce_scatter", group, rank))

    def all_gather_async(self, out, chunk, group, rank):
        return self.inner.all_gather_async(out, chunk, *self._in("all_gather", group, rank))


class _TorchftWork:
    """A gradient bucket's all-reduce across replica groups: torchft's average over the groups
    taking part, times the plan's number of groups (the 1/|dp| already folded into the loss)."""

    def __init__(self, job: ReplicaJob, flat: torch.Tensor):
        self.job, self.flat = job, flat
        try:
            self.work = job.manager.allreduce(flat)  # waits for this step's quorum first
        except Exception as e:  # noqa: BLE001 - a quorum that never came: the lighthouse
            raise job.quorum_error(e) from e

    def wait(self) -> torch.Tensor:
        self.work.wait()  # a failure is recorded by the Manager: the step will not commit
        return self.flat.mul_(self.job.replicas)
