"""Which collectives turn one layout into another: pure planning, no torch.distributed.

    S(i) -> R     all_gather(i)          backward: the rank's slice
    P    -> R     all_reduce             backward: identity (avg: / n)
    P    -> S(j)  reduce_scatter(j)      backward: all_gather
    S(i) -> S(j)  all_to_all(i -> j)     backward: all_to_all(j -> i)
    R    -> S(j)  slice(j), local        backward: all_gather
    R    -> P     to_partial, local      backward: identity
Axes are handled in three passes (gathers, then reductions, then local slices) so that no
tensor dim is ever split by two axes at once. A split whose pieces change order only
(``Shard.order``: S(i) -> S(i, zigzag)) is gathered in its order and cut in the other first.
A step joining or cutting ordered pieces says so (``order``, ``order2``), and runs as on
contiguous pieces with the dim permuted around it (placement.PIECE_ORDERS).

Example:
    >>> plan_steps((Shard(0), Partial()), (Replicate(), Replicate()))
    [Step('all_gather', axis=0, dim=0), Step('all_reduce', axis=1, op='sum')]
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.errors import ShardingError
from autopar.placement import Partial, Replicate, Shard
from autopar.runtime.ring import ring_bytes

R = Replicate()


@dataclass(frozen=True)
class Step:
    kind: str  # all_gather | all_reduce | reduce_scatter | all_to_all | slice | to_partial | partial_cast
    axis: int
    dim: int | None = None
    dim2: int | None = None  # all_to_all: the dim that becomes split
    op: str | None = None  # reduce op for partial kinds
    blocks: int = 1  # all_gather / slice of a blocked shard (Shard.blocks)
    # Shard.order of the pieces of ``dim`` the step joins (all_gather, all_to_all) or cuts (slice,
    # reduce_scatter); ``order2``: of the pieces of ``dim2`` an all_to_all cuts. None: contiguous.
    order: str | None = None
    order2: str | None = None

    def __repr__(self) -> str:
        pairs = (
            ("dim", self.dim),
            ("dim2", self.dim2),
            ("op", self.op),
            ("order", self.order),
            ("order2", self.order2),
        )
        extra = "".join(f", {k}={v}" for k, v in pairs if v is not None)
        return f"Step({self.kind!r}, axis={self.axis}{extra})"

    @property
    def communicates(self) -> bool:
        return STEP_KINDS[self.kind].communicates


def _dim_free(cur, axis: int, dim: int) -> bool:
    return not any(isinstance(p, Shard) and p.dim == dim for a, p in enumerate(cur) if a != axis)


def plan_steps(src, dst) -> list[Step]:
    """The collective steps from placements ``src`` to ``dst`` (one placement per axis)."""
    cur = list(src)
    steps: list[Step] = []
    for a, (s, d) in enumerate(zip(src, dst)):
        if s != d and any(isinstance(p, Shard) and p.grouped for p in (s, d)):
            raise ShardingError(
                f"no collective turns {s!r} into {d!r} on mesh axis {a}: a tensor split on a part of an "
                "axis (expert weights over one of two data-parallel axes) stays as its op uses it."
            )
    for a, (s, d) in enumerate(zip(src, dst)):  # 0: the same split, its pieces in another order
        if isinstance(s, Shard) and isinstance(d, Shard) and s != d and replace(s, order=d.order) == d:
            steps.append(Step("all_gather", a, s.dim, blocks=s.blocks, order=s.order))
            steps.append(Step("slice", a, d.dim, blocks=d.blocks, order=d.order))
            cur[a] = d
    for a, d in enumerate(dst):  # 1: shards that must go
        s = cur[a]
        if isinstance(s, Shard) and s != d:
            plain = s.blocks == 1 and not (isinstance(d, Shard) and (d.blocks > 1 or d.dim == s.dim))
            if plain and isinstance(d, Shard) and _dim_free(cur, a, d.dim) and _dim_free(dst, a, d.dim):
                steps.append(Step("all_to_all", a, s.dim, d.dim, order=s.order, order2=d.order))
                cur[a] = d
            else:
                steps.append(Step("all_gather", a, s.dim, blocks=s.blocks, order=s.order))
                cur[a] = R
    for a, d in enumerate(dst):  # 2: partial sums
        s = cur[a]
        if isinstance(s, Partial) and s != d:
            if isinstance(d, Shard) and d.blocks == 1 and _dim_free(cur, a, d.dim):
                steps.append(Step("reduce_scatter", a, d.dim, op=s.reduce_op, order=d.order))
                cur[a] = d
            elif isinstance(d, Partial):
                steps.append(Step("partial_cast", a, op=f"{s.reduce_op}->{d.reduce_op}"))
                cur[a] = d
            else:
                steps.append(Step("all_reduce", a, op=s.reduce_op))
                cur[a] = R
    for a, d in enumerate(dst):  # 3: local splits of replicated data
        if cur[a] == R and d != R:
            if isinstance(d, Shard):
                steps.append(Step("slice", a, d.dim, blocks=d.blocks, order=d.order))
            else:
                steps.append(Step("to_partial", a, op=d.reduce_op))
            cur[a] = d
    return steps


@dataclass(frozen=True)
class StepKind:
    """What one redistribution step is: whether it communicates, the collective its backward
    runs (None: local or identity), the emitted op (torch.ops.autopar) and where it leaves the
    axis's placement. The one table that emit, the cost model and explain read."""

    name: str
    op: str | None  # torch.ops.autopar.<op>; None: a local aten rescale
    communicates: bool
    backward: str | None
    backward_input: float = 1.0  # the backward collective's input, as a fraction of the step's input (1/n: a shard)

    def forward_bytes(self, local_bytes: float, n: int) -> float:
        return ring_bytes(self.name, local_bytes, n) if self.communicates else 0.0

    def backward_bytes(self, local_bytes: float, n: int) -> float:
        if self.backward is None or n == 1:
            return 0.0
        scale = 1.0 / n if self.backward_input < 1 else 1.0
        return ring_bytes(self.backward, local_bytes * scale, n)

    def op_args(self, step: "Step") -> tuple[tuple, tuple]:
        """(dims after the tensor, trailing arguments) of the emitted op for ``step``."""
        dims = {
            "all_gather": (step.dim,),
            "reduce_scatter": (step.dim,),
            "slice": (step.dim,),
            "all_to_all": (step.dim, step.dim2),
        }.get(self.name, ())
        return dims, ((step.op,) if self.name in ("all_reduce", "reduce_scatter", "to_partial") else ())

    def next_placement(self, step: "Step"):
        if self.name in ("all_gather", "all_reduce"):
            return R
        if self.name in ("reduce_scatter", "slice"):
            return Shard(step.dim, order=step.order)
        if self.name == "all_to_all":
            return Shard(step.dim2, order=step.order2)
        return Partial(step.op.split("->")[-1])  # to_partial, partial_cast


