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
  its share of the FLOPs (the kept tensors per node are known to the probe's short graph only,
  not per stage: an approximation; plan.cost() has the exact figure).

Example:
    >>> shares(plan.stage_layout, plan.options.pipeline)   # {'time': 0.31, 'state': 0.27, 'acts': 0.2}
"""

from __future__ import annotations

from autopar.parallel.pipeline import schedules


def shares(layout, pipeline) -> dict:
    """{time, state, acts}: one rank's share of the unpipelined step under ``layout``'s stages."""
    pp, m, v, n = layout.pp, pipeline.microbatches, pipeline.chunks, layout.n_stages
    flops = [st.flops for st in layout.stages]
    params = [st.param_bytes for st in layout.stages]
    f = [x / sum(flops) for x in flops] if sum(flops) > 0 else [1.0 / n] * n
    p = [x / sum(params) for x in params] if sum(params) > 0 else [1.0 / n] * n
    plan = schedules.build(pipeline.kind, pp, m, v)

    def duration(a):
        return f[a.stage] / (3 * m) * (1 if a.kind == "F" else 2)

    slots = schedules.replay(plan, n, duration)
    span = max(s.end for rs in slots for s in rs) - min(s.start for rs in slots for s in rs)
    state = max(sum(p[s] for s in range(n) if layout.rank_of_stage(s) == r) for r in range(pp))
    acts = 0.0
    for actions in plan:
        held = 0.0
        for a in actions:
            held += f[a.stage] / m if a.kind == "F" else -f[a.stage] / m
            acts = max(acts, held)
    return {"time": span, "state": state, "acts": min(1.0, acts)}
