"""RuntimeHooks, the runtime hooks of a technique.

What a technique does when ranks run: the torch.distributed job(s) it runs the mesh as, the
process groups it needs, the hooks it puts on a rank's module, the mesh checkpoints describe, and
a rank's step where the technique runs it itself (``dry_run_rank``: a ``DryRank``).

Called by ``ap.parallelize`` (api.py), parallel/process_groups.py, codegen/rank_module.py,
``ap.get_state_dict`` and ``plan.dry_run`` (dryrun/run.py).

Example:
    >>> from autopar.parallel.protocols.runtime import RuntimeHooks
    >>> from autopar.parallel.technique import Technique
    >>> issubclass(Technique, RuntimeHooks)
    True
"""

from __future__ import annotations


class DryRank:
    """One rank's training step as a technique runs it in plan.dry_run's fake world
    (``dry_run_rank``): the dry run steps ``module``'s parameters with ap.Optimizer, moves and
    counts the buffers of ``stages``, runs ``step()`` and puts what it measured beside
    ``predicted``. Subclassed by the technique's own (the pipeline's ``PipelineDryRank``).

    Example:
        >>> own = plan.options.pipeline.dry_run_rank(plan, 0, torch.device("meta"), stats)
        >>> own.step(); own.predicted(state_slots=2)
    """

    #: the module whose parameters the optimizer steps (a pipeline rank's runner)
    module = None
    #: the modules whose buffers and constants are moved to the device and counted
    stages: list = []

    def step(self) -> None:
        """One step's forwards and backwards, with the gradient sync (not the optimizer's step)."""
        raise NotImplementedError

    def predicted(self, state_slots: int) -> tuple[list, float]:
        """(the collectives and messages as (kind, axis, bytes), the FLOPs) the plan says one step
        of this rank runs, with ``state_slots`` optimizer tensors per parameter."""
        raise NotImplementedError


class RuntimeHooks:
    """The runtime hooks of a technique (all optional: each default changes nothing)."""

    def join(self, plan, timeout: float | None) -> tuple | None:
        """ap.parallelize where this technique runs the mesh as several torch.distributed jobs
        (fault tolerance: one per replica group): make this job's process groups and backend and
        return (this process' rank in the plan, mesh axes its replicated tensors are not
        broadcast over). None: one job over the whole mesh (the default)."""
        return None

    def attach(self, plan, module, rank: int) -> None:
        """Runtime hooks on ``rank``'s module (gradient sync, optimizer helpers)."""

    def dry_run_rank(self, plan, rank: int, device, stats) -> DryRank | None:
        """plan.dry_run, in its fake world (fake tensor mode, ``stats`` the fake process group's
        CommStats) where the technique runs ``rank``'s step itself (a pipeline: the rank's runner
        through its schedule): a ``DryRank`` on ``device``. None: the rank module's forward and
        backward, as a training loop runs them (the default)."""
        return None

    def checkpoint_mesh(self, plan):
        """The torch DeviceMesh checkpoints describe this job's pieces on, where the job is not
        the whole mesh (fault tolerance: one replica group); None: the plan's mesh."""
        return None

    def process_groups(self, plan) -> list:
        """Rank groups beyond the mesh axes' that the technique's collectives use (ap.parallelize
        makes them on every rank, in this order)."""
        return []

    def synced_buffers(self, plan) -> list[str]:
        """Names of the buffers the program writes that this technique keeps equal across the
        ranks holding replicas of them (data parallel's broadcast after each training forward):
        fault tolerance keeps them so across replica groups too."""
        return []
