"""One rank's view of a fault-tolerant job: torchft's Manager, the optimizer wrapper, what a
healing peer fetches, DCP checkpoints and the buffers the forward writes.

- ``ReplicaJob.wrap(opt)``: the optimizer as the loop uses it (zero_grad starts the step's
  quorum, step commits or drops it).
- Healing: a restarted group fetches parameters, buffers and optimizer state from a live peer
  (torchft's HTTP transport) and rejoins at the peers' step.
- Checkpoints: ``ap.get_state_dict`` in a group's job describes each piece on the group's own
  DeviceMesh (the replica axis reduced to this group, technique hook ``checkpoint_mesh``): the
  pieces are the same global tensors in every group, so one group writes the checkpoint
  (``saves_checkpoint()``: the first group taking part in the step just committed) and any job,
  fault-tolerant or not, any plan, loads it. ``state_dict()`` is the job's step count, saved
  beside it; loaded before the first step, the groups resume there, and a group that loaded an
  older checkpoint than its peers' step heals from them.
- Buffers the forward writes (batch-norm running statistics): with ``broadcast_buffers`` on (the
  default) they are broadcast after each training forward from the first group taking part in
  the step (runtime.py's ReplicaBackend.broadcast), DDP's values over the live groups; a step
  that does not commit puts them back as they were before it (its forward runs again, and each
  committed batch counts once); a healing peer is sent their values from before the step's
  forward (the forward writes them while the transfer may run).

Example:
    >>> ft = module.autopar_fault_tolerant
    >>> opt = ft.wrap(torch.optim.AdamW(module.parameters(), lr=1e-3))
    >>> opt.zero_grad(); loss_fn(module(x)).backward(); committed = opt.step()
    >>> if committed and ft.saves_checkpoint():
    ...     model_sd, optim_sd = ap.get_state_dict(module, opt)
    ...     dcp.save({"model": model_sd, "optim": optim_sd, "ft": ft.state_dict()}, checkpoint_id=path)
"""

from __future__ import annotations

import os

import torch
from torch.distributed import ReduceOp

from autopar.errors import FaultToleranceError
from autopar.trace.written_buffers import written

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable


