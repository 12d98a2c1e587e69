"""StorageHooks, the storage hooks of a technique.

How a technique stores parameters otherwise than it computes with them (fully sharded data
parallel keeps a 1-D range of each piece), rewrites the emitted program (zero=3's gathers,
precision casts), and keeps gradients (ZeRO's slices, the buckets' axes).

Called by the rank modules (codegen/rank_module.py), ``Plan.program``, checkpoints, clipping and
zero=3's buckets.

Example:
    >>> from autopar.parallel.protocols.storage import StorageHooks
    >>> from autopar.parallel.technique import Technique
    >>> issubclass(Technique, StorageHooks)
    True
"""

from __future__ import annotations


class StorageHooks:
    """The storage hooks of a technique (all optional: each default changes nothing)."""

    def stored(self, plan, rank: int, fqn: str, local):
        """What ``rank`` stores of parameter ``fqn``, given its piece in the computed layout."""
        return local

    def stored_start(self, plan, rank: int, fqn: str) -> int | None:
        """Where ``stored``'s piece of ``fqn`` starts in ``rank``'s flattened computed piece when
        it is a contiguous 1-D range of it (checkpoints describe it by that range); None when
        the rank stores the computed piece as it is."""
        return None

    def stored_axes(self, plan, fqn: str) -> tuple:
        """Mesh axes over which ``stored`` gives ranks different pieces of ``fqn``."""
        return ()

    def stored_share(self, plan, fqn: str) -> int:
        """Into how many stored pieces ``stored`` cuts ``fqn``'s computed piece (zero=3: its shard
        group's size), 1 when stored as computed: the gradient sync on other axes moves the stored
        piece, so the cost model divides its bytes by this."""
        return 1

    def counts_stored(self, plan, rank: int, fqn: str) -> bool:
        """Whether ``rank``'s stored piece of ``fqn`` is counted in a whole-model sum (gradient
        norm) over ``stored_axes``: False on all but one of the ranks storing the same piece."""
        return True

    def restored(self, plan, per_rank: list) -> list:
        """Every rank's dict of computed-layout pieces from its stored pieces (``stored``'s inverse)."""
        return per_rank

    def rewrite_program(self, plan, graph) -> None:
        """Edit the emitted program (every rank's) before its code is generated."""

    def gather_wire(self, plan) -> dict:
        """Parameters zero=3 gathers in a form of this technique's rather than in the compute
        dtype (float8: the weights cast to fp8 before the all-gather), canonical name -> a hashable
        wire: its ``dtype`` crosses; ``bind(plan, runtime)`` gives the run-time half, whose
        ``reset()``, ``pack(k, chunk)`` and ``unpack(k, views)`` parallel/data_parallel/fsdp_runtime.py calls.
        Such parameters get buckets of their own."""
        return {}

    def grad_sync_axes(self, plan, axes: dict) -> dict:
        """The gradient buckets' axes per parameter (a technique reducing some itself drops them)."""
        return axes

    def grad_pieces(self, plan, module, rank: int, pieces: list) -> list:
        """(name, gradient, counted by this rank) of every gradient ``rank`` holds, as the
        technique keeps them: whole-model sums (clipping) add the counted ones once."""
        return pieces
