"""The MILP: one role per mesh axis, one ZeRO level, one layout per component, minimum step time.

Why a MILP (scipy.optimize.milp, i.e. HiGHS) and not a dynamic program over the layer chain:
the memory budget couples every layer (a knapsack), which a chain DP handles only by
discretising memory; HiGHS solves these few hundred binaries exactly in milliseconds and
ships with scipy (no extra solver binary, unlike PuLP/CBC or OR-Tools).

Variables, for every option ``g`` (a Structure plus a ZeRO level) and component ``c``:
- ``x_g`` in {0, 1}: the option is chosen; sum_g x_g = 1;
- ``w_gck`` in {0, 1}: component c takes choice k under g; sum_k w_gck = x_g (so w = 0
  unless g is chosen: the products "g and k" stay linear);
- ``e_g >= 0``: the exposed part of the gradient sync, e_g >= sync_g - overlap * hide_g
  (both linear in x and w), which is max(0, .) at the optimum; ``hide`` is the compute the
  sync can hide behind (backward's, or the whole step's when zero=3 prefetches its gathers);
- ``m >= 0``: the memory per rank, m >= each moment's row (the tie-break's second solve).

Objective: sum of the time coefficients (compute + activation collectives + ZeRO's gather) of
the chosen x and w, plus sum_g e_g. Memory: a coefficient per moment of a step
(plan_cost.PHASE_ROWS: forward's end, the loss's backward, a block's gathers in backward, the
optimizer step), each moment's sum <= budget: the peak is the largest moment, as
memory_per_rank(rank).peak counts it, and a max of sums is a set of linear rows. This is exact
for the cost model of evaluate.py given the components' additivity (candidates.py); the model's
own approximations are listed there.

Enumeration: the components are few (a model's distinct Megatron pairs and its vocabulary: 2-4,
each split or not), so each option has a handful of component combinations; where all options
together have at most ENUMERATE_LIMIT, ``solve`` costs every combination with numpy and keeps
the same optimum and tie-breaks as the MILP (tests/unit/test_search_solver.py compares them).
The search asks for one option's optimum once per option (explain's runners-up), and a MILP per
option was most of a 512-rank search's time.

Example:
    >>> best = solve(options, budget=8 * 2**30)
    >>> best.option, best.choices, best.time
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np


EXACT = {"mip_rel_gap": 1e-12}  # HiGHS stops at a 1e-4 gap by default; these problems are small
ENUMERATE_LIMIT = 200_000  # component combinations over all options costed directly (numpy)


@dataclass
class Option:
    """One x_g: its base coefficients and, per component, per choice, the same numbers."""

    label: object
    base: tuple  # (time, sync, hide, memory at each moment of the step, ...): one or more moments
    comps: dict  # component key -> {choice: (time, sync, hide, memory, ...)}
    idle: int = 0  # mesh axes (of size > 1) the option leaves replicated: their ranks repeat work
    idle_choice: dict = field(default_factory=dict)  # choice -> a fraction of an idle axis (R on a tp axis)
    # 1 where a plain torch.optim optimizer cannot step the plan (ZeRO-1/2: ap.ZeroOptimizer or
    # ap.Optimizer): on a tie in time, after the idle axes and before memory, the plain ones win,
    # so that a user's loop keeps working unless the budget needs the sharded state
    wrapped: int = 0


@dataclass
class Solution:
    option: object
    choices: dict
    time: float
    memory: float
    status: str
    row: int = 0  # the moment of the step whose memory is the largest (memory's)


def memory_rows(opt: Option, picked: tuple) -> tuple:
    """The memory at each moment of option ``opt`` with its components' choices ``picked`` (in
    ``opt.comps``' order): its base's plus each choice's, summed in that order."""
    return tuple(_evaluated(opt, picked, 0.0)[1])


def solve(options: list[Option], budget: float | None, overlap: float, milp_only: bool = False) -> Solution | None:
    """The best option and choices (None when nothing fits the budget). ``milp_only``: skip the
    enumeration (the tests compare both)."""
    if not milp_only and sum(_combinations(o) for o in options) <= ENUMERATE_LIMIT:
        return _enumerate(options, budget, overlap)
    return _milp(options, budget, overlap)


def _combinations(opt: Option) -> int:
    n = 1
    for ch in opt.comps.values():
        n *= max(len(ch), 1)
    return n