class ReplicaJob:
    """See the module docstring. ``step``: the job's committed steps (the same in every live
    group; a healed group takes its peers'), the index to draw the next batch by so every
    committed batch is used once."""

    def __init__(self, ft, manager, replica: int, replicas: int):
        self.ft, self.manager, self.replica, self.replicas = ft, manager, replica, replicas
        self.module, self.optimizer = None, None
        self.written: list[str] = []  # buffers the forward writes
        self.synced: set[str] = set()  # ... and broadcast after it (equal in every group)
        self._before: dict = {}  # the written buffers as they were when this step began

    def attach(self, plan, module) -> None:
        self.module = module
        held = dict(module.named_buffers())
        self.written = [n for n in written(plan) if n in held]
        self.synced = {n for t in plan.options.techniques for n in t.synced_buffers(plan)} & set(self.written)

    @property
    def step(self) -> int:
        return self.manager.current_step()

    def participants(self) -> int:
        """Groups whose gradients this step averages (waits for the quorum)."""
        return self.manager.num_participants()

    def participating(self) -> bool:
        """Whether this group's gradients count this step (False while it heals; waits for the
        quorum)."""
        try:
            self.manager.participating_rank()  # waits for the step's quorum (torchft's flag does not)
        except Exception as e:  # noqa: BLE001 - a quorum that never came: the lighthouse
            raise self.quorum_error(e) from e
        return self.manager.is_participating()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The job's place: torchft's ``{"step", "batches_committed"}``. Save it in the DCP
        checkpoint beside ap.get_state_dict's dicts."""
        return dict(self.manager.state_dict())

    def load_state_dict(self, state: dict) -> None:
        """Resume at a checkpoint's step; call before the first ``zero_grad`` (the step is what
        this group tells the lighthouse: groups behind the others heal from them)."""
        self.manager.load_state_dict({k: int(v) for k, v in state.items()})

    def saves_checkpoint(self) -> bool:
        """Whether this group writes the checkpoint of the step just committed: the first group
        taking part in it (one writer whichever groups live; a healing group never). Every rank of
        the group gets the same answer: call dcp.save on all of them."""
        return self.manager.participating_rank() == 0

    # ------------------------------------------------------------------ healing
    def wrap(self, optimizer: torch.optim.Optimizer) -> "FaultTolerantOptimizer":
        """The optimizer as the loop must use it (zero_grad starts the step's quorum, step commits
        or drops it); registers what a healing peer fetches: parameters, buffers, optimizer state."""
        if self.module is None:
            raise FaultToleranceError("ap.FaultTolerant: wrap the optimizer of a module built by ap.parallelize.")
        if self.optimizer is not None:
            raise FaultToleranceError("ap.FaultTolerant: one optimizer per module (wrap was called twice).")
        self.optimizer = FaultTolerantOptimizer(self, optimizer)
        self.manager.register_state_dict_fn("autopar", self._load, self._state)
        return self.optimizer

    def _state(self) -> dict:
        """What a healing peer fetches (in torchft's quorum thread, while this rank's forward may
        run: the parameters and optimizer state do not change before the commit, the buffers the
        forward writes do, so their values from before the step are sent)."""
        m = self.module
        tensors = {k: v.detach() for k, v in m.named_parameters()}
        tensors.update((k, self._before.get(k, v).detach()) for k, v in m.named_buffers())
        return {"tensors": tensors, "optimizer": self.optimizer.inner.state_dict()}

    def _load(self, state: dict) -> None:
        """Apply a peer's state (at the commit of the step this group heals in). A synced written
        buffer keeps what this step's forward broadcast gave it: the first live group's value
        after the step, where the peer's sent value is from before it."""
        m = self.module
        with torch.no_grad():
            for name, value in [*m.named_parameters(), *m.named_buffers()]:
                if name not in self.synced:
                    value.copy_(state["tensors"][name])  # in place: gradient buckets keep their views
        self.optimizer.inner.load_state_dict(state["optimizer"])

    # ------------------------------------------------------------------ written buffers
    def begin_step(self) -> None:
        """Keep the written buffers as they are before the step's forward (before its quorum
        starts: a healing peer may fetch them as soon as it does)."""
        buffers = dict(self.module.named_buffers())
        self._before = {n: buffers[n].detach().clone() for n in self.written}

    def sync_start(self) -> None:
        """At step 0 every group takes the first group's parameters and buffers (one all-reduce
        per dtype), as a data-parallel job broadcasts rank 0's at start. torchft's own start sync
        (init_sync, off here) heals each rank's line from another group (it spreads the sources
        by rank), so one group's ranks could start from different groups' weights, and it counts
        the healing groups among those taking part in the step's mean."""
        m = self.module
        tensors = [t.detach() for _, t in [*m.named_parameters(), *m.named_buffers()]]
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for same in by_dtype.values():
                flat = self.broadcast_across(torch.cat([t.reshape(-1) for t in same]))
                for t, piece in zip(same, flat.split([t.numel() for t in same])):
                    t.copy_(piece.view_as(t))

    def end_step(self, committed: bool) -> None:
        """A step that did not commit runs again: its forward's writes are undone."""
        if committed or not self._before:
            return
        buffers = dict(self.module.named_buffers())
        with torch.no_grad():
            for n, value in self._before.items():
                buffers[n].copy_(value)

    def broadcast_across(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of the first group taking part in this step, on every group's rank of this line
        (the others and a healing group add zeros to torchft's sum)."""
        try:
            first = self.manager.participating_rank() == 0  # waits for this step's quorum
        except Exception as e:  # noqa: BLE001 - a quorum that never came: the lighthouse
            raise self.quorum_error(e) from e
        if not first:
            x.zero_()
        self.manager.allreduce(x, reduce_op=ReduceOp.SUM).wait()  # a failure: the step will not commit
        return x

    def quorum_error(self, e: Exception) -> FaultToleranceError:
        lighthouse = self.ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        return FaultToleranceError(
            f"ap.FaultTolerant: replica group {self.replica} got no quorum from the lighthouse at {lighthouse} "
            f"within {self.ft.quorum_timeout:g} s ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            "The lighthouse is gone or unreachable: restart it at that address (python -m "
            "autopar.parallel.fault_tolerant.lighthouse) and restart the groups from your last checkpoint."
        )


class FaultTolerantOptimizer:
    """A torch optimizer stepped only on committed steps (torchft's OptimizerWrapper, and the
    errors of a lost lighthouse named). ``inner``: the optimizer wrapped."""

    def __init__(self, job: ReplicaJob, inner: torch.optim.Optimizer):
        self.job, self.inner = job, inner

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start this step's quorum (it runs while the forward does) and clear the gradients."""
        self.job.begin_step()
        try:
            self.job.manager.start_quorum()  # waits for the last step's quorum: its failure shows here
        except Exception as e:  # noqa: BLE001 - named: the lighthouse
            raise self.job.quorum_error(e) from e
        if self.job.step == 0 and self.job.participating():  # (waits for the quorum) not healing: every
            self.job.sync_start()  # group in it is at step 0 too; they all take the first one's weights
        self.inner.zero_grad(set_to_none)

    def step(self, closure=None) -> bool:
        """Step where every live group's gradients arrived (True), else drop the step (False)."""
        if closure is not None:
            raise FaultToleranceError("ap.FaultTolerant: optimizer closures are not supported (torchft's neither).")
        try:
            committed = self.job.manager.should_commit()
        except Exception as e:  # noqa: BLE001 - the quorum's failure surfaces here or in backward
            raise self.job.quorum_error(e) from e
        if committed:
            self.inner.step()
        self.job.end_step(committed)
        return committed
