"""RuntimeHooks, the runtime hooks of a technique.

What a technique does when ranks run: the torch.distributed job(s) it runs the mesh as, the
process groups it needs, the hooks it puts on a rank's module, the mesh checkpoints describe.

Called by ``ap.parallelize`` (api.py), parallel/process_groups.py, codegen/rank_module.py and
``ap.get_state_dict``.

Example:
    >>> from autopar.parallel.protocols.runtime import RuntimeHooks
    >>> from autopar.parallel.technique import Technique
    >>> issubclass(Technique, RuntimeHooks)
    True
"""

from __future__ import annotations


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
