"""Fully sharded data parallel (ZeRO-3, HSDP): the storage policy of ``ap.DataParallel(zero=3)``.

In graph terms a parameter is *stored* split over the data-parallel ranks and *computed*
replicated on them: the emitted program gets, per block (a flat bucket of parameters, e.g.
``layers.3``), one gather op written right before the block's first use, whose backward
reduce-scatters the block's gradient straight into this rank's piece. The layouts the
planner chose do not change (parameters stay Replicate on dp for the computation); only the
storage and the program do.

- Storage: the parameters of a bucket are laid end to end in one flat vector (the rank's
  local, tensor-parallel piece of each); the flat is padded to a multiple of the shard group
  size k and rank i of the group stores chunk i. Each module parameter is the (1-D, possibly
  empty) piece of its parameter inside this rank's chunk, a view of one flat chunk buffer:
  a plain torch optimizer steps the pieces in place (every elementwise optimizer gives the
  unsharded result, as ZeRO-1/2 in zero.py), and the gather's input is the chunk itself.
- Gather (parallel/data_parallel/fsdp_runtime.py, the run-time half): ``fsdp_gather(runtime, k, *pieces)`` all-gathers bucket k's chunks (in
  ``param_dtype`` if given) and returns the bucket's parameters as views of the gathered flat.
  Before returning it starts the all-gathers of the next ``prefetch`` buckets, so they run
  while this block computes. Backward: one reduce-scatter over the shard group (in
  ``reduce_dtype``), then, for HSDP, one all-reduce of the chunk over the replica group.
- Freeing: ``reshard_after_forward=True`` packs every saved tensor that lives in a gathered
  flat as (bucket, view) (torch.autograd.graph.saved_tensors_hooks), so the gathered block is
  freed after its last forward use and gathered again in backward (the next backward bucket
  prefetched); False keeps the gathered blocks alive until backward.
- HSDP: ``shard_size=k`` shards each parameter over groups of k consecutive ranks of the dp
  axis and replicates it across the dp/k groups (reduce-scatter in the group, all-reduce
  across groups).
- Folded context parallel: ``shard_axes=("dp", "cp")`` makes the shard group the dp x cp ranks
  (fsdp_layout.groups): the gathers and the reduce-scatter run over it, and the cp axis' own
  gradient sum is dropped for the bucketed parameters (``sync_axes``), the reduce-scatter summing
  the cp parts as it sums the dp ones.
- Mixed precision: the gathers gather in ``param_dtype`` and reduce in ``reduce_dtype``; the
  other casts of the policy are parallel/data_parallel/precision.py's (any zero level).

The layout arithmetic (flat buckets, each rank's range) is fsdp_layout.py; the run-time half
(gathers, reduce-scatters, freeing) fsdp_runtime.py; this file is the plan's side, gathered in
``FullyShardedStorage``, the policy ``DataParallel(zero=3).storage`` is.

Example:
    >>> dp = ap.DataParallel("dp", zero=3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    >>> plan = ap.plan(model, ap.Mesh((4,), ("dp",)), args=(x,), data_parallel=dp)
    >>> module = plan.module(rank); opt = torch.optim.AdamW(module.parameters())   # pieces
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from autopar.cost import make_comm
from autopar.parallel.data_parallel import fsdp_runtime
from autopar.parallel.data_parallel.fsdp_layout import (
    RUNTIME_ATTR,
    FlatBucket,
    bucket_index,
    buckets_cached,
    rank_buckets,
    groups,
    process_groups,
    shard_axes,
    shard_size,
    stored_range,
)
from autopar.parallel.data_parallel.fsdp_runtime import fsdp_gather
from autopar.parallel.grad_buckets import bucket_sync
from autopar.parallel.param_names import canonical_names, held_params
from autopar.parallel.data_parallel.precision import param_attrs
from autopar.parallel.data_parallel.storage import Storage, accumulates
from autopar.runtime.ring import ring_bytes


# ------------------------------------------------------------------------------ storage
def stored_start(plan, rank: int, fqn: str) -> int | None:
    where = stored_range(plan, rank, fqn)
    return None if where is None else where[0]


def stored(plan, rank: int, fqn: str, local: torch.Tensor) -> torch.Tensor:
    """What ``rank`` stores of parameter ``fqn`` given its compute piece: its 1-D piece of the
    bucket's chunk (parameters used nowhere in the graph stay whole)."""
    where = stored_range(plan, rank, fqn)
    if where is None:
        return local
    a, b = where
    return local.reshape(-1)[a:b].clone() if b > a else local.new_zeros(0)