STEP_KINDS = {
    k.name: k
    for k in (
        StepKind("all_gather", "all_gather", True, None),  # backward: the rank's slice, free
        StepKind("all_reduce", "all_reduce", True, None),  # backward: identity
        StepKind("reduce_scatter", "reduce_scatter", True, "all_gather", backward_input=0),
        StepKind("all_to_all", "all_to_all", True, "all_to_all"),
        StepKind("slice", "shard", False, "all_gather", backward_input=0),
        StepKind("to_partial", "to_partial", False, None),
        StepKind("partial_cast", None, False, None),  # sum <-> avg: a local rescale
    )
}


def step_bytes(step: Step, local_bytes: float, n: int) -> float:
    """Bytes each rank sends for ``step`` (ring algorithms), given its input's local bytes."""
    return STEP_KINDS[step.kind].forward_bytes(local_bytes, n)


def backward_bytes(step: Step, local_bytes: float, n: int) -> float:
    """Bytes of the collective the step's backward runs (its gradient's dual)."""
    return STEP_KINDS[step.kind].backward_bytes(local_bytes, n)


def local_factor(placements, mesh, shape) -> int:
    """Product of the shard factors over all dims: global numel / local numel."""
    f = 1
    for p, n in zip(placements, mesh.shape):
        if isinstance(p, Shard):
            f *= p.pieces(n)
    return f


def steps_cost(steps: list[Step], src, mesh, global_bytes: float) -> tuple[float, float]:
    """(forward bytes, backward bytes) per rank for running ``steps`` from ``src``."""
    cur = list(src)
    fwd = bwd = 0.0
    for st in steps:
        local = global_bytes / local_factor(cur, mesh, None)
        n = mesh.shape[st.axis]
        fwd += step_bytes(st, local, n)
        bwd += backward_bytes(st, local, n)
        cur[st.axis] = STEP_KINDS[st.kind].next_placement(st)
    return fwd, bwd
