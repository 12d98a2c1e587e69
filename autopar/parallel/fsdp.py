"""Fully sharded data parallel (ZeRO-3, HSDP) and mixed precision: ``ap.DataParallel(zero=3)``.

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
- Gather (parallel/fsdp_runtime.py, the run-time half): ``fsdp_gather(runtime, k, *pieces)`` all-gathers bucket k's chunks (in
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
- Mixed precision (any zero level): ``param_dtype`` computes with parameters cast from their
  fp32 pieces (zero=3: gathered in that dtype) and casts floating inputs to it;
  ``reduce_dtype`` is the gradient reduction's dtype; ``output_dtype`` casts the outputs.

Example:
    >>> dp = ap.DataParallel("dp", zero=3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    >>> plan = ap.plan(model, ap.Mesh((4,), ("dp",)), args=(x,), data_parallel=dp)
    >>> module = plan.module(rank); opt = torch.optim.AdamW(module.parameters())   # pieces
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.parallel.precision import retarget_dtypes

RUNTIME_ATTR = "autopar_fsdp"  # the rank module's FSDPRuntime (read by the program)


# ------------------------------------------------------------------------------ layout
@dataclass
class FlatBucket:
    """One gathered unit: parameters (canonical names) laid end to end, padded to k chunks."""

    key: str
    names: list[str]
    shapes: list[tuple]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    k: int

    @property
    def chunk(self) -> int:
        return -(-self.numel // self.k)

    def piece(self, i: int, pos: int) -> tuple[int, int]:
        """[lo, hi) of parameter ``i`` inside chunk ``pos`` (offsets within the chunk)."""
        lo, hi = pos * self.chunk, (pos + 1) * self.chunk
        a, b = max(self.offsets[i], lo), min(self.offsets[i] + _numel(self.shapes[i]), hi)
        return (a - lo, b - lo) if a < b else (0, 0)


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def block_key(name: str) -> str:
    """The block a parameter belongs to: its path up to the first numbered module
    (``layers.3.fc1.weight`` -> ``layers.3``), '' for parameters outside repeated blocks."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def canonical_names(plan) -> dict[str, str]:
    """Every parameter name -> the one name its tensor is stored under (tied weights share)."""
    out = {n: n for n, _ in plan.model.named_parameters(remove_duplicate=False)}
    for names in plan.traced.tied.values():
        out.update({n: names[0] for n in names})
    return out


