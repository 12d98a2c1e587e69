"""A pipeline rank's share of the unpipelined step, from its stages' own costs (the search's and
ap.predict's cost model; stage_memory.py is plan.cost()'s exact per-rank activations).

The runtime's cuts are uneven in layers (split.py balances 3 x FLOPs + parameter bytes, so the
stages holding the embedding and the LM head get fewer blocks), so each stage is costed from its
own nodes: ``f_s``, its share of the model's forward FLOPs, and ``p_s``, of the parameter bytes.

- time: the schedule replayed (schedules.replay) with stage s's forward of one micro-batch taking
  f_s / (3 m) of the unpipelined step and its backward 2 f_s / (3 m) (backward = 2 x forward, as
  evaluate.py counts compute); the step's span over 1 is the share. The slowest stage sets the
  pace, and the bubble is what the schedule leaves idle around it. With even stages this is the
  closed form (m v + pp - 1) / (m v pp).
  Under a zero-bubble schedule B and W are priced from a measurement, not as half a backward each:
  B is ``SPLIT_B`` and W ``SPLIT_W`` of the stage's plain backward (their sum over 1 is the split's
  cost: two autograd calls per micro-batch, W one per parameter group, the graph kept between),
  and a stage that receives no gradient-carrying value (the first) has an empty B and a W of
  ``FIRST_W`` (one autograd call from its outputs).
- state: the largest sum of p_s over the stages one rank holds (rank r: stages r, r + pp, ...).
- activations: the rank's actions walked (a forward adds its stage's share of one micro-batch,
  a backward frees it), the most held at once, with a stage's share of the activations taken as
  its share of the bytes its ops output (views left out; the tensors autograd keeps per node are
  known to the probe's short graph only, not per stage: an approximation; plan.memory_per_rank
  has the exact figure).

Example:
    >>> shares(plan.stage_layout, plan.options.pipeline)   # {'time': 0.31, 'state': 0.27, 'acts': 0.2}
"""

from __future__ import annotations

from autopar.parallel.pipeline import schedules

# B and W as shares of the stage's plain backward (one torch.autograd.backward), measured by
# ``python bench/bench_pipeline.py --split-cost`` (CPU time, one thread, median of 40 repeats, the
# bench's residual MLP blocks 256 x 1024, 2, 4 and 8 blocks of 32 rows and 2, 4 blocks of 128 rows;
# six runs, 2026-12-06, on the shared 2-vCPU machine): B 0.47-0.55 (median 0.51), W 0.57-0.79
# (0.63), B + W 1.03-1.28 (1.14), with no trend in size: a share of the backward, not a fixed
# cost (W's autograd call per parameter group, the graph kept between). A first stage (nothing
# received: B empty, W one autograd call from its outputs) 0.99-1.08 (1.04) of its plain backward
# (four of the runs).
# Measured on CPU only: the split on a GPU is unmeasured (there a plain backward already runs each
# matmul's two gradients as two kernels, so its share is expected nearer 1).
SPLIT_B, SPLIT_W, FIRST_W = 0.51, 0.63, 1.04


def split_backward(kind: str, receives: bool) -> float:
    """A zero-bubble stage's "B" or "W" as a share of its plain backward; ``receives``: the stage
    receives a value whose gradient B computes (else B is empty and W is all of it).

    Example:
        >>> split_backward("B", True), split_backward("W", False)
        (0.51, 1.04)
    """
    if kind == "B":
        return SPLIT_B if receives else 0.0
    return SPLIT_W if receives else FIRST_W


def shares(layout, pipeline) -> dict:
    """{time, state, acts}: one rank's share of the unpipelined step under ``layout``'s stages."""
    pp, m, v, n = layout.pp, pipeline.microbatches, pipeline.chunks, layout.n_stages
    f = _fractions([st.flops for st in layout.stages])
    p = _fractions([st.param_bytes for st in layout.stages])
    a = _fractions([getattr(st, "out_bytes", st.flops) for st in layout.stages])
    plan = schedules.build(pipeline.kind, pp, m, v)

    split = pipeline.kind in schedules.SPLIT_BACKWARD  # B then W: split_backward's shares
    if hasattr(layout, "kinds"):  # B computes the gradients of what a stage receives
        receives = [any(layout.kinds.get(name) == "grad" for name, _ in st.recv) for st in layout.stages]
    else:  # stages without their boundaries: all but the first receive
        receives = [s > 0 for s in range(n)]

    def duration(a):
        forward = f[a.stage] / (3 * m)
        if a.kind == "F":
            return forward
        return 2 * forward * (split_backward(a.kind, receives[a.stage]) if split else 1)

    slots = schedules.replay(plan, n, duration)
    span = max(s.end for rs in slots for s in rs) - min(s.start for rs in slots for s in rs)
    state = max(sum(p[s] for s in range(n) if layout.rank_of_stage(s) == r) for r in range(pp))
    acts = 0.0
    for actions in plan:
        held = 0.0
        for act in actions:
            if act.kind == "F" or act.kind == ("W" if split else "B"):
                held += a[act.stage] / m if act.kind == "F" else -a[act.stage] / m
            acts = max(acts, held)
    return {"time": span, "state": state, "acts": min(1.0, acts)}


def even_split_time(kind: str, pp: int, m: int) -> float:
    """The step's span over the unpipelined step under zero-bubble schedule ``kind`` with even
    stages (each 1/n of the model, the first receiving nothing), B and W at ``split_backward``'s
    shares: Pipeline.step_shares without a stage layout.

    Example:
        >>> round(even_split_time("zb-h1", 4, 8), 3)   # 1F1B's closed form: 11 / 32 = 0.344
        0.305
    """
    n = 2 * pp if kind in schedules.V_SHAPED else pp

    def duration(a):
        return 1 / (3 * m * n) * (1 if a.kind == "F" else 2 * split_backward(a.kind, a.stage > 0))

    slots = schedules.replay(schedules.build(kind, pp, m, n // pp), n, duration)
    return max(s.end for rs in slots for s in rs) - min(s.start for rs in slots for s in rs)


def _fractions(values: list) -> list[float]:
    """Each value's share of the sum (even shares when they are all 0)."""
    total = sum(values)
    return [v / total for v in values] if total > 0 else [1.0 / len(values)] * len(values)