def restored(plan, per_rank: list[dict]) -> list[dict]:
    """Every rank's compute pieces from its stored pieces (inverse of ``stored`` over a shard
    group): the chunks of the group concatenated, cut to the bucket, split into parameters."""
    canon, index = canonical_names(plan), bucket_index(plan)
    out = []
    for rank, state in enumerate(per_rank):
        shard, _ = groups(plan, rank)
        bs = rank_buckets(plan, rank)  # the group's own sizes (a piece cut unevenly on another axis)
        new = dict(state)
        for key, value in state.items():
            where = index.get(canon.get(key, key))
            if where is None or value is None:
                continue
            b, i = bs[where[0]], where[1]
            parts = []
            for r in shard:
                lo, hi = b.piece(i, shard.index(r))
                piece = per_rank[r].get(key)
                if hi > lo and piece is None:  # a rank without this gradient: none merged
                    parts = None
                    break
                if hi > lo:
                    parts.append(piece.reshape(-1)[: hi - lo])
            if parts is not None and not parts:  # an empty piece everywhere (another rank's expert)
                parts = [value.reshape(-1)[:0]]
            new[key] = torch.cat(parts).view(b.shapes[i]) if parts is not None else None
        out.append(new)
    return out


def sync_axes(plan, axes: dict) -> dict:
    """The gradient sync's axes without the shard axes (dp, and cp folded in) for the parameters
    a gather reduces."""
    index, canon, folded = bucket_index(plan), canonical_names(plan), set(shard_axes(plan))
    out = {}
    for name, ax in axes.items():
        out[name] = tuple(a for a in ax if a not in folded) if canon.get(name, name) in index else ax
    return out


def grad_order(plan, order: list) -> list:
    """When the gradients reach the gradient sync (of ``order``, backward's): a gathered bucket's
    pieces all at once, when the bucket's last gradient in backward is made (its reduce-scatter
    sets them, fsdp_runtime.reduce), in the bucket's order; the others when backward makes them.
    The sync's buckets of a parameter synced on another axis (a norm weight under sequence
    parallelism, on tp) are made in this order: the one the sync records in its first backward."""
    index, canon = bucket_index(plan), canonical_names(plan)
    pos = {n: i for i, n in enumerate(order)}
    done: dict[int, int] = {}  # bucket -> the position of its last gradient in backward
    for n, i in pos.items():
        where = index.get(canon.get(n, n))
        if where is not None:
            done[where[0]] = max(done.get(where[0], i), i)

    def when(n):
        where = index.get(canon.get(n, n))
        return (pos[n], 0, 0) if where is None else (done[where[0]], 1, where[1])

    return sorted(order, key=when)