def _enumerate(options: list[Option], budget: float | None, overlap: float) -> Solution | None:
    """solve by costing every (option, component choices): the MILP's optimum and tie-breaks
    (least time; within the MILP's tolerance of it, fewest idle axes, then the options a plain
    optimizer steps, then least memory normalised as the MILP normalises it)."""
    every_t = [o.base[0] for o in options] + [v[0] for o in options for ch in o.comps.values() for v in ch.values()]
    every_m = [m for o in options for m in o.base[3:]]
    every_m += [m for o in options for ch in o.comps.values() for v in ch.values() for m in v[3:]]
    scale = 1e6 / max(max(abs(t) for t in every_t), 1e-30)  # as the MILP scales time (see _milp)
    norm = max(sum(abs(m) for m in every_m), 1.0)
    found = []  # (time, memory, idle, option index, choice per component, largest row)
    for g, opt in enumerate(options):
        keys = list(opt.comps)
        names = [list(opt.comps[c]) for c in keys]
        if _combinations(opt) <= SMALL:
            found += _costed(g, opt, keys, names, budget, overlap)
            continue
        combos = np.array(list(itertools.product(*[range(len(n)) for n in names])), dtype=np.int64)
        if combos.size == 0:
            combos = np.zeros((1, 0), dtype=np.int64)
        total = np.tile(np.array(opt.base, dtype=float), (len(combos), 1))
        idle = np.full(len(combos), float(opt.idle))
        for j, c in enumerate(keys):
            table = np.array([opt.comps[c][k] for k in names[j]], dtype=float)
            total += table[combos[:, j]]
            idle += np.array([opt.idle_choice.get(k, 0.0) for k in names[j]])[combos[:, j]]
        time = total[:, 0] + np.maximum(0.0, total[:, 1] - overlap * total[:, 2])
        mem, row = total[:, 3:].max(axis=1), total[:, 3:].argmax(axis=1)
        ok = mem <= budget if budget is not None else np.ones(len(combos), dtype=bool)
        for i in np.flatnonzero(ok):
            picked = tuple(names[j][combos[i, j]] for j in range(len(keys)))
            found.append((time[i], mem[i], idle[i], g, picked, int(row[i])))
    if not found:
        return None
    best = min(f[0] for f in found)
    limit = best * (1 + 1e-9) + 1e-6 / scale
    tied = [f for f in found if f[0] <= limit]
    t, m, _, g, picked, row = min(
        tied, key=lambda f: (2.0 * f[2] + options[f[3]].wrapped + f[1] / norm + 1e-12 * f[0] * scale, f[3])
    )
    return Solution(options[g].label, dict(zip(options[g].comps, picked)), float(t), float(m), "enumerated", row)


SMALL = 64  # an option with at most this many combinations is costed in Python (numpy's set-up outweighs it)


def _costed(g: int, opt: Option, keys: list, names: list, budget: float | None, overlap: float) -> list:
    """_enumerate's rows of option ``g`` one combination at a time: the same sums in the same
    order as its numpy rows (base, then each component's coefficients), so the same floats. The
    search solves each of its ~2,000 options alone (explain's runners-up), 2-16 combinations
    each, where the arrays cost more than the sums (a tenth of a 512-rank search)."""
    out = []
    for picked in itertools.product(*[range(len(n)) for n in names]):
        chosen = tuple(names[j][picked[j]] for j in range(len(keys)))
        time, m = _evaluated(opt, chosen, overlap)
        peak = max(m)
        if budget is not None and not peak <= budget:
            continue
        idle = float(opt.idle)
        for k in chosen:  # in the numpy rows' order: the same floats
            idle += opt.idle_choice.get(k, 0.0)
        out.append((time, peak, idle, g, chosen, m.index(peak)))
    return out


