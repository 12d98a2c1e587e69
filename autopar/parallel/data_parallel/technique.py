"""ap.DataParallel: how the data-parallel axis synchronises, as one frozen value.

``data_parallel=`` in ap.plan / ap.parallelize takes either the axis name (``"dp"``: every
option at its default) or a DataParallel naming the axis and the options:

- ``bucket_mb`` / ``bucket_max_params``: gradients are fused into flat buckets bounded by
  bytes and by count (grouped by dtype), one collective per bucket, launched during backward
  as soon as the bucket's last gradient is accumulated. As in DDP the first bucket is
  smaller (``first_bucket_mb``, 1 MB) so that communication starts early in backward.
- ``zero``: 0 (plain all-reduce, every rank steps everything), 1 (optimizer state sharded:
  gradients all-reduced, each rank steps only its 1/dp slice of every bucket and the slices
  are all-gathered) or 2 (gradients too: reduce-scattered, the non-owned gradient memory is
  freed). Stages 1 and 2 need ``ap.ZeroOptimizer`` (or ``plan.zero_optimizer``).
- ``local_sgd_every=k``: no gradient sync on the axis; each rank steps on its own gradient
  and parameters are averaged every k optimizer steps (``module.autopar_local_sgd``).
- ``reduce_dtype``: gradients are cast to this dtype for the collective and back after it.
- ``zero=3`` (fully sharded, parallel/data_parallel/fsdp.py): each rank stores 1/dp of every parameter;
  per block the pieces are all-gathered right before use (``prefetch`` next blocks in
  flight), freed after the forward (``reshard_after_forward``) and gathered again for
  backward; gradients are reduce-scattered into the pieces; a plain torch optimizer steps
  them. ``shard_size=k`` (HSDP): shard over groups of k dp ranks, replicate across groups.
  ``replicate_axis="rep"`` (HSDP over two mesh axes, ``axis`` the shard axis right after
  ``rep``): the two become one data-parallel axis ``rep_axis`` with ``shard_size`` = |axis|
  (``plan.mesh`` shows it; every rank keeps its number and its groups); ``shard_size`` =
  |rep| x |axis| shards over both (a (8, 8) mesh as 64-way FSDP).
- data parallel over two mesh axes at any ZeRO level: ``replicate_axis`` with zero 0-2 splits
  the batch over both (one data-parallel axis of their product; ZeRO-1/2 shard over all of it).
- ``param_dtype`` / ``output_dtype`` (any zero level): the precision policy (parallel/data_parallel/precision.py):
  the model traced and computed in ``param_dtype`` over fp32 master parameters (cast at the gather
  under zero=3, at their read otherwise); the outputs cast to ``output_dtype``.
- ``loss_mean``: a cross-entropy mean computed inside the model over rows split on this axis
  divides by the count of every rank's counted rows ("global", the default: the serial model on
  the union of the ranks' batches, also when ranks hold different numbers of tokens), or by the
  rank's own count ("per_rank": DDP's loss, each rank's mean, their gradients averaged).
- ``broadcast_buffers`` (default True, as DDP): buffers the model writes (batch-norm running
  statistics) are broadcast from the first dp rank after every training forward, so replicas
  stay equal (parallel/data_parallel/buffer_sync.py); False lets each rank keep its own.
- ``shard_axes=("dp", "cp")`` (zero 1-3): ZeRO shards over the ranks of these adjacent axes
  together, as torchtitan's FSDP shards over its flattened ``dp_shard_cp`` mesh: the axis after
  ``axis`` must be one whose tokens another technique splits (context parallel's), where the
  parameters are replicated and their gradients arrive in parts. One reduce-scatter (zero=2, 3)
  or all-reduce (zero=1) over the dp x cp ranks sums what dp's and cp's syncs summed apart, and
  each rank keeps 1/(dp cp) of the state. The layouts keep dp and cp apart; only the storage's
  groups span both. On a mesh without a dp axis ``axis`` is left out:
  ``DataParallel(zero=3, shard_axes=("cp",))`` (torchtitan's 1 x cp run).

Example:
    >>> dp = ap.DataParallel("dp", bucket_mb=4, zero=2, reduce_dtype=torch.bfloat16)
    >>> plan = ap.plan(model, ap.Mesh((4,), ("dp",)), args=(x,), data_parallel=dp)
    >>> fsdp = ap.DataParallel("dp", zero=3, shard_axes=("dp", "cp"))   # 1/4 of the state per rank
    >>> plan = ap.plan(model, ap.Mesh((2, 2), ("dp", "cp")), args=(ids,), data_parallel=fsdp, context_parallel="cp")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy
import torch

from autopar.errors import DataParallelError
from autopar.parallel import dp_module
from autopar.parallel.data_parallel import buffer_sync
from autopar.parallel.data_parallel.fsdp import FullyShardedStorage, held_buckets
from autopar.parallel.grad_buckets import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB
from autopar.parallel.data_parallel.fsdp_layout import buckets_cached, gather_wires
from autopar.parallel.data_parallel.fsdp_runtime import fsdp_gather
from autopar.parallel.data_parallel.local_sgd import LocalSGD
from autopar.parallel.data_parallel.precision import DTYPES, MixedPrecision, cast_program
from autopar.parallel.param_names import canonical_names
from autopar.parallel.registry import TECHNIQUES, register_technique
from autopar.parallel.data_parallel.storage import Replicated, ShardedOptimizer
from autopar.parallel.technique import Technique
from autopar.parallel.data_parallel.zero import ZeroOptimizer
from autopar.trace.model_members import named_parameters

# the storage policy of each ZeRO level (parallel/data_parallel/storage.py), chosen once per DataParallel
STORAGE = {0: Replicated(), 1: ShardedOptimizer(1), 2: ShardedOptimizer(2), 3: FullyShardedStorage()}


@register_technique
@dataclass(frozen=True)
class DataParallel(Technique):
    axis: str | None = None  # None: no batch split (ZeRO over shard_axes only)
    bucket_mb: float = DEFAULT_BUCKET_MB
    bucket_max_params: int | None = None
    zero: int = 0
    local_sgd_every: int | None = None
    reduce_dtype: torch.dtype | None = None
    first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB
    reshard_after_forward: bool = True  # zero=3: free gathered blocks after forward
    prefetch: int = 1  # zero=3: blocks whose gather is started ahead
    shard_size: int | None = None  # zero=3 HSDP: shard group size (None: the dp axis)
    replicate_axis: str | None = None  # zero=3 HSDP over two mesh axes: shard on axis, replicate here
    param_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    broadcast_buffers: bool = True  # as DDP: written buffers (batch-norm statistics) kept equal
    loss_mean: str = "global"  # a cross-entropy mean over dp-split rows: all ranks' rows, or "per_rank" (DDP)
    shard_axes: tuple | None = None  # zero 1-3: shard over these adjacent axes together (dp, then cp)

    name = "data_parallel"
    order = 10  # first: the batch split shapes every layout

    def compute_dtype(self):
        return self.param_dtype

    def precision_policy(self):
        """Its dtypes as one ap.MixedPrecision, None where it names none."""
        if all(getattr(self, k) is None for k in DTYPES):
            return None
        return MixedPrecision(**{k: getattr(self, k) for k in DTYPES})

    @classmethod
    def replica_groups(cls, chosen: dict, axis: str) -> dict:
        """What crossing replica groups on ``axis`` needs of data parallel: the replica axis as its
        axis when none was asked for, and each group's own loss mean (a mean over every rank's rows
        would be a forward collective across groups, which a lost group breaks)."""
        dp = chosen.get(cls.name) or cls(axis)
        if dp.loss_mean != "per_rank":
            dp = dataclasses.replace(dp, loss_mean="per_rank")
        return {**chosen, cls.name: dp}

    @property
    def storage(self):
        """How parameters, gradients and optimizer state are kept: the policy of ``zero``."""
        return STORAGE[self.zero]

    def __post_init__(self):
        if self.shard_axes is not None:
            object.__setattr__(self, "shard_axes", tuple(self.shard_axes))  # a list from a plan file
            self._check_shard_axes()
        if not isinstance(self.axis, str) and not (self.axis is None and self.shard_axes):
            raise DataParallelError(
                f"DataParallel axis must be a mesh axis name, got {self.axis!r} (None only with "
                "shard_axes: ZeRO over a context-parallel axis without data parallel)."
            )
        if not (self.bucket_mb > 0 and self.first_bucket_mb > 0):
            raise DataParallelError(
                f"DataParallel(bucket_mb={self.bucket_mb}, first_bucket_mb={self.first_bucket_mb}) "
                "must be > 0 (DDP's defaults: 25 and 1)."
            )
        if self.bucket_max_params is not None and self.bucket_max_params < 1:
            raise DataParallelError("DataParallel(bucket_max_params=...) must be None or >= 1.")
        if self.zero not in (0, 1, 2, 3):
            raise DataParallelError(
                f"DataParallel(zero={self.zero!r}): use 0 (off), 1 (optimizer state "
                "sharded), 2 (optimizer state and gradients sharded) or 3 (parameters too)."
            )
        if (self.shard_size is not None or not self.reshard_after_forward or self.prefetch != 1) and self.zero != 3:
            raise DataParallelError(
                "DataParallel(shard_size=, reshard_after_forward=, prefetch=) configure "
                "fully sharded data parallel: give zero=3 with them."
            )

        if self.loss_mean not in ("global", "per_rank"):
            raise DataParallelError(
                f"DataParallel(loss_mean={self.loss_mean!r}): 'global' (a mean over every rank's rows, the "
                "serial model's on the union of the batches) or 'per_rank' (each rank's own mean, as DDP)."
            )
        if not (isinstance(self.prefetch, int) and self.prefetch >= 0):
            raise DataParallelError(f"DataParallel(prefetch={self.prefetch!r}) must be an int >= 0.")
        for key in ("param_dtype", "output_dtype"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise DataParallelError(f"DataParallel({key}={value!r}) must be a floating torch dtype or None.")
        if self.local_sgd_every is not None and (not isinstance(self.local_sgd_every, int) or self.local_sgd_every < 1):
            raise DataParallelError(
                f"DataParallel(local_sgd_every={self.local_sgd_every!r}) must be None "
                "or a positive number of optimizer steps."
            )
        if self.zero and self.local_sgd_every is not None:
            raise DataParallelError(
                "DataParallel: zero and local_sgd_every exclude each other (local SGD "
                "steps every rank on its own full optimizer state); pick one."
            )
        if self.reduce_dtype is not None and not (
            isinstance(self.reduce_dtype, torch.dtype) and self.reduce_dtype.is_floating_point
        ):
            raise DataParallelError(
                f"DataParallel(reduce_dtype={self.reduce_dtype!r}) must be a floating "
                "torch dtype such as torch.bfloat16, or None."
            )

    def _check_shard_axes(self) -> None:
        axes = self.shard_axes
        if not axes or not all(isinstance(a, str) for a in axes) or len(set(axes)) != len(axes):
            raise DataParallelError(
                f"DataParallel(shard_axes={axes!r}): a tuple of distinct mesh axis names, the data-parallel "
                "axis first, e.g. shard_axes=('dp', 'cp')."
            )
        if self.zero not in (1, 2, 3):
            raise DataParallelError(
                f"DataParallel(shard_axes={axes!r}) says over which ranks ZeRO shards its state: give zero=1, 2 "
                "or 3 with it."
            )
        if self.axis is not None and axes[0] != self.axis:
            raise DataParallelError(
                f"DataParallel({self.axis!r}, shard_axes={axes!r}): the data-parallel axis comes first "
                f"(shard_axes=({self.axis!r}, {', '.join(repr(a) for a in axes if a != self.axis)})), as torchtitan's "
                "dp_shard_cp: a shard group's ranks in dp-major order."
            )
        if self.axis is None and (self.shard_size is not None or self.replicate_axis is not None):
            raise DataParallelError(
                "DataParallel(shard_size=, replicate_axis=) split the data-parallel axis: give the axis "
                f"(DataParallel('dp', ..., shard_axes=('dp', {', '.join(repr(a) for a in axes)})))."
            )

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    @property
    def first_bucket_bytes(self) -> int:
        return int(min(self.first_bucket_mb, self.bucket_mb) * 2**20)

    @classmethod
    def of(cls, value) -> "DataParallel | None":
        """Normalise ap.plan's ``data_parallel=``: None, an axis name, or a DataParallel."""
        if value is None or isinstance(value, DataParallel):
            return value
        if isinstance(value, str):
            return cls(value)
        raise DataParallelError(f"data_parallel={value!r}: give a mesh axis name ('dp') or ap.DataParallel('dp', ...).")

    def __str__(self) -> str:
        parts = [repr(self.axis), f"bucket_mb={self.bucket_mb:g}"]
        if self.bucket_max_params is not None:
            parts.append(f"bucket_max_params={self.bucket_max_params}")
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.local_sgd_every is not None:
            parts.append(f"local_sgd_every={self.local_sgd_every}")
        if self.reduce_dtype is not None:
            parts.append(f"reduce_dtype={self.reduce_dtype}")
        if self.first_bucket_mb != DEFAULT_FIRST_BUCKET_MB:
            parts.append(f"first_bucket_mb={self.first_bucket_mb:g}")
        for key, default in (
            ("reshard_after_forward", True),
            ("prefetch", 1),
            ("shard_size", None),
            ("replicate_axis", None),
            ("param_dtype", None),
            ("output_dtype", None),
            ("broadcast_buffers", True),
            ("loss_mean", "global"),
            ("shard_axes", None),
        ):
            if getattr(self, key) != default:
                parts.append(f"{key}={getattr(self, key)}")
        return f"DataParallel({', '.join(parts)})"

    # ------------------------------------------------------- the technique (technique.py)
    def validate(self, mesh, options, annotations: dict) -> None:
        if self.axis is not None:
            n = mesh.shape[mesh.axis_index(self.axis)]
            if self.shard_size is not None and (self.shard_size < 1 or n % self.shard_size):
                raise DataParallelError(
                    f"DataParallel(shard_size={self.shard_size}) must divide the size of "
                    f"the data-parallel axis {self.axis!r} ({n})."
                )
        if self.shard_axes is not None:
            self._validate_shard_axes(mesh, options)

    def _validate_shard_axes(self, mesh, options) -> None:
        """The folded axes: adjacent in mesh order (the groups torchtitan's flattened dp_shard_cp
        mesh has, and Mesh.merge_axes would form) and each an axis whose tokens a technique splits
        (its parameters replicated there, their gradients in parts), not one that splits them."""
        idx = [mesh.axis_index(a) for a in self.shard_axes]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise DataParallelError(
                f"DataParallel(shard_axes={self.shard_axes!r}) on {mesh}: the axes must be adjacent, in mesh "
                f"order (e.g. Mesh((dp, cp, tp), ('dp', 'cp', 'tp')) with shard_axes=('dp', 'cp')): the shard "
                "groups torchtitan's flattened dp_shard_cp mesh has. Reorder the mesh's axes."
            )
        if options.auto is not None:
            return  # the search chooses what splits the tokens (context parallel on the folded axis): checked after it
        split = {a for t in options.techniques if t is not self for a in t.token_axes()}
        for a in self.shard_axes:
            if a != self.axis and a not in split:
                raise DataParallelError(
                    f"DataParallel(shard_axes={self.shard_axes!r}): axis {a!r} splits no tokens (no technique "
                    "splits the batch or the sequence on it): its ranks hold other pieces of the parameters, or "
                    "compute the same gradients, so they cannot share one ZeRO shard group. Fold in the axis "
                    f"context parallel splits the sequence on (context_parallel={a!r}), or leave shard_axes out."
                )

    def data_axis(self) -> str | None:
        return self.axis

    def token_axes(self) -> tuple:
        return (self.axis,) if self.axis is not None else ()

    def loss_mean_on(self, axis: str) -> str | None:
        return self.loss_mean if self.axis is not None and axis == self.axis else None

    def shard_group_axes(self, mesh) -> tuple[int, ...]:
        """The mesh axes (indices) ZeRO shards over: ``shard_axes``, or the data-parallel axis."""
        names = self.shard_axes or ((self.axis,) if self.axis is not None else ())
        return tuple(mesh.axis_index(a) for a in names)

    def fold_axes(self, mesh) -> tuple[int, ...]:
        """The mesh axes (indices) ``shard_axes`` folds into ZeRO's shard group besides the
        data-parallel axis (context parallel's): () when not folded.

        Example: ``ap.DataParallel("dp", zero=3, shard_axes=("dp", "cp")).fold_axes(mesh)`` -> (1,)
        """
        dp = mesh.axis_index(self.axis) if self.axis is not None else None
        return tuple(a for a in self.shard_group_axes(mesh) if a != dp) if self.shard_axes else ()

    def group_axes(self, mesh, axes: tuple) -> tuple[int, ...]:
        """Of a gradient bucket summed over mesh axes ``axes``, those this technique's options
        reduce, as one group: every shard axis where the bucket sums over them all (ZeRO-1/2 over
        dp x cp), else the data-parallel axis, else none (the gradient sync's other axes)."""
        fold = self.shard_group_axes(mesh)
        if self.zero in (1, 2) and fold and set(fold) <= set(axes):
            return fold
        dp = mesh.axis_index(self.axis) if self.axis is not None else None
        return (dp,) if dp is not None and dp in axes else ()

    def reshape_mesh(self, mesh):
        """HSDP over two mesh axes (``replicate_axis`` right before ``axis``, torchtitan's
        dp_replicate, dp_shard): the batch is split over both, which the layouts express on one
        axis, so the two become one data-parallel axis sharded in groups of ``axis``'s size
        (``shard_size``): the same ranks, shard groups and replica groups."""
        if self.replicate_axis is None:
            return mesh, self
        merged = mesh.merge_axes(self.replicate_axis, self.axis)
        name = f"{self.replicate_axis}_{self.axis}"
        size = (self.shard_size or mesh.axis_size(self.axis)) if self.zero == 3 else None
        folded = None if self.shard_axes is None else tuple(name if a == self.axis else a for a in self.shard_axes)
        return merged, dataclasses.replace(self, axis=name, replicate_axis=None, shard_size=size, shard_axes=folded)

    def attach(self, plan, module, rank: int) -> None:
        """The broadcast of written buffers (buffer_sync.py), the storage's run-time half (zero=3's
        gathers) and local SGD's parameter averaging (the gradient buckets are attached for every plan)."""
        buffer_sync.attach(plan, module, rank)
        self.storage.attach(plan, module, rank)
        if self.local_sgd_every is not None and hasattr(module, "autopar_grad_sync"):
            module.autopar_local_sgd = LocalSGD(module.autopar_grad_sync, self.local_sgd_every)

    def bucket_comms(self, numel, dtype: torch.dtype, n) -> list[tuple]:
        """(kind, phase, bytes per rank) of one gradient bucket on this axis of size ``n``."""
        if self.local_sgd_every is not None:
            return []  # parameters averaged every k steps instead
        return self.storage.bucket_comms(self, n, numel * (self.reduce_dtype or dtype).itemsize, numel * dtype.itemsize)

    def memory_divisors(self, n, fold=1):
        """A rank keeps 1/d of the parameters, gradients and optimizer state it computes with:
        (d_params, d_grads, d_optimizer) on a dp axis of size ``n`` (numbers or sympy symbols),
        as the storage policy of ``zero`` keeps them; the cost model's and the search's. ``fold``:
        the size of the other axes of ``shard_axes`` (cp), which the state is sharded over too."""
        return self.storage.memory_divisors(self, n, fold)

    def exact(self) -> "DataParallel | None":
        """These options with fp32 gradient sums (what Plan.check compares with serial): ZeRO-1/2,
        local SGD, a reduce dtype and a precision policy change what the optimizer gets, not the
        layouts. zero=3 stays (with its sharding, prefetch and resharding): its gathers and
        reduce-scatters are exact in fp32, and its stored pieces merge into the full gradients, so
        check runs the program that trains. None: ZeRO-1/2 over context-parallel ranks alone, whose
        exact variant has no data parallel left."""
        keep = self.storage.exact_level == self.zero
        if not keep and self.axis is None:
            return None  # ZeRO-1/2 over context-parallel ranks alone: as plain gradient sums, no data parallel
        return dataclasses.replace(
            self,
            zero=self.storage.exact_level,
            local_sgd_every=None,
            reduce_dtype=None,
            reshard_after_forward=self.reshard_after_forward if keep else True,
            prefetch=self.prefetch if keep else 1,
            shard_size=self.shard_size if keep else None,
            shard_axes=self.shard_axes if keep else None,
            param_dtype=None,
            output_dtype=None,
        )

    # what the storage policy decides (parallel/data_parallel/storage.py)
    def stored(self, plan, rank, fqn, local):
        return self.storage.stored(plan, rank, fqn, local)

    def stored_start(self, plan, rank, fqn):
        return self.storage.stored_start(plan, rank, fqn)

    def stored_axes(self, plan, fqn: str) -> tuple:
        return self.storage.stored_axes(plan, fqn)

    def stored_share(self, plan, fqn: str) -> int:
        return self.storage.stored_share(plan, fqn)

    def counts_stored(self, plan, rank, fqn) -> bool:
        return self.storage.counts_stored(plan, rank, fqn)

    def restored(self, plan, per_rank):
        return self.storage.restored(plan, per_rank)

    def rewrite_program(self, plan, graph) -> None:
        # the program was traced in param_dtype (parallel/data_parallel/precision.py): it needs the casts only
        self.storage.rewrite_program(plan, graph)  # zero=3's gathers, in param_dtype
        cast_program(plan, graph, self.param_dtype, self.output_dtype)

    def grad_sync_axes(self, plan, axes):
        return self.storage.grad_sync_axes(plan, axes)

    def grad_order(self, plan, order):
        return self.storage.grad_order(plan, order)

    def grad_pieces(self, plan, module, rank, pieces):
        return self.storage.grad_pieces(plan, module, rank, pieces)

    def grad_shards(self):
        return self.storage.grad_shards()

    def keeps_state(self) -> bool:
        return True

    def keeps_gathered(self) -> bool:
        return self.storage.gathers_params and not self.reshard_after_forward

    def gather_axes(self, plan) -> tuple:
        return self.shard_group_axes(plan.mesh) if self.storage.gathers_params else ()

    def weight_shards(self, plan) -> tuple | None:
        if not self.storage.gathers_params or plan.dp_axis is None:
            return None
        return plan.dp_axis, self.shard_size or plan.mesh.shape[plan.dp_axis]

    def wired_gathers(self, plan, graph) -> list:
        """zero=3's gathers (fsdp_gather nodes) of the buckets a technique's wire gathers."""
        return [n for n in graph.nodes if n.target is fsdp_gather and buckets_cached(plan)[n.args[1]].wire is not None]

    def wired_params(self, plan, rank: int) -> list[str]:
        if not self.storage.gathers_params:
            return []
        return [n for b in held_buckets(plan, rank) if b.wire is not None for n in b.names]

    def synced_buffers(self, plan) -> list[str]:
        return buffer_sync.written_buffers(plan)

    def explain_param(self, plan, fqn):
        return self.storage.explain_param(plan, fqn)

    def memory(self, plan, rank, state_slots, mem):
        return self.storage.memory(plan, rank, state_slots, mem)

    def memory_formulas(self, plan, symbols, terms, rank: int = 0):
        """ZeRO keeps 1/dp (HSDP: 1/shard_size) of what its level shards; zero=3 adds the blocks
        gathered at once and one bucket's reduce buffers (``gathered``)."""
        n = symbols.axes[plan.dp_axis] if plan.dp_axis is not None else 1
        fold = sympy.Mul(*(symbols.axes[a] for a in self.shard_group_axes(plan.mesh) if a != plan.dp_axis))
        divisors = self.memory_divisors(n, fold)
        out = dict(terms)
        for key, d in zip(("params", "grads", "optimizer"), divisors):
            out[key] = terms[key] / d
        return self.storage.memory_formulas(plan, symbols, out, rank)

    def collectives(self, plan, symbols) -> list:
        return self.storage.collectives(plan, symbols)

    def rank_collectives(self, plan, rank, comms, passes) -> list:
        return self.storage.rank_collectives(plan, rank, comms, passes)

    def process_groups(self, plan) -> list:
        return self.storage.process_groups(plan)

    # ------------------------------------------------------- what a Plan offers (plan.<name>)
    plan_methods = ("with_data_parallel", "grad_buckets", "memory_per_rank", "peak_memory_rank", "zero_optimizer")

    @staticmethod
    def with_data_parallel(plan, data_parallel):
        """The same plan (same trace and layouts) with other DataParallel options on the same axis.

        Example: ``plan.with_data_parallel(ap.DataParallel("dp", zero=2)).module(rank)``
        """
        return plan.with_options(plan.options.replace(data_parallel=data_parallel))

    @staticmethod
    def grad_buckets(plan, rank: int = 0, stored: dict | None = None) -> list:
        """The fused gradient buckets of ``rank``, in the order every rank of its group launches them
        (``stored``: of the pieces its module holds, ``parallel.param_names.stored_pieces(plan, rank)``)."""
        return dp_module.grad_buckets(plan, rank, stored)

    @staticmethod
    def memory_per_rank(plan, rank: int = 0, state_slots: int = 2) -> dict:
        """Bytes ``rank`` holds at its step's peak, by part (dp_module.RankMemory: parameters,
        gradients, optimizer state as ZeRO keeps them, activations as the techniques keep them);
        their sum is what plan.cost(rank=rank) and ap.predict (of the peak rank) say."""
        return dp_module.memory_per_rank(plan, rank, state_slots)

    @staticmethod
    def peak_memory_rank(plan, state_slots: int = 2) -> int:
        """The rank that holds the most at its step's peak (plan.cost()'s and ap.predict's)."""
        return dp_module.peak_memory_rank(plan, state_slots)

    @staticmethod
    def zero_optimizer(plan, module, optimizer_class, **kwargs):
        """ap.ZeroOptimizer(module, optimizer_class, **kwargs) for a module of this plan (zero=1|2)."""
        return ZeroOptimizer(module, optimizer_class, **kwargs)

    _DTYPES = ("reduce_dtype", "param_dtype", "output_dtype")

    def fields(self) -> dict:
        out = super().fields()
        for key in self._DTYPES:
            if out[key] is not None:
                out[key] = str(out[key]).removeprefix("torch.")
        return out

    @classmethod
    def from_fields(cls, fields: dict) -> "DataParallel":
        fields = dict(fields)
        for key in cls._DTYPES:
            if fields.get(key) is not None:
                fields[key] = getattr(torch, fields[key])
        return cls(**fields)

    # ---- the search's hooks (parallel/protocols/search.py): the storages it may pick on a structure
    search_roles = ("dp", "rep")  # the batch split; "rep": the axis right before dp, split over both

    @classmethod
    def search_space(cls, mesh, facts, auto, structure=None) -> list:
        """The DataParallel choices of ``structure`` (None where it has neither a dp axis nor a
        fold): ZeRO's allowed levels (the user's when given; ``ap.Auto(zero=...)``, or
        ``choices={"data_parallel": levels}``), zero=3 over two axes both as HSDP and sharded over
        both, and ZeRO folded over dp x cp where the structure's cp axis allows it (``search_storages``).

        Example: on (2, 2) with {0: "dp", 1: "tp"}, levels (0, 3) ->
        [DataParallel('a', zero=0), DataParallel('a', zero=3)]"""
        user = facts.user.get(cls.name)
        base = user or cls(mesh.axis_names[0], **facts.precision)
        return [cls._search_choice(mesh, base, structure, *s) for s in cls.search_storages(structure, mesh, user, auto)]

    @classmethod
    def search_probe(cls, mesh, structure) -> "DataParallel | None":
        """The data parallel the search's probes plan ``structure``'s layouts with: ZeRO 0 over its
        dp axes (the levels are options of the same layouts, costed from the probe's terms)."""
        return cls._search_choice(mesh, cls(mesh.axis_names[0]), structure, 0, None)

    @classmethod
    def search_may_fold(cls, mesh, facts, auto) -> bool:
        """Whether a structure with a cp axis may have ZeRO folded over it (its state sharded over
        more ranks: the search's bound on what such a structure holds)."""
        return any(z for z, _, fold in cls.search_storages(None, mesh, facts.user.get(cls.name), auto) if fold)

    @classmethod
    def search_storages(cls, s, mesh, user, auto) -> list[tuple]:
        """(zero, shard_size, fold) the search may pick for structure ``s`` (None: any structure
        that can fold): the allowed ZeRO levels (the user's when given); zero=3 over two axes both
        as HSDP (sharded on the inner axis, replicated on the outer) and sharded over both; and,
        where ``s`` has a cp axis ZeRO may fold in (``s.can_fold()``), each level >= 1 also over
        dp x cp (over cp alone without a dp axis): the state sharded over more ranks, its sync one
        group over both instead of dp's and cp's apart. The user's ``shard_axes`` folds only; a
        user's level without them does not fold (the user chose the storage)."""
        levels = auto.choices_for(cls.name, auto.zero)
        zeros = (user.zero,) if user is not None and user.zero else (tuple(levels) or (0,))
        user_fold = user is not None and user.shard_axes is not None
        folds = (True,) if user_fold else (False, True) if user is None or not user.zero else (False,)
        can_fold = s is None or s.can_fold()
        out = []
        for fold in folds:
            if fold and not can_fold:
                continue
            if s is not None and s.dp is None:  # no data parallel: ZeRO only folded over cp
                out += [(z, None, True) for z in zeros if z and fold] if fold else [(0, None, False)]
                continue
            for z in zeros:
                if fold and not z:
                    continue  # folding shards ZeRO's state: no level, nothing to fold
                if STORAGE[z].gathers_params and s is not None and s.rep is not None:
                    shards = (
                        (user.shard_size,)
                        if user is not None and user.shard_size
                        else (mesh.shape[s.dp], mesh.shape[s.dp] * mesh.shape[s.rep])
                    )
                    out += [(z, k, fold) for k in shards]
                else:
                    out.append((z, user.shard_size if user is not None and STORAGE[z].gathers_params else None, fold))
        return out

    @staticmethod
    def _search_choice(mesh, base, s, zero: int, shard: int | None, fold: bool = False):
        """``base`` over structure ``s``'s dp axes at ``zero`` as a user writes it; ``fold``: ZeRO
        shards over the dp and cp axes together (``shard_axes``; over cp alone without a dp axis),
        torchtitan's dp_shard_cp. None where ``s`` has no dp axis and does not fold.

        Example: ({0: "dp", 1: "cp"}, zero 3, fold) -> DataParallel('dp', zero=3, shard_axes=('dp', 'cp'))"""
        if s.dp is None and not fold:
            return None
        axis = mesh.axis_names[s.dp] if s.dp is not None else None
        rep = mesh.axis_names[s.rep] if s.rep is not None else None
        folded = tuple(a for a in (axis, mesh.axis_names[s.cp]) if a is not None) if fold else None
        return dataclasses.replace(base, axis=axis, zero=zero, replicate_axis=rep, shard_size=shard, shard_axes=folded)

    def search_label(self, mesh, structure) -> str:
        """ ", ZeRO-3", with " sharded over both" / " HSDP" over two axes, " folded over dp*cp"."""
        label = f", ZeRO-{self.zero}"
        if self.shard_size is not None and self.replicate_axis is not None:
            both = mesh.axis_size(self.axis) * mesh.axis_size(self.replicate_axis)
            label += " sharded over both" if self.shard_size == both else " HSDP"
        if self.shard_axes is not None:  # ZeRO's shard group over dp x cp (torchtitan's dp_shard_cp)
            label += " folded over " + "*".join(self.shard_axes)
        return label

    def gathers_weights(self) -> bool:
        return self.storage.gathers_params

    def wire_params(self, plan, profile) -> set:
        """Names of the parameters this plan's zero=3 gathers in a technique's own form (its gather
        wire: ap.Float8(fp8_all_gather=True)); where the plan has none yet, those a technique priced
        under ``profile`` would (SearchHooks.priced_wire_params: the search prices float8 before its
        plan converts the Linears)."""
        wired = gather_wires(plan) if self.storage.gathers_params else {}
        if wired:
            canon = canonical_names(plan)
            return {n for n, _ in named_parameters(plan.model) if canon.get(n, n) in wired}
        return priced_wire_params(plan, profile)


def priced_wire_params(plan, profile) -> set:
    """Every registered technique's ``priced_wire_params`` (the plan need not have data parallel)."""
    return set().union(*(cls.priced_wire_params(plan, profile) for cls in TECHNIQUES.values()))