# ------------------------------------------------------------------------------ program
def insert_gathers(plan, graph: fx.Graph) -> None:
    """One gather per bucket, right before the first node that uses one of its parameters (in
    ``param_dtype``, so the precision policy's casts skip what a gather reads)."""
    attrs = param_attrs(plan, graph)
    canon, index, bs = canonical_names(plan), bucket_index(plan), buckets_cached(plan)
    by_bucket: dict[int, list[fx.Node]] = {}
    for node in attrs:
        where = index.get(canon[node.target])
        if where is not None:
            by_bucket.setdefault(where[0], []).append(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        runtime = graph.get_attr(RUNTIME_ATTR)
    for bi, nodes in sorted(by_bucket.items()):
        b = bs[bi]
        users = [u for n in nodes for u in n.users]
        at = min(users, key=order.__getitem__)
        # the bucket's pieces as the program reads them: one get_attr per canonical name
        pieces = {canon[n.target]: n for n in nodes}
        missing = [nm for nm in b.names if nm not in pieces]
        with graph.inserting_before(at):
            for nm in missing:
                pieces[nm] = graph.get_attr(nm)
            gather = graph.call_function(fsdp_gather, (runtime, bi, *[pieces[nm] for nm in b.names]))
            items = {nm: graph.call_function(_item, (gather, i)) for i, nm in enumerate(b.names)}
        for n in nodes:
            n.replace_all_uses_with(items[canon[n.target]], delete_user_cb=lambda u: u is not gather)


def _item(t, i):
    return t[i]


# ------------------------------------------------------------------------------ the plan shows it
def _as(fp32_bytes, dtype):
    """Bytes of fp32 parameters (the stored master copy) once cast to ``dtype`` for the wire."""
    return fp32_bytes if dtype is None else fp32_bytes * dtype.itemsize / 4


def _wire(plan, b: FlatBucket, dtype) -> int:
    return b.chunk * (dtype or b.dtype).itemsize


# ops whose backward keeps no operand: an embedding lookup needs the indices alone, an add or a
# subtraction nothing (a bucket of biases alone, beside float8's weights gathered in fp8)
NOT_KEPT = {torch.ops.aten.embedding.default, torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor}


def read_in_backward(plan, b: FlatBucket) -> bool:
    """Whether backward reads bucket ``b``'s gathered parameters (then resharding after forward
    gathers it again): False only when every use is one of ``NOT_KEPT`` (the runtime gathers
    again exactly the buckets a saved tensor lives in). Under activation checkpointing only the
    embedding's: a checkpointed region keeps its inputs, the gathered parameters among them."""
    canon, names = canonical_names(plan), set(b.names)
    recomputes = any(t.recomputed(plan) for t in plan.options.techniques)
    not_kept = {torch.ops.aten.embedding.default} if recomputes else NOT_KEPT
    for node in plan.graph.nodes:
        fqn = plan.traced.param_fqn.get(node.name) if node.op == "placeholder" else None
        if fqn is not None and canon.get(fqn, fqn) in names:
            if any(u.target not in not_kept for u in node.users):
                return True
    return False


def held_buckets(plan, rank: int) -> list[FlatBucket]:
    """The buckets ``rank`` gathers: all, or under a pipeline those of its stages' parameters."""
    held = held_params(plan, rank)
    return [b for b in rank_buckets(plan, rank) if all(n in held for n in b.names)]


def memory(plan, rank: int, state_slots: int, mem: dict) -> dict:
    """Memory per rank under zero=3: the stored pieces (1/k of each bucket), their gradients and
    optimizer state, plus ``gathered``: the most gathered bytes alive at once (the bucket in use
    and the ``prefetch`` next, in ``param_dtype``; all of them without resharding after forward).
    Under a pipeline, of the buckets of the rank's stages only."""
    k = shard_size(plan)
    local, index = held_params(plan, rank), bucket_index(plan)
    bs = held_buckets(plan, rank)
    whole = sum(p.numel() * p.element_size() for n, p in local.items() if n not in index)
    whole_trainable = sum(p.numel() * p.element_size() for n, p in local.items() if n not in index and p.requires_grad)
    pieces = sum(b.chunk * b.dtype.itemsize for b in bs)
    stepped = [b for b in bs if any(local[n].requires_grad for n in b.names)]
    trainable = sum(b.chunk * b.dtype.itemsize for b in stepped)
    gathered, reducing = held(plan, rank)
    out = dict(mem)
    out.update(
        params=whole + pieces,
        grads=whole_trainable + trainable,
        optimizer_state=state_slots * (whole_trainable + trainable),  # in the pieces' dtype
        gathered=gathered,
        reduce_buffers=reducing,
        accumulated=accumulated(plan, rank),
        params_unsharded=mem["params"],
        shard_size=k,
    )
    return out


def held(plan, rank: int) -> tuple[int, int]:
    """(gathered, reducing): the most gathered bytes alive at once (the bucket in use and the
    ``prefetch`` next, in ``param_dtype``; all of them without resharding after forward) and one
    bucket's backward buffers (autograd's full gradients and the flat handed to the reduce-scatter)."""
    dp, k, bs = plan.data_parallel, shard_size(plan), held_buckets(plan, rank)
    full = [b.chunk * k * b.gather_dtype(dp.param_dtype).itemsize for b in bs]
    window = 1 + dp.prefetch
    gathered = (
        sum(full)
        if not dp.reshard_after_forward
        else max((sum(full[i : i + window]) for i in range(len(full))), default=0)
    )
    reducing = max(
        (b.chunk * k * (b.compute_dtype(dp.param_dtype).itemsize + b.grad_dtype(dp).itemsize) for b in bs), default=0
    )
    return gathered, reducing


def accumulated(plan, rank: int) -> int:
    """Where the plan's techniques cut a rank's batch into pieces, each run backward on its own
    (a pipeline's micro-batches), the bytes of the unreduced gradient flats ``rank`` keeps
    whole until the last piece's backward (fsdp_runtime.FSDPRuntime.reduce under no_sync: one
    per bucket of its stages, in ``reduce_dtype``, else the gradients' dtype) beyond its
    gradient pieces (``grads``), as Storage.accumulated_bytes counts it: the phase rows add
    ``grads`` to a pipeline's backward (plan_cost.memory_rows' ``grads_in_backward``), where
    zero=3 holds the flats and no piece yet (the pieces are made by the last reduce-scatter;
    ``zero_grad`` freed the step's before). Measured: a 405B-width stage 0 (pp 8, dp 8, tp 8)
    peaked in its second micro-batch's backward with every flat and no gradient piece. 0 otherwise."""
    if not accumulates(plan):
        return 0
    dp, k = plan.data_parallel, shard_size(plan)
    local, bs = held_params(plan, rank), held_buckets(plan, rank)
    flats = sum(b.chunk * k * b.grad_dtype(dp).itemsize for b in bs)
    return flats - sum(b.chunk * b.dtype.itemsize for b in bs if any(local[n].requires_grad for n in b.names))


BUCKET = "fsdp bucket "  # how ``collectives`` names a bucket's comms: "fsdp bucket 3 (9 params)"


def collectives(plan, sy) -> list:
    """Per bucket: its forward all-gather, backward all-gather (resharded after forward),
    backward reduce-scatter and, for HSDP, the all-reduce of the reduced piece across replicas."""
    dp, k, axis = plan.data_parallel, shard_size(plan), group_label(plan)
    r = len(groups(plan, 0)[1])
    out = []
    for i, b in enumerate(buckets_cached(plan)):
        where = (f"{BUCKET}{i} ({len(b.names)} params)", b.key)
        gather = sympy.Float(ring_bytes("all_gather", _wire(plan, b, b.gather_dtype(dp.param_dtype)), k))
        grad = _wire(plan, b, b.grad_dtype(dp))
        unit = f"{b.key or 'the ' + str(len(b.names)) + ' parameters outside blocks'}"
        why = {
            "gather": f"zero=3: each rank stores 1/{k} of {unit}; gathered right before its first use",
            "again": f"zero=3: {unit} was freed after its forward use (reshard_after_forward); backward reads it",
            "scatter": f"zero=3: {unit}'s gradient summed over {axis} and scattered into each rank's stored piece",
            "replicas": f"HSDP: the reduced pieces summed across the {r} replica groups of {axis}",
        }
        out.append(make_comm(sy, "all_gather", axis, "forward", gather, *where, reason=why["gather"]))
        if dp.reshard_after_forward and read_in_backward(plan, b):
            out.append(make_comm(sy, "all_gather", axis, "backward", gather, *where, reason=why["again"]))
        rs = sympy.Float(ring_bytes("reduce_scatter", grad * k, k))
        out.append(make_comm(sy, "reduce_scatter", axis, "grad sync", rs, *where, reason=why["scatter"]))
        if r > 1:
            ar = sympy.Float(ring_bytes("all_reduce", grad, r))
            out.append(make_comm(sy, "all_reduce", axis, "grad sync", ar, *where, reason=why["replicas"]))
    return out


def rank_collectives(plan, rank: int, comms: list, passes: int) -> list:
    """Of ``comms``, the bucket collectives (``collectives``) ``rank`` runs in a step of ``passes``
    forward and backward passes: those of the buckets holding a parameter it holds (a pipeline
    rank: its stages'), reduced once a step, gathered every pass when resharded after forward."""
    held, buckets = held_params(plan, rank), buckets_cached(plan)
    out = []
    for c in comms:
        if c.node.startswith(BUCKET) and any(n in held for n in buckets[int(c.node[len(BUCKET) :].split()[0])].names):
            again = plan.data_parallel.reshard_after_forward and c.phase != "grad sync"
            out += [c] * (passes if again else 1)
    return out


def explain_param(plan, fqn: str) -> list[str]:
    """plan.explain's lines on how zero=3 stores parameter ``fqn`` and syncs its gradient."""
    where = bucket_index(plan).get(canonical_names(plan).get(fqn, fqn))
    if where is None:
        return ["stored as computed (zero=3 buckets the parameters the graph reads that are replicated on dp)"]
    b, axis = buckets_cached(plan)[where[0]], group_label(plan)
    shard, replica = groups(plan, 0)
    ranges = []
    for rank in shard:
        lo, hi = stored_range(plan, rank, fqn)
        ranges.append(f"rank {rank} [{lo}, {hi})" if hi > lo else f"rank {rank} nothing")
    return [
        f"stored (zero=3): a 1-D piece in flat bucket {where[0]} ({b.key or 'outside blocks'}, "
        f"{len(b.names)} parameters), elements of its flattened local piece: {', '.join(ranges)}",
        f"gathered on {axis} before the bucket's first use; its gradient reduce-scattered into the pieces"
        + (f", then all-reduced across {len(replica)} replica groups" if len(replica) > 1 else ""),
    ]


def group_label(plan) -> str:
    """The shard group's axes as the collectives name them: ``dp``, or ``dp*cp`` folded."""
    axes = shard_axes(plan)
    return plan.mesh.axis_label(axes if len(axes) > 1 else axes[0])


class FullyShardedStorage(Storage):
    """zero=3: the hooks of ``DataParallel`` that store, gather and reduce (see the module docstring)."""

    level = exact_level = 3  # plan.check runs the zero=3 program itself: its sums are exact in fp32
    gathers_params = True

    def stored(self, plan, rank, fqn, local):
        return stored(plan, rank, fqn, local)

    def stored_start(self, plan, rank, fqn):
        where = stored_range(plan, rank, fqn)
        return None if where is None else where[0]

    def stored_axes(self, plan, fqn: str) -> tuple:
        return shard_axes(plan) if canonical_names(plan).get(fqn, fqn) in bucket_index(plan) else ()

    def stored_share(self, plan, fqn: str) -> int:
        return shard_size(plan) if canonical_names(plan).get(fqn, fqn) in bucket_index(plan) else 1

    def counts_stored(self, plan, rank, fqn) -> bool:
        """HSDP: a piece is stored once per replica group; its first rank counts it."""
        return groups(plan, rank)[1][0] == rank

    def restored(self, plan, per_rank):
        return restored(plan, per_rank)

    def rewrite_program(self, plan, graph) -> None:
        insert_gathers(plan, graph)

    def grad_sync_axes(self, plan, axes):
        return sync_axes(plan, axes)

    def grad_order(self, plan, order):
        return grad_order(plan, order)

    def attach(self, plan, module, rank: int) -> None:
        fsdp_runtime.attach(plan, module, rank)

    def process_groups(self, plan) -> list:
        """HSDP's groups, and a folded dp x cp group: not one mesh axis' groups."""
        folded = len(shard_axes(plan)) > 1
        return process_groups(plan) if plan.data_parallel.shard_size is not None or folded else []

    def explain_param(self, plan, fqn):
        return explain_param(plan, fqn)

    def bucket_comms(self, dp, n, wire_bytes, param_bytes) -> list[tuple]:
        """A parameter no gather reads (split on dp, or used nowhere) is synced as plain data
        parallel; the gathered ones are reduced by their gathers (``collectives``)."""
        return bucket_sync(0, n, wire_bytes, param_bytes)

    def memory_divisors(self, dp, n, fold=1):
        k = (dp.shard_size or n) * fold
        return k, k, k

    def step_comms(self, dp, n, grad_bytes, param_bytes, units: float = 1.0, fold=1) -> list[tuple]:
        """The gathers of ``collectives`` (forward, and backward again when resharded; prefetched)
        and the reduce-scatter (+ HSDP's all-reduce across replicas), one of each per unit; over
        shard groups ``fold`` times larger where ``shard_axes`` folds cp in (the replicas as many)."""
        k = (dp.shard_size or n) * fold
        replicas = n // (dp.shard_size or n)
        gather = ring_bytes("all_gather", _as(param_bytes, dp.param_dtype) / k, k)
        ahead = dp.prefetch > 0
        out = [("all_gather", "forward", gather, ahead, units)]
        if dp.reshard_after_forward:
            out.append(("all_gather", "backward", gather, ahead, units))
        grad = _as(grad_bytes, dp.reduce_dtype or dp.param_dtype)
        out.append(("reduce_scatter", "grad sync", ring_bytes("reduce_scatter", grad, k), False, units))
        if replicas > 1:
            out.append(("all_reduce", "grad sync", ring_bytes("all_reduce", grad / k, replicas), False, units))
        return out

    def held_bytes(self, dp, n, largest_unit_bytes, plan=None) -> tuple[float, float]:
        """The block in use and the ``prefetch`` blocks gathered ahead of it, unsharded, and one
        block's reduce buffers: of ``plan``'s buckets where a plan is given, else estimated from
        the largest unit (fp32 bytes)."""
        if plan is not None:
            return held(plan, 0)
        grad = _as(largest_unit_bytes, dp.reduce_dtype or dp.param_dtype)
        unit = _as(largest_unit_bytes, dp.param_dtype)
        return (1 + dp.prefetch) * unit, unit + grad  # (without resharding every block stays: not estimated)

    def accumulated_bytes(self, dp, n, grad_bytes, grad_elems, plan=None) -> float:
        """The gathers' unreduced gradient flats, kept whole from a unit's first backward of the
        step to its last (FSDPRuntime.reduce under no_sync), in ``reduce_dtype`` (else the
        gradients' dtype), beyond the rank's 1/n gradient pieces (``accumulated``): of
        ``plan``'s buckets on rank 0 where given."""
        if plan is not None:
            return accumulated(plan, 0)
        dtype = dp.reduce_dtype or dp.param_dtype
        return (grad_elems * dtype.itemsize if dtype is not None else grad_bytes) - grad_bytes / n

    def memory(self, plan, rank, state_slots, mem):
        return memory(plan, rank, state_slots, mem)

    def memory_formulas(self, plan, symbols, terms, rank: int = 0):
        """Blocks gathered at once, one bucket's reduce buffers and, accumulating over a
        pipeline's micro-batches, the unreduced gradient flats: ``gathered``, as numbers (they
        depend on the buckets, not on the batch), ``rank``'s."""
        held = plan.memory_per_rank(rank)
        parts = ("gathered", "reduce_buffers", "accumulated")  # apart: they peak in different phases
        return dict(terms, **{k: sympy.Integer(held[k]) for k in parts})

    def collectives(self, plan, symbols) -> list:
        return collectives(plan, symbols)

    def rank_collectives(self, plan, rank, comms, passes) -> list:
        return rank_collectives(plan, rank, comms, passes)
