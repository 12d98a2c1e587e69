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


def shares(layout, pipeline) -> dict:
    """{time, state, acts}: one rank's share of the unpipelined step under ``layout``'s stages."""
    pp, m, v, n = layout.pp, pipeline.microbatches, pipeline.chunks, layout.n_stages
    f = _fractions([st.flops for st in layout.stages])
    p = _fractions([st.param_bytes for st in layout.stages])
    a = _fractions([getattr(st, "out_bytes", st.flops) for st in layout.stages])
    plan = schedules.build(pipeline.kind, pp, m, v)

    split = pipeline.kind in schedules.SPLIT_BACKWARD  # B then W: half the backward each

    def duration(a):
        return f[a.stage] / (3 * m) * (1 if a.kind == "F" or split else 2)

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


def _fractions(values: list) -> list[float]:
    """Each value's share of the sum (even shares when they are all 0)."""
    total = sum(values)
    return [v / total for v in values] if total > 0 else [1.0 / len(values)] * len(values)