def _milp(options: list[Option], budget: float | None, overlap: float) -> Solution | None:
    from scipy.optimize import Bounds, LinearConstraint, milp  # here: scipy costs import autopar ~0.3 s

    cols = []  # (kind, g, comp, choice)
    for g, opt in enumerate(options):
        cols.append(("x", g, None, None))
        cols.append(("e", g, None, None))
        for c, ch in opt.comps.items():
            cols += [("w", g, c, k) for k in ch]
    cols.append(("m", None, None, None))  # the memory per rank: at least each moment's
    idx = {col: i for i, col in enumerate(cols)}
    n = len(cols)
    moments = len(options[0].base) - 3
    cost, mem = np.zeros(n), np.zeros((moments, n))
    rows, lo, hi = [], [], []
    continuous = [col[0] in ("e", "m") for col in cols]

    def coef(col):
        _, g, c, k = col
        return options[g].base if c is None else options[g].comps[c][k]

    one = np.zeros(n)
    for col, i in idx.items():
        if col[0] == "e":
            cost[i] = 1.0
            continue
        if col[0] == "m":
            continue
        t, _, _, *m = coef(col)
        cost[i], mem[:, i] = t, m
        if col[0] == "x":
            one[i] = 1.0
    rows.append(one)
    lo.append(1)
    hi.append(1)
    # Seconds are tiny numbers: HiGHS's absolute tolerances (1e-6 gap, 1e-7 feasibility) would
    # blur them, so time is measured in units that make the largest coefficient 1e6.
    scale = 1e6 / max(float(np.abs(cost).max()), 1e-30)
    cost = np.where([col[0] == "e" for col in cols], 1.0, cost * scale)
    for g, opt in enumerate(options):
        sync = np.zeros(n)
        sync[idx[("e", g, None, None)]] = -1.0
        for col in [("x", g, None, None)] + [("w", g, c, k) for c, ch in opt.comps.items() for k in ch]:
            _, s, b, *_ = coef(col)
            sync[idx[col]] = (s - overlap * b) * scale
        rows.append(sync)
        lo.append(-np.inf)
        hi.append(0.0)
        for c, ch in opt.comps.items():
            r = np.zeros(n)
            r[idx[("x", g, None, None)]] = -1.0
            for k in ch:
                r[idx[("w", g, c, k)]] = 1.0
            rows.append(r)
            lo.append(0)
            hi.append(0)
    for row in mem:  # each moment within the budget, and m at least each moment
        if budget is not None:
            rows.append(row)
            lo.append(-np.inf)
            hi.append(float(budget))
        at_least = row.copy()
        at_least[idx[cols[-1]]] = -1.0
        rows.append(at_least)
        lo.append(-np.inf)
        hi.append(0.0)
    integrality = np.array([0 if c else 1 for c in continuous])
    upper = np.array([np.inf if c else 1.0 for c in continuous])
    bounds = Bounds(np.zeros(n), upper)
    res = milp(
        cost,
        constraints=LinearConstraint(np.array(rows), lo, hi),
        integrality=integrality,
        bounds=bounds,
        options=EXACT,
    )
    if res.x is not None:
        # Ties (ZeRO-2 costs what ZeRO-0 costs when the sync hides behind backward; a tiny model
        # whose every option is latency) go first to the options that use every rank, then to
        # those a plain torch.optim optimizer steps (Option.wrapped), then to the least memory: a
        # second solve, the time held within 1e-9 of the optimum (lexicographic; the memory term
        # is normalised below 1, so one idle axis, or a wrapped optimizer, outweighs any memory).
        rows.append(cost)
        lo.append(-np.inf)
        hi.append(res.fun * (1 + 1e-9) + 1e-6)
        idle = np.array([_idle(options, col) for col in cols])
        wrapped = np.array([float(options[col[1]].wrapped) if col[0] == "x" else 0.0 for col in cols])
        peak = np.zeros(n)
        peak[idx[cols[-1]]] = 1.0 / max(float(np.abs(mem).sum()), 1.0)
        second = milp(
            2.0 * idle + wrapped + peak + 1e-12 * cost,
            constraints=LinearConstraint(np.array(rows), lo, hi),
            integrality=integrality,
            bounds=bounds,
            options=EXACT,
        )
        res = second if second.x is not None else res
    if res.x is None:
        return None
    x = np.round(res.x[:])
    g = next(g for g in range(len(options)) if x[idx[("x", g, None, None)]] > 0.5)
    choices = {c: next(k for k in ch if x[idx[("w", g, c, k)]] > 0.5) for c, ch in options[g].comps.items()}
    # the chosen combination's time and memory as _costed sums them (HiGHS's continuous e and m
    # sit within its tolerances of their bounds, 1e-9 of the time)
    opt = options[g]
    time, rows = _evaluated(opt, tuple(choices[c] for c in opt.comps), overlap)
    row = rows.index(max(rows))
    return Solution(opt.label, choices, time, rows[row], res.message, row)


def _evaluated(opt: Option, picked: tuple, overlap: float) -> tuple[float, list]:
    """(time, memory at each moment) of option ``opt`` with its components' choices ``picked``
    (in ``opt.comps``' order): the base's and each choice's coefficients summed in that order."""
    t, s, h, *m = opt.base
    for c, k in zip(opt.comps, picked):
        dt, ds, dh, *dm = opt.comps[c][k]
        t, s, h, m = t + dt, s + ds, h + dh, [a + b for a, b in zip(m, dm)]
    return t + max(0.0, s - overlap * h), m


def _idle(options, col) -> float:
    """The tie-break's idle axes of a column: an option's, or a fraction for an unsplit component."""
    kind, g, _, k = col
    if kind == "x":
        return options[g].idle
    return options[g].idle_choice.get(k, 0.0) if kind == "w" else 0.0
