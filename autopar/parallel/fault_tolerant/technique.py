"""ap.FaultTolerant: training that survives a lost replica group, built on torchft.

The mesh axis ``replica_axis`` (the data-parallel axis, or the replicate axis of two-axis HSDP)
is cut into replica groups: each group (the ranks sharing one position on that axis) runs as its
own torch.distributed job (``torchrun`` per group, ``REPLICA_GROUP_ID`` = its position), so a
process lost in one group never breaks the others' process groups. Inside a group every other
axis works as without fault tolerance (tensor parallel, context parallel, zero=3 shards). Across
groups only the gradients travel, through torchft's ``Manager``: each step a quorum of the live
groups is agreed with the lighthouse, the gradient buckets are averaged over the groups in it
(torchft divides by the number that take part, so a step that lost a group commits the
survivors' mean), and the optimizer steps only where the step commits everywhere. A group that
restarts fetches parameters, buffers and optimizer state from a live peer (torchft's HTTP
checkpoint transport) and rejoins at the peers' step. Buffers a training forward writes are
broadcast from the first group taking part in the step; DCP checkpoints describe a group's
pieces on its own DeviceMesh (``checkpoint_mesh``), so one group writes them and any plan reads
them (job.py). runtime.py holds the run-time half, lighthouse.py starts the lighthouse.

What cannot cross a replica group is refused while planning, saying why: ZeRO-1/2 (a lost group
would take its shard of the optimizer state with it), zero=3 sharded across groups, local SGD
(its parameter averages are not gradients), a pipeline (its runner talks over a world group),
and ``shard_axes``. A cross-entropy mean over every data-parallel rank's rows needs a forward
collective across groups: under fault tolerance each group's own mean is used (``loss_mean=
"per_rank"``, DDP's and torchft's), which equals it when groups hold equal numbers of rows.

Example:
    >>> plan = ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), args=(x,), annotations=...,
    ...                fault_tolerant=ap.FaultTolerant("dp"))          # implies data_parallel="dp"
    >>> module = ap.parallelize(model, mesh, ..., fault_tolerant=ap.FaultTolerant("dp"))  # per group
    >>> opt = module.autopar_fault_tolerant.wrap(torch.optim.AdamW(module.parameters()))
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.collectives import collectives
from autopar.errors import FaultToleranceError
from autopar.parallel.fault_tolerant import runtime
from autopar.parallel.registry import TECHNIQUES, register_technique
from autopar.parallel.technique import Technique
from autopar.sharding.rules.batch_norm import SYNC_ATTR


@register_technique
@dataclass(frozen=True)
class FaultTolerant(Technique):
    """Replica groups on ``replica_axis`` that survive a lost one: each group its own job,
    gradients averaged across the live groups through torchft each step, a restarted group
    healed from a live one (docs/fault_tolerance.md).

    Example:
        >>> ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), args=(x,), fault_tolerant=ap.FaultTolerant("dp"))
    """

    replica_axis: str = "dp"
    min_replicas: int = 1  # groups a step needs to commit (torchft's min_replica_size)
    lighthouse: str | None = None  # "http://host:port"; None: $TORCHFT_LIGHTHOUSE
    timeout: float = 30.0  # seconds: the cross-group all-reduce, should_commit, a checkpoint fetch
    quorum_timeout: float = 30.0  # seconds a step waits for the lighthouse's quorum

    name = "fault_tolerant"
    order = 12  # after data parallel (its mesh reshaped by HSDP), before the pipeline

    def __post_init__(self):
        if not isinstance(self.replica_axis, str):
            raise FaultToleranceError(f"FaultTolerant(replica_axis={self.replica_axis!r}): give a mesh axis name.")
        if not (isinstance(self.min_replicas, int) and self.min_replicas >= 1):
            raise FaultToleranceError(f"FaultTolerant(min_replicas={self.min_replicas!r}) must be an int >= 1.")
        if not (self.timeout > 0 and self.quorum_timeout > 0):
            raise FaultToleranceError("FaultTolerant(timeout=, quorum_timeout=) are seconds > 0.")

    @classmethod
    def of(cls, value):
        """``fault_tolerant="dp"`` is ``FaultTolerant("dp")``."""
        return cls(value) if isinstance(value, str) else super().of(value)

    @classmethod
    def fold(cls, chosen: dict) -> dict:
        """The techniques as replica groups on ``replica_axis`` need them (``replica_groups``, asked of
        every registered one): data parallel on the replica axis when none was asked for, with
        each group's own loss mean (a mean over every rank's rows would be a forward collective
        across groups, which a lost group breaks)."""
        ft = chosen.get(cls.name)
        if ft is None:
            return chosen
        for technique in TECHNIQUES.values():
            chosen = technique.replica_groups(chosen, ft.replica_axis)
        return chosen

    def replica_part(self, mesh):
        """(mesh axis, its part or None) the replica groups are positions of (a SubAxis: two-axis
        HSDP's replicate axis, merged into one data-parallel axis)."""
        return mesh.sub_axis(self.replica_axis)

    def replicas(self, mesh) -> int:
        """How many replica groups the mesh has."""
        axis, part = self.replica_part(mesh)
        return mesh.axis_size(part if part is not None else axis)

    def replica_of(self, mesh, rank: int) -> int:
        """The replica group ``rank`` belongs to (its position on the replica axis)."""
        axis, part = self.replica_part(mesh)
        coord = mesh.coords(rank)[axis]
        return part.position(coord) if part is not None else coord

    def line(self, mesh, rank: int) -> tuple:
        """The ranks holding what ``rank`` holds in every replica group: its gradients' group."""
        axis, part = self.replica_part(mesh)
        return mesh.group(part if part is not None else axis, rank)

    # ------------------------------------------------------- the technique (technique.py)
    def validate(self, mesh, options, annotations: dict) -> None:
        axis, part = self.replica_part(mesh)
        dp, me = options.data_parallel, f"FaultTolerant({self.replica_axis!r})"
        if part is not None and part.part != "outer":
            raise FaultToleranceError(
                f"{me}: {self.replica_axis!r} is the shard axis of HSDP on {mesh}; replica groups are the "
                "replicate axis: FaultTolerant(<the DataParallel's replicate_axis>)."
            )
        if dp is None or dp.axis is None or mesh.axis_index(dp.axis) != axis:
            raise FaultToleranceError(
                f"{me} averages gradients across replica groups on {self.replica_axis!r}: split the batch on it "
                f"(data_parallel={self.replica_axis!r}, or ap.DataParallel('shard', zero=3, "
                f"replicate_axis={self.replica_axis!r}) for HSDP), not on {None if dp is None else dp.axis!r}."
            )
        self._validate_storage(dp, part, me)
        if options.pipeline is not None:
            raise FaultToleranceError(
                f"{me} with a pipeline: the pipeline runner sends activations over one process group spanning "
                "the whole mesh, which a lost replica group breaks. Drop pipeline= (tensor, context parallel "
                "and zero=3 inside each group are supported)."
            )

    def _validate_storage(self, dp, part, me: str) -> None:
        if dp.zero in (1, 2):
            raise FaultToleranceError(
                f"{me} with DataParallel(zero={dp.zero}): ZeRO-{dp.zero} keeps each rank's shard of the optimizer "
                "state on one data-parallel rank only, so a lost replica group takes its shard with it and no "
                "peer can heal it. Use zero=0, or zero=3 inside each group: ap.DataParallel('shard', zero=3, "
                f"replicate_axis={self.replica_axis!r}) on a mesh ({self.replica_axis!r}, 'shard', ...)."
            )
        if dp.local_sgd_every is not None:
            raise FaultToleranceError(
                f"{me} with DataParallel(local_sgd_every={dp.local_sgd_every}): local SGD averages parameters, "
                "not gradients, across the groups, which torchft's Manager here does not carry. Drop "
                "local_sgd_every (every step then averages gradients across the live groups)."
            )
        if dp.shard_axes is not None:
            raise FaultToleranceError(f"{me} with DataParallel(shard_axes=...): not supported; drop shard_axes.")
        if dp.zero == 3 and (part is None or dp.shard_size is None or part.within % dp.shard_size):
            raise FaultToleranceError(
                f"{me} with DataParallel({dp.axis!r}, zero=3): the parameters are sharded across replica groups, "
                "so a lost group takes shards nobody else holds. Shard inside each group (HSDP): a mesh "
                f"({self.replica_axis!r}, 'shard', ...) with ap.DataParallel('shard', zero=3, "
                f"replicate_axis={self.replica_axis!r})."
            )

    def after_plan(self, plan):
        """Refuse a collective of the program across the replica axis (a loss the model computes as
        a mean over the batch: every group's mean averaged across groups in the forward), which a
        lost group breaks: only gradients cross groups."""
        label, nodes = plan.mesh.axis_label(self.replica_part(plan.mesh)[0]), {n.name for n in plan.graph.nodes}
        for c in collectives(plan, grad_sync=False):  # the program's own (not zero=3's gathers inside groups)
            if c.axis == label and c.node in nodes:
                raise FaultToleranceError(
                    f"FaultTolerant({self.replica_axis!r}): {c.node} (module {c.module or '(top)'!r}) runs a {c.kind} "
                    f"over {label!r} in the {c.phase}: a collective across replica groups that a lost group breaks. "
                    + _fix(plan, c.module)
                )

    def join(self, plan, timeout: float | None):
        """ap.parallelize in one replica group's job: make this group's process groups and the
        backend that sends gradients across groups through torchft (runtime.py)."""
        return runtime.join_replica_group(self, plan, timeout)

    def attach(self, plan, module, rank: int) -> None:
        """Give ``module`` its ``autopar_fault_tolerant`` (the group's torchft Manager and the
        optimizer wrapper) where it runs in a replica group's job; nothing in plan.simulate or
        plan.check, where every group is present and the sync is plain data parallel."""
        runtime.attach(plan, module)

    def checkpoint_mesh(self, plan):
        """In a replica group's job, the group's DeviceMesh (runtime.group_device_mesh): its
        checkpoint pieces are the global tensors' boxes as in the plan, on the ranks it has."""
        return runtime.group_device_mesh(self, plan)

    def describe(self, plan) -> str:
        n = self.replicas(plan.mesh)
        return (
            f"fault tolerant: {n} replica groups of {plan.mesh.size // n} ranks on {self.replica_axis!r} "
            f"(torchft; a step commits with >= {self.min_replicas} live groups)"
        )

    def explain_param(self, plan, fqn: str) -> list[str]:
        return [
            f"fault tolerant: its gradient is averaged across the live replica groups on {self.replica_axis!r} "
            "through torchft each step; a restarted group fetches it from a live one"
        ]


def _fix(plan, module: str | None) -> str:
    """What to do about a forward collective across replica groups, by what runs it."""
    owner = plan.model.get_submodule(module) if module else None
    if getattr(owner, SYNC_ATTR, False):
        return (
            "A batch norm synced over the whole batch (ap.sync_batch_norm) needs every group's statistics each "
            "step: use plain BatchNorm (each rank's own batch statistics; the running ones are broadcast from "
            "the first live group after each training forward)."
        )
    return (
        "(A loss computed inside the model, a mean over the batch, or an op without a rule on the batch.) Return "
        "per-row outputs (the logits) and take the loss outside the module: each group's own mean, averaged "
        "across live groups by torchft."
    )
