"""Which collectives turn one layout into another: pure planning, no torch.distributed.

    S(i) -> R     all_gather(i)          backward: the rank's slice
    P    -> R     all_reduce             backward: identity (avg: / n)
    P    -> S(j)  reduce_scatter(j)      backward: all_gather
    S(i) -> S(j)  all_to_all(i -> j)     backward: all_to_all(j -> i)
    R    -> S(j)  slice(j), local        backward: all_gather
    R    -> P     to_partial, local      backward: identity
Axes are handled in three passes (gathers, then reductions, then local slices) so that no
tensor dim is ever split by two axes at once.

Example:
    >>> plan_steps((Shard(0), Partial()), (Replicate(), Replicate()))
    [Step('all_gather', axis=0, dim=0), Step('all_reduce', axis=1, op='sum')]
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.placement import Partial, Replicate, Shard

R = Replicate()


@dataclass(frozen=True)
class Step:
    kind: str            # all_gather | all_reduce | reduce_scatter | all_to_all | slice | to_partial | partial_cast
    axis: int
    dim: int | None = None
    dim2: int | None = None   # all_to_all: the dim that becomes split
    op: str | None = None     # reduce op for partial kinds
    blocks: int = 1           # all_gather / slice of a blocked shard (Shard.blocks)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in (("dim", self.dim), ("dim2", self.dim2), ("op", self.op))
                        if v is not None)
        return f"Step({self.kind!r}, axis={self.axis}{extra})"

    @property
    def communicates(self) -> bool:
        return self.kind not in ("slice", "to_partial", "partial_cast")


def _dim_free(cur, axis: int, dim: int) -> bool:
    return not any(isinstance(p, Shard) and p.dim == dim for a, p in enumerate(cur) if a != axis)


def plan_steps(src, dst) -> list[Step]:
    """The collective steps from placements ``src`` to ``dst`` (one placement per axis)."""
    cur = list(src)
    steps: list[Step] = []
    for a, (s, d) in enumerate(zip(src, dst)):  # 1: shards that must go
        if isinstance(s, Shard) and s != d:
            plain = s.blocks == 1 and not (isinstance(d, Shard) and (d.blocks > 1 or d.dim == s.dim))
            if plain and isinstance(d, Shard) and _dim_free(cur, a, d.dim) and _dim_free(dst, a, d.dim):
                steps.append(Step("all_to_all", a, s.dim, d.dim))
                cur[a] = d
            else:
                steps.append(Step("all_gather", a, s.dim, blocks=s.blocks))
                cur[a] = R
    for a, d in enumerate(dst):  # 2: partial sums
        s = cur[a]
        if isinstance(s, Partial) and s != d:
            if isinstance(d, Shard) and d.blocks == 1 and _dim_free(cur, a, d.dim):
                steps.append(Step("reduce_scatter", a, d.dim, op=s.reduce_op))
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
                steps.append(Step("slice", a, d.dim, blocks=d.blocks))
            else:
                steps.append(Step("to_partial", a, op=d.reduce_op))
            cur[a] = d
    return steps


def step_bytes(step: Step, local_bytes: float, n: int) -> float:
    """Bytes each rank sends for ``step`` (ring algorithms), given its input's local bytes."""
    if not step.communicates or n == 1:
        return 0.0
    if step.kind == "all_gather":
        return (n - 1) * local_bytes
    if step.kind == "all_reduce":
        return 2 * (n - 1) / n * local_bytes
    return (n - 1) / n * local_bytes  # reduce_scatter, all_to_all


def backward_bytes(step: Step, local_bytes: float, n: int) -> float:
    """Bytes of the collective the step's backward runs (its gradient's dual)."""
    if n == 1:
        return 0.0
    if step.kind == "all_gather":       # backward slices the full gradient: free
        return 0.0
    if step.kind == "reduce_scatter":   # backward all-gathers the shard of the gradient
        return (n - 1) * local_bytes / n
    if step.kind == "all_to_all":
        return (n - 1) / n * local_bytes
    if step.kind == "slice":            # backward all-gathers the slice's gradient
        return (n - 1) * local_bytes / n
    return 0.0


def local_factor(placements, mesh, shape) -> int:
    """Product of the shard factors over all dims: global numel / local numel."""
    f = 1
    for p, n in zip(placements, mesh.shape):
        if isinstance(p, Shard):
            f *= n
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
        if st.kind in ("all_gather", "all_reduce"):
            cur[st.axis] = R
        elif st.kind in ("reduce_scatter", "slice"):
            cur[st.axis] = Shard(st.dim)
        elif st.kind == "all_to_all":
            cur[st.axis] = Shard(st.dim2)
        elif st.kind in ("to_partial", "partial_cast"):
            cur[st.axis] = Partial(st.op.split("->")[-1])
    return fwd, bwd