def first_use_order(plan) -> list[str]:
    """Canonical parameter names in the order of their first use in the forward graph."""
    canon, seen, order = canonical_names(plan), set(), []
    nodes = list(plan.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    firsts = []
    for node in nodes:
        fqn = plan.traced.param_fqn.get(node.name) if node.op == "placeholder" else None
        if fqn is not None and node.users:
            firsts.append((min(pos[u] for u in node.users), canon.get(fqn, fqn)))
    for _, name in sorted(firsts):
        if name not in seen:
            seen.add(name)
            order.append(name)
    return order


def buckets(plan) -> list[FlatBucket]:
    """The flat buckets of a zero=3 plan, in forward order: runs of consecutively first-used
    parameters of one block, dtype and program unit (the embedding and the head are separate
    buckets; a pipeline stage's buckets hold only its parameters). A parameter the layouts split
    on the dp axis itself is left out: its pieces already differ per dp rank, and gathering
    them over dp would mix different pieces."""
    from autopar.parallel.dp_module import local_params

    local, k, units = local_params(plan), shard_size(plan), program_units(plan)
    out: list[FlatBucket] = []
    last = None
    for name in first_use_order(plan):
        if units.get(name, 0) is None:
            continue  # read by several programs (a weight tied across stages): stays whole
        spec = plan.param_specs.get(name)
        if spec is not None and not spec[plan.dp_axis].is_replicate():
            continue  # already split on the dp axis (annotated so): each rank's piece differs, stays as is
        p = local[name]
        key = (units.get(name, 0), block_key(name), p.dtype)
        if key != last:
            out.append(FlatBucket(key[1], [], [], [], 0, p.dtype, k))
            last = key
        b = out[-1]
        b.names.append(name)
        b.shapes.append(tuple(p.shape))
        b.offsets.append(b.numel)
        b.numel += p.numel()
    return out


def program_units(plan) -> dict[str, int | None]:
    """Canonical parameter name -> the program that reads it: the pipeline stage when the plan
    has one (None when several stages read it), else 0. A gathered bucket never spans two programs:
    each rank module gathers only the buckets of the parameters it holds."""
    lay = getattr(plan, "stage_layout", None)
    if lay is None:
        return {}
    canon, out = canonical_names(plan), {}
    for st in lay.stages:
        for ph in st.attrs:
            fqn = plan.attr_name(ph)
            if fqn in canon:
                name = canon[fqn]
                out[name] = st.index if out.get(name, st.index) == st.index else None
    return out


def shard_size(plan) -> int:
    n = plan.mesh.shape[plan.dp_axis]
    return plan.data_parallel.shard_size or n


def groups(plan, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shard group, replica group) of ``rank``: HSDP splits the dp group into groups of k
    consecutive ranks (shard) and the ranks at the same position in each (replica)."""
    dp_group, k = plan.mesh.group(plan.dp_axis, rank), shard_size(plan)
    i = dp_group.index(rank)
    shard = dp_group[i - i % k : i - i % k + k]
    replica = dp_group[i % k :: k]
    return tuple(shard), tuple(replica)


def process_groups(plan) -> list[tuple[int, ...]]:
    """Every HSDP sub-group of every rank (ap.parallelize makes them on every rank in this order)."""
    out = []
    for rank in plan.mesh.ranks():
        for g in groups(plan, rank):
            if g not in out and len(g) > 1:
                out.append(g)
    return out


# ------------------------------------------------------------------------------ storage
def bucket_index(plan) -> dict[str, tuple[int, int]]:
    cached = plan.built.get("fsdp_index")
    if cached is None:
        cached = {n: (bi, i) for bi, b in enumerate(buckets(plan)) for i, n in enumerate(b.names)}
        plan.built["fsdp_index"] = cached
    return cached


def stored_range(plan, rank: int, fqn: str) -> tuple[int, int] | None:
    """[a, b) of ``rank``'s stored piece of parameter ``fqn`` in its flattened compute piece
    (None: stored whole, a parameter used nowhere in the graph); a == b for an empty piece."""
    canon = canonical_names(plan).get(fqn, fqn)
    where = bucket_index(plan).get(canon)
    if where is None:
        return None
    b = buckets_cached(plan)[where[0]]
    shard, _ = groups(plan, rank)
    lo, hi = b.piece(where[1], shard.index(rank))
    a = shard.index(rank) * b.chunk + lo - b.offsets[where[1]]
    return (a, a + (hi - lo)) if hi > lo else (0, 0)


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
    canon, index, bs = canonical_names(plan), bucket_index(plan), buckets_cached(plan)
    out = []
    for rank, state in enumerate(per_rank):
        shard, _ = groups(plan, rank)
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
            new[key] = torch.cat(parts).view(b.shapes[i]) if parts is not None else None
        out.append(new)
    return out


def buckets_cached(plan) -> list[FlatBucket]:
    if "fsdp_buckets" not in plan.built:
        plan.built["fsdp_buckets"] = buckets(plan)
    return plan.built["fsdp_buckets"]


def sync_axes(plan, axes: dict) -> dict:
    """The gradient sync's axes without dp for the parameters a gather reduces."""
    index, canon = bucket_index(plan), canonical_names(plan)
    out = {}
    for name, ax in axes.items():
        out[name] = tuple(a for a in ax if a != plan.dp_axis) if canon.get(name, name) in index else ax
    return out


# ------------------------------------------------------------------------------ program
def rewrite_program(plan, graph: fx.Graph) -> None:
    """Write the gathers (zero=3) and the precision casts into the emitted program."""
    dp = plan.data_parallel
    if dp.param_dtype is not None:  # the model's own dtype constants as it runs in param_dtype
        retarget_dtypes(plan, graph, dp.param_dtype)
    attrs = _param_attrs(plan, graph)
    if dp.zero == 3:
        _insert_gathers(plan, graph, attrs)  # gathered in param_dtype
    if dp.param_dtype is not None:
        # the parameters no gather casts: all without zero=3; with it those left whole (a weight
        # tied across pipeline stages, one used nowhere else)
        gathered = {n for n in attrs if n.users and all(u.target is _gather_op() for u in n.users)}
        for node in [n for n in attrs if n.users and n not in gathered]:
            _cast_uses(graph, node, dp.param_dtype, after=node)
    if dp.param_dtype is not None:
        for node in [n for n in graph.nodes if n.op == "placeholder"]:
            if node.meta.get("val") is None or node.meta["val"].dtype.is_floating_point:
                _cast_uses(graph, node, dp.param_dtype, after=node, floating_only=True)
    if dp.output_dtype is not None:
        out = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(out):
            cast = graph.call_function(cast_outputs, (out.args[0], dp.output_dtype))
        out.args = (cast,)


def _param_attrs(plan, graph) -> list[fx.Node]:
    names = set(canonical_names(plan))
    return [n for n in graph.nodes if n.op == "get_attr" and n.target in names and n.users]


def _cast_uses(graph, node, dtype, after, floating_only=False) -> None:
    with graph.inserting_after(after):
        cast = graph.call_function(cast_floating if floating_only else _to_dtype, (node, dtype))
    node.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)


