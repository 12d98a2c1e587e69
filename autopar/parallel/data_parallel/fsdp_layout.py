"""Where fully sharded data parallel keeps each parameter: flat buckets and each rank's range.

The parameters of a bucket (one gathered unit, e.g. ``layers.3``) are laid end to end in one
flat vector (the rank's local, tensor-parallel piece of each); the flat is padded to a
multiple of the shard group size k and rank i of the group stores chunk i. The shard group spans
the data-parallel axis, or with ``DataParallel(shard_axes=("dp", "cp"))`` the dp x cp ranks
(dp-major: position dp * |cp| + cp), whose parameters are replicated alike. This file is the
arithmetic both halves of zero=3 share: the plan side (parallel/data_parallel/fsdp.py) and the run-time side
(parallel/data_parallel/fsdp_runtime.py).

Example:
    >>> b = buckets_cached(plan)[0]; b.key, b.names, b.chunk
    >>> stored_range(plan, rank=1, fqn="layers.0.fc1.weight")   # [a, b) of its flattened piece
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autopar.parallel.param_names import canonical_names, first_use_order, local_params

RUNTIME_ATTR = "autopar_fsdp"  # the rank module's FSDPRuntime (read by the program)


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
    kept: bool = False  # parameters a HF model keeps in fp32 (trace/in_dtype.kept_in_fp32): gathered so
    # a technique's own form on the wire (Technique.gather_wire: float8's fp8 weights with their
    # scales), or None: gathered in the compute dtype
    wire: object = None

    def compute_dtype(self, param_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype this bucket is computed in: the policy's ``param_dtype``, or its own where it
        holds kept-in-fp32 parameters (or no policy)."""
        return self.dtype if self.kept or param_dtype is None else param_dtype

    def gather_dtype(self, param_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype this bucket crosses the wire in: its wire's (float8: 1 byte), else the one it
        computes in."""
        return self.wire.dtype if self.wire is not None else self.compute_dtype(param_dtype)

    def grad_dtype(self, dp) -> torch.dtype:
        """The dtype its gradient is reduced in: ``reduce_dtype``, else the dtype it computes in."""
        return dp.reduce_dtype or self.compute_dtype(dp.param_dtype)

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


def buckets(plan) -> list[FlatBucket]:
    """The flat buckets of a zero=3 plan, in forward order: runs of consecutively first-used
    parameters of one block, dtype, program unit and precision (a HF keep-in-fp32 parameter's run
    is gathered in fp32; the embedding and the head are separate buckets; a pipeline stage's buckets hold only its parameters). A parameter the layouts split
    on the dp axis itself is left out: its pieces already differ per dp rank, and gathering
    them over dp would mix different pieces. One cut unevenly on another axis (a vocabulary of
    67 on tp=4: 17, 17, 17, 16 rows) is bucketed like any other: a shard group spans the dp
    ranks of one tp coordinate, whose pieces are equal, so only the sizes differ from one group
    to the next (``rank_buckets``). These are rank 0's sizes: the largest pieces."""
    return _buckets(plan, local_params(plan))


def rank_buckets(plan, rank: int) -> list[FlatBucket]:
    """``buckets_cached(plan)`` at ``rank``'s own local sizes: the same parameters in the same
    order, their offsets and chunk computed from the pieces this rank holds (they differ from
    rank 0's where another axis cuts a parameter unevenly; equal across a shard group)."""
    base = buckets_cached(plan)
    local = local_params(plan, rank)
    shapes = tuple(tuple(local[n].shape) for b in base for n in b.names)
    cache = plan.built.setdefault("fsdp_rank_buckets", {})
    if shapes not in cache:
        cache[shapes] = [
            _laid_out(b.key, b.names, [tuple(local[n].shape) for n in b.names], b.dtype, b.k, b.kept, b.wire)
            for b in base
        ]
    return cache[shapes]


def _laid_out(key, names, shapes, dtype, k, kept=False, wire=None) -> FlatBucket:
    offsets, numel = [], 0
    for shape in shapes:
        offsets.append(numel)
        numel += _numel(shape)
    return FlatBucket(key, list(names), list(shapes), offsets, numel, dtype, k, kept, wire)


def _buckets(plan, local) -> list[FlatBucket]:
    k, units, axes = shard_size(plan), program_units(plan), shard_axes(plan)
    kept = plan.traced.kept_fp32  # gathered in fp32: a bucket of their own
    wires = gather_wires(plan)  # gathered in a technique's form (float8's fp8 weights): a bucket of their own
    out: list[FlatBucket] = []
    last, run = None, {}  # run: the buckets of the current block by wire form (an fp8 weight, then a bias: two)
    for name in first_use_order(plan):
        if units.get(name, 0) is None:
            continue  # read by several programs (a weight tied across stages): stays whole
        spec = plan.param_specs.get(name)
        if spec is not None and not all(spec[a].is_replicate() for a in axes):
            continue  # already split on a shard axis (annotated so): each rank's piece differs, stays as is
        p = local[name]
        key = (units.get(name, 0), block_key(name), p.dtype, name in kept)
        if key != last:
            last, run = key, {}
        b = run.get(wires.get(name))
        if b is None:
            b = run[wires.get(name)] = FlatBucket(key[1], [], [], [], 0, p.dtype, k, key[3], wires.get(name))
            out.append(b)
        b.names.append(name)
        b.shapes.append(tuple(p.shape))
        b.offsets.append(b.numel)
        b.numel += p.numel()
    return out


def gather_wires(plan) -> dict:
    """Canonical parameter name -> the wire form a technique gathers it in (Technique.gather_wire)."""
    out: dict = {}
    for technique in plan.options.techniques:
        out.update(technique.gather_wire(plan))
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


def shard_axes(plan) -> tuple[int, ...]:
    """The mesh axes zero=3 shards over: the data-parallel axis and the context-parallel axes
    ``DataParallel(shard_axes=...)`` folds in (their ranks hold the same replicated parameters)."""
    return plan.data_parallel.shard_group_axes(plan.mesh)


def shard_size(plan) -> int:
    """The ranks of a shard group: HSDP's ``shard_size`` dp ranks (else the dp axis), times the
    sizes of the folded axes (every cp rank of each)."""
    mesh = plan.mesh
    n = mesh.shape[plan.dp_axis] if plan.dp_axis is not None else 1
    fold = math.prod(mesh.shape[a] for a in shard_axes(plan) if a != plan.dp_axis)
    return (plan.data_parallel.shard_size or n) * fold


def groups(plan, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shard group, replica group) of ``rank``: HSDP splits the dp group (dp x cp folded:
    dp-major) into groups of k consecutive ranks (shard) and the ranks at the same position in
    each (replica)."""
    axes = shard_axes(plan)
    dp_group, k = plan.mesh.group(axes[0] if len(axes) == 1 else axes, rank), shard_size(plan)
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
    b = rank_buckets(plan, rank)[where[0]]
    shard, _ = groups(plan, rank)
    lo, hi = b.piece(where[1], shard.index(rank))
    a = shard.index(rank) * b.chunk + lo - b.offsets[where[1]]
    return (a, a + (hi - lo)) if hi > lo else (0, 0)


def buckets_cached(plan) -> list[FlatBucket]:
    if "fsdp_buckets" not in plan.built:
        plan.built["fsdp_buckets"] = buckets(plan)
    return plan.built["fsdp_buckets"]
