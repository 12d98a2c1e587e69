"""StorageHooks, the storage hooks of a technique.

How a technique stores parameters otherwise than it computes with them (fully sharded data
parallel keeps a 1-D range of each piece), rewrites the emitted program (zero=3's gathers,
precision casts), and keeps gradients (ZeRO's slices, the buckets' axes).

Called by the rank modules (codegen/rank_module.py), ``Plan.program``, checkpoints, clipping and
zero=3's buckets. A technique that has each rank step a slice of every gradient bucket (ZeRO 1-2)
answers ``grad_shards`` with a ``GradShards``, which the gradient sync, ap.Optimizer and the
clipping ask; the optimizer it steps them with is a ``SlicedOptimizer``, which ap.GradScaler and
checkpoints ask. Nothing outside the technique's folder names its classes.

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

    def grad_order(self, plan, order: list) -> list:
        """The parameter names in the order their gradients reach the gradient sync (``order``:
        backward's, parallel/param_names.param_order): a technique that sets gradients itself
        (zero=3: a bucket's pieces at once, after its reduce-scatter) says when they arrive. The
        sync's buckets are made in this order (and made again from the order seen, once)."""
        return order

    def grad_pieces(self, plan, module, rank: int, pieces: list) -> list:
        """(name, gradient, counted by this rank) of every gradient ``rank`` holds, as the
        technique keeps them: whole-model sums (clipping) add the counted ones once."""
        return pieces

    def grad_shards(self):
        """A fresh ``GradShards`` for one rank module's gradient sync where each rank steps only a
        slice of every gradient bucket (ZeRO 1-2), None where the ranks step whole parameters.
        parallel/grad_sync.py asks it before it makes its buckets and binds it to them after."""
        return None

    def keeps_gathered(self) -> bool:
        """Whether the weights this technique gathers stay gathered from their forward to their
        backward (zero=3 without resharding after forward): the memory phases (cost/plan_cost.py)
        then hold them at the loss's backward too."""
        return False

    def keeps_state(self) -> bool:
        """Whether this technique keeps the parameters, gradients and optimizer state of the ranks
        it syncs gradients over, as a storage policy of its own (data parallel's ZeRO levels): it
        is then ``plan.state_storage``, which the cost model and the search weigh."""
        return False

    def group_axes(self, mesh, axes: tuple) -> tuple:
        """Of a gradient bucket summed over mesh axes ``axes``, those this technique reduces as
        one group (data parallel's axis, or its shard group over dp x cp), () for none: the cost
        model prices that group's collectives by ``bucket_comms``."""
        return ()

    def gather_axes(self, plan) -> tuple:
        """Mesh axes (indices) over which this technique stores weights in pieces that it
        all-gathers before use (zero=3: its shard group), () where it gathers none: a gather wire
        (float8's fp8 all-gather) scales each weight over them."""
        return ()

    def weight_shards(self, plan) -> tuple | None:
        """(the mesh axis that splits the batch, how many of its ranks share one weight's pieces)
        where this technique gathers weights over it before use (zero=3; HSDP: its shard size),
        None where it does not: the cost model's float8 casts ask it (each on a rank's piece)."""
        return None

    def wired_gathers(self, plan, graph) -> list:
        """The nodes of ``graph`` (the emitted program, after this technique's ``rewrite_program``)
        that gather weights in a technique's gather wire (``gather_wire``): the wire's technique
        reads their outputs (its ``unpack``'s) in its own ``rewrite_program``."""
        return []

    def wired_params(self, plan, rank: int) -> list[str]:
        """Names of the parameters ``rank`` gathers in a gather wire (``gather_wire``), each once:
        the wire's technique counts what its collectives carry."""
        return []


class GradShards:
    """Each rank's slices of the gradient buckets, as a storage keeps them (``grad_shards``): the
    gradient sync hands it the reduced gradients, ap.Optimizer asks it for the optimizer that steps
    the slices, and the module's ``zero_grad`` clears them. Subclassed by the storage's own
    (ZeRO 1-2's ``ZeroShards``).

    Example:
        >>> shards = plan.data_parallel.grad_shards()      # zero=2: a ZeroShards, not yet bound
        >>> shards.reduce_scatters
        True
    """

    #: the buckets are reduce-scattered (each rank keeps only its reduced slice), not all-reduced
    reduce_scatters: bool = False
    #: the optimizer stepping the slices, once made (the gradient sync refuses a backward without one)
    stepped_by = None

    def bind(self, sync, bucket_ids: list[int]) -> None:
        """Lay out buckets ``bucket_ids`` of the gradient sync ``sync`` (its parameters become views
        of one flat buffer per bucket) and take this rank's slice of each."""
        raise NotImplementedError

    def own_slice(self, i: int, full):
        """This rank's slice of a flat tensor the size of bucket ``i``."""
        raise NotImplementedError

    def set_grad(self, i: int, chunk, accumulate: bool = True) -> None:
        """This rank's reduced gradient slice of bucket ``i`` to the tensors it steps."""
        raise NotImplementedError

    def check_stepped(self) -> None:
        """Raise, saying how to fix it, where no optimizer steps the slices (``stepped_by``)."""
        raise NotImplementedError

    def clear_grads(self, set_to_none: bool = True) -> None:
        """What the module's ``zero_grad()`` clears beside its parameters' ``.grad``."""

    def sliced_names(self) -> set[str]:
        """The parameters (gradient sync names) whose buckets are sliced."""
        raise NotImplementedError

    def slice_tensors(self, names) -> list:
        """The slice tensors (each with its reduced ``.grad``) of the parameters in ``names``."""
        raise NotImplementedError

    def gather_grads(self) -> None:
        """Every rank's reduced slices into the parameters' ``.grad``, whole (an optimizer that reads
        whole tensors steps them); nothing where the ``.grad`` are whole already."""

    def optimizer_for(self, module, optimizer_class, param_groups, **defaults):
        """The ``SlicedOptimizer`` stepping these slices with ``optimizer_class`` (an elementwise one)."""
        raise NotImplementedError


class SlicedOptimizer:
    """An optimizer that steps slices of a rank module's parameters rather than the parameters (ZeRO
    1-2's ap.ZeroOptimizer, from ``GradShards.optimizer_for``): ap.GradScaler asks it for its
    ``module`` and ``stepped_tensors()``, checkpoints for its ``param_slices()``.

    Example:
        >>> isinstance(ap.ZeroOptimizer(module, torch.optim.AdamW, lr=1e-3), SlicedOptimizer)
        True
    """

    #: the rank module whose parameters it steps slices of
    module = None

    def stepped_tensors(self) -> list:
        """The tensors whose ``.grad`` its step reads (what ap.GradScaler unscales and checks)."""
        raise NotImplementedError

    def param_slices(self) -> dict:
        """Each slice tensor it steps -> (the module parameter it is a slice of, where the slice
        starts in the flattened parameter): checkpoints lay its state out by that range."""
        raise NotImplementedError