def _to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def cast_floating(x, dtype):
    """``x`` in ``dtype`` if it is a floating tensor (an input: token ids stay integers)."""
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def cast_outputs(outs, dtype):
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda v: cast_floating(v, dtype), outs)


def _insert_gathers(plan, graph, attrs) -> None:
    """One gather per bucket, right before the first node that uses one of its parameters."""
    fsdp_gather = _gather_op()

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


def _gather_op():
    from autopar.parallel.fsdp_runtime import fsdp_gather  # (the run-time half imports this file)

    return fsdp_gather


# ------------------------------------------------------------------------------ the plan shows it
def _wire(plan, b: FlatBucket, dtype) -> int:
    return b.chunk * (dtype or b.dtype).itemsize


def read_in_backward(plan, b: FlatBucket) -> bool:
    """Whether backward reads bucket ``b``'s gathered parameters (then resharding after forward
    gathers it again): False only when every use is an embedding lookup, whose backward needs
    the indices alone (the runtime gathers again exactly the buckets a saved tensor lives in)."""
    canon, names = canonical_names(plan), set(b.names)
    for node in plan.graph.nodes:
        fqn = plan.traced.param_fqn.get(node.name) if node.op == "placeholder" else None
        if fqn is not None and canon.get(fqn, fqn) in names:
            if any(u.target is not torch.ops.aten.embedding.default for u in node.users):
                return True
    return False


def held_buckets(plan, rank: int) -> list[FlatBucket]:
    """The buckets ``rank`` gathers: all, or under a pipeline those of its stages' parameters."""
    from autopar.parallel.dp_module import held_params

    held = held_params(plan, rank)
    return [b for b in buckets_cached(plan) if all(n in held for n in b.names)]


def memory(plan, rank: int, state_slots: int, mem: dict) -> dict:
    """Memory per rank under zero=3: the stored pieces (1/k of each bucket), their gradients and
    optimizer state, plus ``gathered``: the most gathered bytes alive at once (the bucket in use
    and the ``prefetch`` next, in ``param_dtype``; all of them without resharding after forward).
    Under a pipeline, of the buckets of the rank's stages only."""
    dp, k = plan.data_parallel, shard_size(plan)
    from autopar.parallel.dp_module import held_params

    local, index = held_params(plan, rank), bucket_index(plan)
    bs = held_buckets(plan, rank)
    whole = sum(p.numel() * p.element_size() for n, p in local.items() if n not in index)
    whole_trainable = sum(p.numel() * p.element_size() for n, p in local.items() if n not in index and p.requires_grad)
    pieces = sum(b.chunk * b.dtype.itemsize for b in bs)
    trainable = sum(b.chunk * b.dtype.itemsize for b in bs if any(local[n].requires_grad for n in b.names))
    full = [b.chunk * k * (dp.param_dtype or b.dtype).itemsize for b in bs]
    window = 1 + dp.prefetch
    gathered = (
        sum(full)
        if not dp.reshard_after_forward
        else max((sum(full[i : i + window]) for i in range(len(full))), default=0)
    )
    # backward of one bucket: autograd's full gradients of it and the flat handed to the reduce-scatter
    grad_item = (dp.reduce_dtype or dp.param_dtype or torch.float32).itemsize
    reducing = max((b.chunk * k * ((dp.param_dtype or b.dtype).itemsize + grad_item) for b in bs), default=0)
    out = dict(mem)
    out.update(
        params=whole + pieces,
        grads=whole_trainable + trainable,
        optimizer_state=state_slots * (whole_trainable + trainable),
        gathered=gathered,
        reduce_buffers=reducing,
        params_unsharded=mem["params"],
        shard_size=k,
    )
    return out


def collectives(plan, sy) -> list:
    """Per bucket: its forward all-gather, backward all-gather (resharded after forward),
    backward reduce-scatter and, for HSDP, the all-reduce of the reduced piece across replicas."""
    import sympy
    from autopar.explore.step_collectives import _comm
    from autopar.sharding.redistribute import ring_bytes

    dp, k = plan.data_parallel, shard_size(plan)
    r = plan.mesh.shape[plan.dp_axis] // k
    axis = plan.mesh.axis_names[plan.dp_axis]
    out = []
    for i, b in enumerate(buckets_cached(plan)):
        where = (f"fsdp bucket {i} ({len(b.names)} params)", b.key)
        gather = sympy.Float(ring_bytes("all_gather", _wire(plan, b, dp.param_dtype), k))
        grad = _wire(plan, b, dp.reduce_dtype or dp.param_dtype)
        unit = f"{b.key or 'the ' + str(len(b.names)) + ' parameters outside blocks'}"
        why = {
            "gather": f"zero=3: each rank stores 1/{k} of {unit}; gathered right before its first use",
            "again": f"zero=3: {unit} was freed after its forward use (reshard_after_forward); backward reads it",
            "scatter": f"zero=3: {unit}'s gradient summed over {axis} and scattered into each rank's stored piece",
            "replicas": f"HSDP: the reduced pieces summed across the {r} replica groups of {axis}",
        }
        out.append(_comm(sy, "all_gather", axis, "forward", gather, *where, reason=why["gather"]))
        if dp.reshard_after_forward and read_in_backward(plan, b):
            out.append(_comm(sy, "all_gather", axis, "backward", gather, *where, reason=why["again"]))
        rs = sympy.Float(ring_bytes("reduce_scatter", grad * k, k))
        out.append(_comm(sy, "reduce_scatter", axis, "grad sync", rs, *where, reason=why["scatter"]))
        if r > 1:
            ar = sympy.Float(ring_bytes("all_reduce", grad, r))
            out.append(_comm(sy, "all_reduce", axis, "grad sync", ar, *where, reason=why["replicas"]))
    return out


def explain_param(plan, fqn: str) -> list[str]:
    """plan.explain's lines on how zero=3 stores parameter ``fqn`` and syncs its gradient."""
    where = bucket_index(plan).get(canonical_names(plan).get(fqn, fqn))
    if where is None:
        return ["stored as computed (zero=3 buckets the parameters the graph reads that are replicated on dp)"]
    b, k = buckets_cached(plan)[where[0]], shard_size(plan)
    axis = plan.mesh.axis_names[plan.dp_axis]
    ranges = []
    for rank in plan.mesh.group(plan.dp_axis, 0)[:k]:
        lo, hi = stored_range(plan, rank, fqn)
        ranges.append(f"rank {rank} [{lo}, {hi})" if hi > lo else f"rank {rank} nothing")
    return [
        f"stored (zero=3): a 1-D piece in flat bucket {where[0]} ({b.key or 'outside blocks'}, "
        f"{len(b.names)} parameters), elements of its flattened local piece: {', '.join(ranges)}",
        f"gathered on {axis} before the bucket's first use; its gradient reduce-scattered into the pieces"
        + (
            f", then all-reduced across {plan.mesh.shape[plan.dp_axis] // k} replica groups"
            if k < plan.mesh.shape[plan.dp_axis]
            else ""
        ),
    ]
